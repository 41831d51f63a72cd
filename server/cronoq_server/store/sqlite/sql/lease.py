"""SQL of lease.py: leases (plain, fair and keyed), heartbeats and the resources held."""

from __future__ import annotations

from ...base import EVENT_COLUMNS, TASK_COLUMNS
from ...fair import RANK_BATCH
from ...logic import HEARTBEAT_COLUMNS
from . import marks

# What a leased task counts against a lease's max_bytes, before the per-task overhead.
LEASE_SIZE = "length(payload) + length(coalesce(key, '')) + length(content_type)"
# A PENDING task a lease may take at now (the one parameter): due, and not past its start_by.
STARTABLE = "? BETWEEN run_at AND coalesce(start_by - 1, 9223372036854775807)"
# A lease's order within a pool.
_ORDER = "priority DESC, run_at, seq"


def _lease_size(overhead: int) -> str:
    """What a leased task counts against max_bytes, with the per-task overhead."""
    return f"{LEASE_SIZE} + {int(overhead)}"


def _free_for(entry: str) -> str:
    """SQL: what the lease's `free` has for a resources entry, as fair.free_for: its own, else
    its keyed resource's full size ("name:"), else 0."""
    own = f"(SELECT amount FROM free WHERE name = {entry})"
    default = f"(SELECT amount FROM free WHERE name = substr({entry}, 1, instr({entry}, ':')))"
    return f"coalesce({own}, {default}, 0)"


# A due task fits alone: every amount it names is free (in the lease's `free` table).
_FITS_ALONE = f"NOT EXISTS (SELECT 1 FROM json_each(tasks.resources) r WHERE r.value > {_free_for('r.key')})"
# What a lease's `free` has (JSON, its parameter), for _free_for.
_FREE = "WITH free AS MATERIALIZED (SELECT key AS name, value AS amount FROM json_each(?))"
# Of a lease's candidates that name resources (cand), the running total of each resource they
# name, in lease order (need); those that fit beside the ones before them.
_NEED = (
    "need AS (SELECT c.seq, r.key AS name, sum(r.value) OVER (PARTITION BY r.key"
    " ORDER BY c.priority DESC, c.run_at, c.seq) AS upto FROM cand c, json_each(c.resources) r)"
)
_FITS_BESIDE = f"seq NOT IN (SELECT seq FROM need WHERE upto > {_free_for('need.name')})"

# When a pool's next PENDING task not yet due becomes due (pool, now): one step of tasks_due.
NEXT_DUE = "SELECT min(run_at) FROM tasks INDEXED BY tasks_due WHERE state = 1 AND pool = ? AND run_at > ?"
# The key of a pool's PENDING tasks after the one given (logic.KEY_SCAN).
NEXT_KEY = (
    "SELECT res_key FROM tasks INDEXED BY tasks_keyed WHERE state = 1 AND pool = ? AND res_key > ?"
    " ORDER BY res_key LIMIT 1"
)
# A key's first due tasks (pool, key, now, how many) that fit alone in free (JSON, the first).
KEY_HEAD = (
    f"{_FREE} SELECT seq FROM tasks INDEXED BY tasks_keyed WHERE state = 1 AND pool = ? AND res_key = ?"
    f" AND ? BETWEEN run_at AND coalesce(start_by - 1, 9223372036854775807) AND {_FITS_ALONE}"
    " ORDER BY priority DESC, run_at, seq LIMIT ?"
)
# A task's rank in its group's turn (rank, seq).
SET_GROUP_RANK = "UPDATE tasks SET group_rank = ? WHERE seq = ?"
# The events of leased tasks (EVENT_COLUMNS).
INSERT_EVENT = f"INSERT INTO events ({EVENT_COLUMNS}) VALUES ({', '.join('?' * 13)})"
# A worker is seen (now, id).
TOUCH_WORKER = "UPDATE workers SET last_seen_at = ? WHERE id = ?"
# A lease extended (lease_expires_at, seq).
EXTEND_LEASE = "UPDATE tasks SET lease_expires_at = ? WHERE seq = ?"
# An attempt's report (progress or NULL, whether a checkpoint, the checkpoint, seq).
KEEP_REPORT = (
    "UPDATE tasks SET progress = coalesce(?, progress), checkpoint = CASE WHEN ? THEN ? ELSE checkpoint END"
    " WHERE seq = ?"
)
# A pool's PENDING tasks stored before it capped its groups (pool): ranked when due.
UNRANKED_WHEN_DUE = "UPDATE tasks SET group_rank = 0 WHERE state = 1 AND pool = ? AND group_rank IS NULL"
# The lowest rank of a pool's ranked PENDING tasks (pool); each group's highest (pool).
LOWEST_RANK = "SELECT min(group_rank) FROM tasks WHERE state = 1 AND group_rank > 0 AND pool = ?"
GROUP_RANKS = (
    "SELECT group_key, max(group_rank) FROM tasks WHERE state = 1 AND group_rank > 0 AND pool = ? GROUP BY group_key"
)


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


