"""The SQLite store's shared SQL texts: named statements and fragments, and the builders that join them."""

from __future__ import annotations

import json

from ..base import ATTEMPT_COLUMNS, EVENT_COLUMNS, EVENT_TASK_COLUMNS
from ..logic import Dialect

_INSERT_ATTEMPT = f"INSERT INTO attempts ({ATTEMPT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
# What a leased task counts against a lease's max_bytes, before the per-task overhead.
LEASE_SIZE = "length(payload) + length(coalesce(key, '')) + length(content_type)"
_INSERT_EVENT = f"INSERT INTO events ({EVENT_COLUMNS}) VALUES ({', '.join('?' * 13)})"
_RECORD_EVENT = (
    f"INSERT INTO events ({EVENT_COLUMNS})"
    f" SELECT seq, state, attempt, ?, pool, ?, {EVENT_TASK_COLUMNS} FROM tasks WHERE seq = ?"
)

_DIALECT = Dialect(
    mark=lambda n: "?",
    any_of=lambda column, mark, _type: f"{column} IN (SELECT value FROM json_each({mark}))",
    array=json.dumps,
    contains="instr({0}, {1}) > 0",
)


def _free_for(entry: str) -> str:
    """SQL: what the lease's `free` has for a resources entry, as fair.free_for: its own, else
    its keyed resource's full size ("name:"), else 0."""
    own = f"(SELECT amount FROM free WHERE name = {entry})"
    default = f"(SELECT amount FROM free WHERE name = substr({entry}, 1, instr({entry}, ':')))"
    return f"coalesce({own}, {default}, 0)"


# A due task fits alone: every amount it names is free (in the lease's `free` table).
_FITS_ALONE = f"NOT EXISTS (SELECT 1 FROM json_each(tasks.resources) r WHERE r.value > {_free_for('r.key')})"
# When a pool's next PENDING task not yet due becomes due (pool, now): one step of tasks_due.
_NEXT_DUE = "SELECT min(run_at) FROM tasks INDEXED BY tasks_due WHERE state = 1 AND pool = ? AND run_at > ?"
# The key of a pool's PENDING tasks after the one given (logic.KEY_SCAN).
_NEXT_KEY = (
    "SELECT res_key FROM tasks INDEXED BY tasks_keyed WHERE state = 1 AND pool = ? AND res_key > ?"
    " ORDER BY res_key LIMIT 1"
)
# What a lease's `free` has (JSON, its parameter), for _free_for.
_FREE = "WITH free AS MATERIALIZED (SELECT key AS name, value AS amount FROM json_each(?))"
# A key's first due tasks (pool, key, now, how many) that fit alone in free (JSON, the first).
_KEY_HEAD = (
    f"{_FREE} SELECT seq FROM tasks INDEXED BY tasks_keyed WHERE state = 1 AND pool = ? AND res_key = ?"
    f" AND ? BETWEEN run_at AND coalesce(start_by - 1, 9223372036854775807) AND {_FITS_ALONE}"
    " ORDER BY priority DESC, run_at, seq LIMIT ?"
)


# A PENDING task a lease may take at now (the one parameter): due, and not past its start_by.
STARTABLE = "? BETWEEN run_at AND coalesce(start_by - 1, 9223372036854775807)"
# A lease's order within a pool.
_ORDER = "priority DESC, run_at, seq"
# Of a lease's candidates that name resources (cand), the running total of each resource they
# name, in lease order (need); those that fit beside the ones before them.
_NEED = (
    "need AS (SELECT c.seq, r.key AS name, sum(r.value) OVER (PARTITION BY r.key"
    " ORDER BY c.priority DESC, c.run_at, c.seq) AS upto FROM cand c, json_each(c.resources) r)"
)
_FITS_BESIDE = f"seq NOT IN (SELECT seq FROM need WHERE upto > {_free_for('need.name')})"


def _within_bytes(picked: str, order: str) -> str:
    """SQL: the seqs of the tasks picked (with their size), the first always, then as many as
    fit in max_bytes (the two parameters that follow picked's; <= 0: all) in this order."""
    return (
        f"SELECT seq FROM (SELECT seq, row_number() OVER w AS n, sum(size) OVER w AS upto FROM ({picked})"
        f" WINDOW w AS (ORDER BY {order})) WHERE n = 1 OR ? <= 0 OR upto <= ?"
    )


def _in_turns(picked: str) -> str:
    """SQL: the tasks picked (a table, or a query in parentheses) of several pools, each with its
    pool's place in turn order, dealt round robin: each pool's first in lease order (turn 1),
    then each one's second, ..."""
    return (
        f"SELECT *, row_number() OVER (PARTITION BY place ORDER BY {_ORDER}) AS turn FROM {picked} ORDER BY turn, place"
    )


def _marks(n: int) -> str:
    return ",".join("?" * n)


WORKER_COLUMNS = "id, name, pools, concurrency, labels, registered_at, last_seen_at, principal"
