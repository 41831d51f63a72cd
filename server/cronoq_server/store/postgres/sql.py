"""SQL texts of the PostgreSQL store: fragments and the small functions that build statements."""

from __future__ import annotations

from ..base import ATTEMPT_COLUMNS, EVENT_COLUMNS, EVENT_TASK_COLUMNS, TASK_COLUMNS
from ..logic import Dialect

_DIALECT = Dialect(
    mark=lambda n: f"${n}",
    any_of=lambda column, mark, sql_type: f"{column} = ANY({mark}::{sql_type}[])",
    array=list,
    contains="strpos({0}, {1}) > 0",
)


WORKER_COLUMNS = "id, name, pools, concurrency, labels, registered_at, last_seen_at, principal"


_EVENT_ARRAYS = ", ".join(f"array_agg(e.{c})" for c in EVENT_COLUMNS.split(", "))


def events_of(state: str, attempt: str, at: str, prev: str, source: str) -> str:
    """insert_events of the rows of source (a CTE's RETURNING: seq, pool and EVENT_TASK_COLUMNS)."""
    return insert_events(f"SELECT seq, {state}, {attempt}, {at}, pool, {prev}, {EVENT_TASK_COLUMNS} FROM {source}")


def insert_events(select: str) -> str:
    """The statement that records the events select yields (EVENT_COLUMNS of the rows a change
    left, of a CTE's RETURNING or of tasks t) as one row of event_batches, or none for none."""
    return (
        f"INSERT INTO {{s}}.event_batches (n, last_at, {EVENT_COLUMNS})"
        f" SELECT count(*), max(e.at), {_EVENT_ARRAYS} FROM ({select}) AS e({EVENT_COLUMNS}) HAVING count(*) > 0"
    )


INSERT_ATTEMPTS = f"INSERT INTO {{s}}.attempts ({ATTEMPT_COLUMNS})"


T_EVENT_TASK_COLUMNS = ", ".join(f"t.{c}" for c in EVENT_TASK_COLUMNS.split(", "))


def startable(now: str) -> str:
    """SQL: a PENDING task (of tasks, unaliased or t) may still start at now: not past its start_by."""
    return f"(start_by IS NULL OR start_by > {now})"


# The tasks of the keys $1: those a submission may change locked for update, the others for share.
# It may change those of its own keys ($2) that it replaces (keys $3) or whose hold is over at $4
# (as logic.key_released decides): each lock taken at once (share then update could deadlock).
_CHANGES = (
    "(key = ANY($2::text[]) AND (key = ANY($3::text[]) OR (key_ttl_ms > 0 AND state IN (4, 5, 6, 7)"
    " AND coalesce(finished_at + key_ttl_ms * 1000 <= $4, false))))"
)
KEYED_ROWS = (
    f"WITH changed AS (SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE key = ANY($1::text[]) AND {_CHANGES} FOR UPDATE),"
    f" named AS (SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE key = ANY($1::text[]) AND NOT {_CHANGES} FOR SHARE)"
    " SELECT * FROM changed UNION ALL SELECT * FROM named"
)

# A task whose key's hold is over (logic.key_released) keeps the key it had apart: the key is free.
RELEASE_KEY = "UPDATE {s}.tasks SET released_key = key, key = NULL WHERE seq = $1"

# Replacing submissions (logic.replaced): each task's payload, content type, priority and due
# time, with an event that keeps its state (now $6).
REPLACE = (
    "WITH r AS (UPDATE {s}.tasks t SET payload = u.payload, content_type = u.content_type,"
    " priority = u.priority, run_at = u.run_at FROM unnest($1::bigint[], $2::bytea[], $3::text[], $4::int[],"
    " $5::bigint[]) AS u(seq, payload, content_type, priority, run_at) WHERE t.seq = u.seq"
    f" RETURNING t.seq, t.pool, t.state, t.attempt, {T_EVENT_TASK_COLUMNS})"
    f" {events_of('state', 'attempt', '$6::bigint', 'state', 'r ORDER BY seq')}"
)

# The PENDING and BLOCKED tasks past their start_by (now $1, at most $2), earliest first, locked
# (a lease that holds one is taking it: it started in time); and ending them (error $2, seqs $3).
EXPIRING = (
    "SELECT seq, state FROM {s}.tasks WHERE start_by <= $1 AND state IN (1, 2)"
    " ORDER BY start_by, seq LIMIT $2 FOR UPDATE SKIP LOCKED"
)
EXPIRE = "UPDATE {s}.tasks SET state = 7, error = $2, finished_at = $1, blocked_on = 0 WHERE seq = ANY($3::bigint[])"


# The CTEs that delete the dependencies and attempts of the tasks `gone` returns: looked up by
# their seqs (an index condition; a join planned from the CTE's estimate read every attempt).
DELETE_WITH_TASKS = (
    " deps AS (DELETE FROM {s}.deps WHERE task_seq = ANY(ARRAY(SELECT seq FROM gone))),"
    " attempts AS (DELETE FROM {s}.attempts WHERE task_seq = ANY(ARRAY(SELECT seq FROM gone)))"
)