def next_unranked(pools: int) -> str:
    """When the next task not yet ranked of these pools (their names) became due."""
    return f"SELECT min(run_at) FROM tasks WHERE state = 1 AND group_rank = 0 AND pool IN ({marks(pools)})"


def due_unranked(pools: int) -> str:
    """The first RANK_BATCH due tasks not yet ranked of these pools (their names, now), with their groups."""
    return (
        f"SELECT seq, pool, group_key FROM tasks WHERE state = 1 AND group_rank = 0 AND pool IN ({marks(pools)})"
        f" AND run_at <= ? ORDER BY run_at, seq LIMIT {RANK_BATCH}"
    )


def fair_heads(pools: int, overhead: int) -> str:
    """Each pool's first ranked tasks a lease may take (pool, now, how many; a pool after the
    other), with their size, resources, priority and rank."""
    size = _lease_size(overhead)
    return " UNION ALL ".join(
        f"SELECT * FROM (SELECT seq, pool, group_key, {size}, resources, priority, group_rank FROM tasks"
        " INDEXED BY tasks_fair"
        f" WHERE state = 1 AND group_rank > 0 AND pool = ? AND {STARTABLE}"
        " ORDER BY priority DESC, group_rank, seq LIMIT ?)"
        for _ in range(pools)
    )


def lease_plain(pools: int, overhead: int, resources: bool) -> str:
    """The seqs a lease of these pools takes, in lease order (Lease._lease_plain). Parameters:
    the pools' names, now, limit; with resources, before them free (JSON), the pools' names, now,
    the scan, the keyed seqs (JSON), the scan, and after them limit; then max_bytes twice."""
    size = _lease_size(overhead)
    due = f"state = 1 AND pool IN ({marks(pools)}) AND {STARTABLE}"
    order = _ORDER
    # Tasks that name no resources, and those that do, are in indexes of their own: the
    # first never wait behind the second.
    # INDEXED BY: the planner would rather range over tasks_due (pool, run_at) and sort every
    # due task (a lease of 64 among 60,000 pending cost 30% of the burn-down).
    plain = (
        f"SELECT seq, priority, run_at, {size} AS size FROM tasks INDEXED BY tasks_lease"
        f" WHERE {due} AND resources IS NULL"
    )
    ok = f"{plain} ORDER BY {order} LIMIT ?"
    if resources:
        # Of the due tasks that name resources, the first whose every amount is available
        # alone (in index order, checked only until enough are found: those of a resource
        # used up never fill the window), and those of the keys with room a keyed resource
        # names (Lease._keyed); of those, the ones that still fit beside the tasks before them
        # (running totals per resource).
        ok = (
            f"{_FREE}, cand AS (SELECT * FROM (SELECT seq, priority, run_at, resources, {size} AS size FROM tasks"
            f" INDEXED BY tasks_lease_resources WHERE {due} AND resources IS NOT NULL AND res_key IS NULL"
            f" AND {_FITS_ALONE} ORDER BY {order} LIMIT ?)"
            f" UNION ALL SELECT seq, priority, run_at, resources, {size} FROM tasks"
            f" WHERE seq IN (SELECT value FROM json_each(?)) ORDER BY {order} LIMIT ?),"
            f" {_NEED} SELECT * FROM (SELECT * FROM ({ok})"
            f" UNION ALL SELECT seq, priority, run_at, size FROM cand WHERE {_FITS_BESIDE})"
            f" ORDER BY {order} LIMIT ?"
        )
    return _within_bytes(ok, order)


