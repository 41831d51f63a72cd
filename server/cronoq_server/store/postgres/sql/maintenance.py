"""The statements of maintenance.py."""

from __future__ import annotations

from ...logic import POOL_PAUSE_COLUMNS, POOL_PAUSE_UPSERT, SCHEDULE_COLUMNS, SCHEDULE_UPSERT
from . import DELETE_WITH_TASKS, WORKER_COLUMNS

# A transaction whose commit does not wait for the WAL to reach the disk.
SKIP_FLUSH = "SET LOCAL synchronous_commit = off"


def purge_sql(groups: list[str]) -> str:
    """The statement that deletes up to $1 ended tasks past retention, oldest finished first,
    with their dependencies and attempts (their events age out of the watch window:
    Store.delete_tasks), and up to $1 request records created before $2. Each group (its states
    as SQL, from logic.retained; its pool and cutoff the next two parameters) is a range of
    tasks_finished per state, read in order, at most $1 rows each."""
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


# Registers worker $1 (WORKER_COLUMNS in order, $1..$8), or updates what it says of itself.
REGISTER_WORKER = (
    f"INSERT INTO {{s}}.workers ({WORKER_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
    " ON CONFLICT (id) DO UPDATE SET"
    " name = excluded.name, pools = excluded.pools, concurrency = excluded.concurrency,"
    " labels = excluded.labels, last_seen_at = excluded.last_seen_at"
)

DEREGISTER_WORKER = "DELETE FROM {s}.workers WHERE id = $1"

GET_WORKER = f"SELECT {WORKER_COLUMNS} FROM {{s}}.workers WHERE id = $1"

LIST_WORKERS = f"SELECT {WORKER_COLUMNS} FROM {{s}}.workers ORDER BY id"

RUNNING_BY_WORKER = "SELECT worker_id, count(*) FROM {s}.tasks WHERE state = 3 GROUP BY worker_id"

# Deletes the workers last seen before $1: their ids.
REAP_WORKERS = "DELETE FROM {s}.workers WHERE last_seen_at < $1 RETURNING id"

# Pauses or resumes a pool (logic.pool_pause_values, $1..$4): the pool's row.
SET_POOL_PAUSED = POOL_PAUSE_UPSERT.format(s="{s}.", p1="$1", p2="$2", p3="$3", p4="$4")

PAUSED_POOLS = f"SELECT {POOL_PAUSE_COLUMNS} FROM {{s}}.pools WHERE paused ORDER BY name"


def put_schedule(values: int) -> str:
    """Stores a schedule (logic.schedule_values, $1 to $values): its row."""
    marks = ", ".join(f"${n}" for n in range(1, values + 1))
    return f"INSERT INTO {{s}}.schedules ({SCHEDULE_COLUMNS}) VALUES ({marks})" + SCHEDULE_UPSERT


# Deletes the schedule of pool $1 named $2.
DELETE_SCHEDULE = "DELETE FROM {s}.schedules WHERE pool = $1 AND name = $2"

# The schedules of the pools $1 (NULL: of all), by pool and name.
LIST_SCHEDULES = (
    f"SELECT {SCHEDULE_COLUMNS} FROM {{s}}.schedules WHERE $1::text[] IS NULL OR pool = ANY($1) ORDER BY pool, name"
)

# The schedules not paused due at $1, earliest first, at most $2.
DUE_SCHEDULES = (
    f"SELECT {SCHEDULE_COLUMNS} FROM {{s}}.schedules WHERE NOT paused AND next_fire_at <= $1"
    " ORDER BY next_fire_at LIMIT $2"
)

# When the next schedule not paused fires after $1.
NEXT_FIRE = "SELECT min(next_fire_at) FROM {s}.schedules WHERE NOT paused AND next_fire_at > $1"

# Schedule $4 of pool $3 fired at $1, next at $2, if it still fires next at $5 and was last put
# at $6: a duplicate or stale fire, or a Put since the read, moves nothing (no row).
FIRE_SCHEDULE = (
    "UPDATE {s}.schedules SET last_fire_at = $1, next_fire_at = $2 WHERE pool = $3 AND name = $4"
    " AND NOT paused AND next_fire_at = $5 AND updated_at = $6 RETURNING 1"
)