def purge_sql(groups: list[str]) -> str:
    """The statement that deletes up to $1 ended tasks past retention, oldest finished first,
    with their dependencies and attempts (their events age out of the watch window: Store.delete_tasks),
    and up to $1 request records created
    before $2. Each group (its states as SQL, from logic.retained; its pool and cutoff the next
    two parameters) is a range of tasks_finished per state, read in order, at most $1 rows each."""
    scans = " UNION ALL ".join(
        f"(SELECT seq, finished_at FROM {{s}}.tasks WHERE state IN (4, 5, 6, 7) AND state = {state}"
        f" AND pool = ${2 * i + 3} AND finished_at < ${2 * i + 4} ORDER BY finished_at LIMIT $1)"
        for i, states in enumerate(groups)
        for state in states.split(", ")
    )
    return (
        "WITH victims AS (SELECT seq FROM ("
        + (scans or "SELECT NULL::bigint AS seq, NULL::bigint AS finished_at WHERE false")
        + ") AS v ORDER BY finished_at, seq LIMIT $1),"
        # A task retried meanwhile is no longer ended: the delete, which waited for it, leaves it.
        " gone AS (DELETE FROM {s}.tasks WHERE seq = ANY(ARRAY(SELECT seq FROM victims)) AND state IN (4, 5, 6, 7)"
        f" RETURNING seq),{DELETE_WITH_TASKS},"
        " requests AS (DELETE FROM {s}.requests WHERE id = ANY(ARRAY(SELECT id FROM {s}.requests"
        " WHERE created_at < $2 ORDER BY created_at LIMIT $1)))"
        " SELECT count(*) FROM gone"
    )


# Two arrays a statement returns beside the rows it leased go in its first row only: in every
# row, a step of n outcomes and n tasks would send and decode n² elements.
_ONCE = "CASE WHEN row_number() OVER () = 1 THEN {} END"


# What a task (alias t) weighs in a lease reply.
LEASE_SIZE = "octet_length(t.payload) + octet_length(coalesce(t.key, '')) + octet_length(t.content_type)"


def _free_for(entry: str) -> str:
    """SQL: what the lease's `free` ($8) has for a resources entry, as fair.free_for: its own,
    else its keyed resource's full size ("name:"), else 0."""
    return f"coalesce($8::jsonb ->> {entry}, $8::jsonb ->> left({entry}, strpos({entry}, ':')), '0')::bigint"


# A due task (of tasks, unaliased) fits alone: every amount it names is free ($8).
_FITS_ALONE = (
    f"NOT EXISTS (SELECT 1 FROM jsonb_each_text(resources::jsonb) r WHERE {_free_for('r.key')} < r.value::bigint)"
)


def _next_key(pool: str, after: str) -> str:
    """SQL: the key of a pool's PENDING tasks after the one given (one step of tasks_keyed)."""
    return (
        "(SELECT res_key FROM {s}.tasks WHERE state = 1 AND pool = "
        f"{pool} AND res_key > {after} ORDER BY res_key LIMIT 1)"
    )


# The keyed part of a lease's CTEs (the pools $4, each one's key to start after $11, KEY_SCAN
# $12): `keys`, the keys of each pool's PENDING tasks it visits in order (n) — those after
# the one given, then from the first again up to it — and `keyed`, of each key with room,
# its first due tasks that fit alone, as many as it has room for. A key without room costs
# one index step; its tasks are never read. (OFFSET 0: each step's look-up runs once, not
# once per use.) {place}: what a lease of several pools adds to each row (_lease_ctes).
_KEYED = (
    " keys AS (WITH RECURSIVE k(pool, after, key, n, wrapped) AS ("
    " SELECT p.pool, p.after, coalesce(s.nx, CASE WHEN p.after <> '' THEN "
    + _next_key("p.pool", "''")
    + " END), 1, s.nx IS NULL FROM unnest($4::text[], $11::text[]) AS p(pool, after),"
    " LATERAL (SELECT " + _next_key("p.pool", "p.after") + " AS nx OFFSET 0) AS s"
    " UNION ALL SELECT k.pool, k.after, coalesce(s.nx, CASE WHEN NOT k.wrapped AND k.after <> '' THEN "
    + _next_key("k.pool", "''")
    + " END), k.n + 1, k.wrapped OR s.nx IS NULL FROM k, LATERAL (SELECT "
    + _next_key("k.pool", "k.key")
    + " AS nx OFFSET 0) AS s WHERE k.key IS NOT NULL AND k.n < $12 AND NOT (k.wrapped AND k.key > k.after))"
    " SELECT pool, key, n FROM k WHERE key IS NOT NULL AND NOT (wrapped AND key > after)),"
    f" keyed AS (SELECT x.*{{place}} FROM keys, LATERAL (SELECT seq, priority, run_at, {LEASE_SIZE} AS size, resources"
    " FROM {s}.tasks t"
    " WHERE state = 1 AND pool = keys.pool AND res_key = keys.key AND run_at <= $1 AND "
    + startable("$1")
    + " AND "
    + _FITS_ALONE
    + f" ORDER BY priority DESC, run_at, seq LIMIT least({_free_for('keys.key')}, $2) FOR UPDATE SKIP LOCKED)"
    f" AS x WHERE {_free_for('keys.key')} > 0 AND {{fence}})"
)


def _in_turns(rows: str, limit: str) -> str:
    """SQL: of these rows of several pools, each with its pool's place in turn order, the first
    limit dealt round robin: each pool's first in lease order (turn 1), then each one's second..."""
    return (
        "SELECT *, row_number() OVER (PARTITION BY place ORDER BY priority DESC, run_at, seq) AS turn"
        f" FROM ({rows}) AS d ORDER BY turn, place LIMIT {limit}"
    )
