"""The statements of events.py."""

from __future__ import annotations

from . import T_EVENT_TASK_COLUMNS, insert_events

# An event per task $1[i] at $2, with the state it left $3[i] and the task as it is now.
RECORD_EVENTS = insert_events(
    f"SELECT t.seq, t.state, t.attempt, $2::bigint, t.pool, u.prev, {T_EVENT_TASK_COLUMNS}"
    " FROM unnest($1::bigint[], $3::smallint[]) WITH ORDINALITY AS u(seq, prev, n)"
    " JOIN {s}.tasks t ON t.seq = u.seq ORDER BY u.n"
)

# The last pos given, locked: numberings go one at a time.
LAST_POS_FOR_UPDATE = "SELECT last_pos FROM {s}.event_log WHERE id = 1 FOR UPDATE"

# Numbers up to $2 committed rows of events, then of event_batches while fewer were left, after
# pos $1: the last pos given and how many rows were numbered.
NUMBER_BATCH = (
    "WITH todo_old AS (SELECT id, row_number() OVER (ORDER BY id) AS upto FROM {s}.events"
    " WHERE pos IS NULL ORDER BY id LIMIT $2),"
    " old AS (UPDATE {s}.events e SET pos = $1 + todo_old.upto FROM todo_old"
    " WHERE e.id = todo_old.id AND e.pos IS NULL RETURNING e.pos),"
    " base AS (SELECT coalesce(max(upto), 0) AS k FROM todo_old),"
    " todo AS (SELECT id, sum(n) OVER (ORDER BY id) AS upto FROM {s}.event_batches"
    " WHERE last_pos IS NULL ORDER BY id LIMIT $2),"
    " new AS (UPDATE {s}.event_batches e SET last_pos = $1 + base.k + todo.upto FROM todo, base"
    " WHERE e.id = todo.id AND e.last_pos IS NULL AND base.k < $2 RETURNING e.last_pos AS pos)"
    " UPDATE {s}.event_log SET last_pos = coalesce(greatest((SELECT max(pos) FROM old),"
    " (SELECT max(pos) FROM new)), last_pos)"
    " WHERE id = 1 RETURNING last_pos, (SELECT count(*) FROM old) + (SELECT count(*) FROM new)"
)


def events_after(columns: str) -> str:
    """Rows of both tables after pos $1 in pos order (at most $2), each a range of events:
    its last pos, how many, and the columns as arrays."""
    one = ", ".join(f"ARRAY[{c}]" for c in columns.split(", "))
    return (
        f"(SELECT pos, 1, {one} FROM {{s}}.events WHERE pos > $1 ORDER BY pos LIMIT $2)"
        f" UNION ALL (SELECT last_pos, n, {columns} FROM {{s}}.event_batches"
        " WHERE last_pos > $1 ORDER BY last_pos LIMIT $2) ORDER BY 1 LIMIT $2"
    )


# The tasks not yet ended (PENDING, BLOCKED, RUNNING) counted by pool and state.
UNFINISHED_BY_POOL_AND_STATE = (
    "SELECT pool, state, count(*) FROM {s}.tasks WHERE state IN (1, 2, 3) GROUP BY pool, state"
)

EVENT_BOUNDS = "SELECT purged_through, last_pos FROM {s}.event_log WHERE id = 1"

# Deletes the events older than $1 among the oldest $2 numbered rows of each table: how many.
# Only those rows are looked at: the scan never reaches into the window. Rows of event_batches
# go whole: up to $2 events, or the oldest row when it holds more.
PURGE_EVENTS = (
    "WITH old AS (SELECT max(pos) AS pos FROM (SELECT pos, at FROM {s}.events WHERE pos IS NOT NULL"
    " ORDER BY pos LIMIT $2) x WHERE at < $1),"
    " new AS (SELECT max(last_pos) AS pos FROM (SELECT last_pos, last_at, sum(n) OVER w AS upto,"
    " row_number() OVER w AS k FROM {s}.event_batches WHERE last_pos IS NOT NULL"
    " WINDOW w AS (ORDER BY last_pos) ORDER BY last_pos LIMIT $2) x"
    " WHERE last_at < $1 AND (upto <= $2 OR k = 1)),"
    " bound AS (SELECT greatest(old.pos, new.pos) AS pos FROM old, new),"
    " gone AS (DELETE FROM {s}.events WHERE pos <= (SELECT pos FROM old) RETURNING 1),"
    " gone_batches AS (DELETE FROM {s}.event_batches WHERE last_pos <= (SELECT pos FROM new) RETURNING n),"
    " mark AS (UPDATE {s}.event_log SET purged_through = greatest(purged_through, (SELECT pos FROM bound))"
    " WHERE id = 1 AND (SELECT pos FROM bound) IS NOT NULL)"
    " SELECT (SELECT count(*) FROM gone) + (SELECT coalesce(sum(n), 0) FROM gone_batches)"
)