def lease_in_turns(pools: int, overhead: int, resources: bool, keyed: bool) -> str:
    """lease_plain of several pools, dealt round robin (Lease._lease_in_turns). Parameters: each
    pool's name, now, limit; with resources, before them free (JSON), each pool's name, now, the
    scan, with keyed each pool's keyed seqs (JSON), then the scan; then limit, max_bytes twice."""
    size = _lease_size(overhead)

    def each(columns: str, index: str, where: str) -> str:
        return " UNION ALL ".join(
            f"SELECT * FROM (SELECT {columns}, {place} AS place FROM tasks INDEXED BY {index}"
            f" WHERE state = 1 AND pool = ? AND {STARTABLE} AND {where} ORDER BY {_ORDER} LIMIT ?)"
            for place in range(pools)
        )

    ok = each(f"seq, priority, run_at, {size} AS size", "tasks_lease", "resources IS NULL")
    if resources:
        # As lease_plain's, each pool's own (those of a keyed resource by key: Lease._keyed).
        where = f"resources IS NOT NULL AND res_key IS NULL AND {_FITS_ALONE}"
        cand = each(f"seq, priority, run_at, resources, {size} AS size", "tasks_lease_resources", where)
        if keyed:
            for place in range(pools):
                cand += (
                    f" UNION ALL SELECT seq, priority, run_at, resources, {size}, {place} FROM tasks"
                    " WHERE seq IN (SELECT value FROM json_each(?))"
                )
        ok = (
            f"{_FREE}, cand AS ({_in_turns(f'({cand})')} LIMIT ?), {_NEED},"
            f" picked AS ({ok} UNION ALL SELECT seq, priority, run_at, size, place FROM cand WHERE {_FITS_BESIDE})"
            f" {_in_turns('picked')} LIMIT ?"
        )
    else:
        ok = f"{_in_turns(f'({ok})')} LIMIT ?"
    return _within_bytes(ok, "turn, place")


def take(pools: int, chosen: str) -> str:
    """Leases the PENDING tasks whose seqs chosen (SQL) gives, as task rows. Parameters: worker
    id, now, each pool's (name, expiry) twice with now between, then chosen's."""
    expiry = "CASE pool " + " ".join("WHEN ? THEN ?" for _ in range(pools)) + " END"
    return (
        f"UPDATE tasks SET state = 3, attempt = attempt + 1, worker_id = ?, started_at = ?,"
        # Never past the attempt's deadline (started_at + timeout_ms).
        f" lease_expires_at = CASE WHEN timeout_ms > 0 THEN min({expiry}, ? + timeout_ms * 1000) ELSE {expiry} END"
        f" WHERE state = 1 AND seq IN ({chosen}) RETURNING {TASK_COLUMNS}"
    )


def heartbeat_rows(seqs: int) -> str:
    """What a heartbeat reads of these tasks (their seqs)."""
    return f"SELECT {HEARTBEAT_COLUMNS} FROM tasks WHERE seq IN ({marks(seqs)})"


def running_resources(group_pools: int) -> str:
    """The RUNNING tasks that hold resources or a group's place (the pools that cap their groups)."""
    return (
        "SELECT worker_id, seq, attempt, resources, pool, group_key FROM tasks WHERE state = 3"
        f" AND (resources IS NOT NULL OR pool IN ({marks(group_pools)}))"
    )
