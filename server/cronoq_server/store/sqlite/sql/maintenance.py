"""SQL of maintenance.py: purges, workers, paused pools and schedules."""

from __future__ import annotations

from ...logic import POOL_PAUSE_COLUMNS, POOL_PAUSE_UPSERT, SCHEDULE_COLUMNS, SCHEDULE_UPSERT
from . import marks

# The oldest ended tasks of a pool in one state (pool, finished before, how many): one range of
# the partial index of ended tasks (its own condition first, so the planner takes it).
_PAST_RETENTION = (
    "SELECT finished_at, seq FROM tasks INDEXED BY tasks_finished WHERE state IN (4, 5, 6, 7) AND state = {state}"
    " AND pool = ? AND finished_at < ? ORDER BY finished_at LIMIT ?"
)
# The requests recorded before a time.
DELETE_OLD_REQUESTS = "DELETE FROM requests WHERE created_at < ?"

WORKER_COLUMNS = "id, name, pools, concurrency, labels, registered_at, last_seen_at, principal"
REGISTER_WORKER = f"INSERT OR REPLACE INTO workers ({WORKER_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)"
DEREGISTER_WORKER = "DELETE FROM workers WHERE id = ?"
GET_WORKER = f"SELECT {WORKER_COLUMNS} FROM workers WHERE id = ?"
LIST_WORKERS = f"SELECT {WORKER_COLUMNS} FROM workers ORDER BY id"
RUNNING_BY_WORKER = "SELECT worker_id, COUNT(*) FROM tasks WHERE state = 3 GROUP BY worker_id"
# The workers last seen before a time, deleted.
REAP_WORKERS = "DELETE FROM workers WHERE last_seen_at < ? RETURNING id"

# A pool paused or resumed (logic.pool_pause_values), as it is then.
SET_POOL_PAUSED = POOL_PAUSE_UPSERT.format(s="", p1="?", p2="?", p3="?", p4="?")
PAUSED_POOLS = f"SELECT {POOL_PAUSE_COLUMNS} FROM pools WHERE paused ORDER BY name"

DELETE_SCHEDULE = "DELETE FROM schedules WHERE pool = ? AND name = ?"
# The schedules due at now (now, how many), earliest first; when the next one not yet due is (now).
DUE_SCHEDULES = (
    f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE paused = 0 AND next_fire_at <= ? ORDER BY next_fire_at LIMIT ?"
)
NEXT_FIRE = "SELECT MIN(next_fire_at) FROM schedules WHERE paused = 0 AND next_fire_at > ?"
# A schedule fired (last_fire_at, next_fire_at, pool, name), only as it was read (next_fire_at,
# updated_at): a duplicate or stale fire, or a Put since the read, moves nothing.
FIRE_SCHEDULE = (
    "UPDATE schedules SET last_fire_at = ?, next_fire_at = ? WHERE pool = ? AND name = ? AND paused = 0"
    " AND next_fire_at = ? AND updated_at = ?"
)


def past_retention(state: str) -> str:
    """_PAST_RETENTION of one state (one of logic.retained's, as SQL)."""
    return _PAST_RETENTION.format(state=state)


def delete_tasks(seqs: int) -> str:
    return f"DELETE FROM tasks WHERE seq IN ({marks(seqs)})"


def put_schedule(columns: int) -> str:
    """A schedule, inserted or replaced (logic.schedule_values, so many), as it is then."""
    return f"INSERT INTO schedules ({SCHEDULE_COLUMNS}) VALUES ({marks(columns)})" + SCHEDULE_UPSERT


def list_schedules(pools: int | None) -> str:
    """The schedules of these pools (None: of all), by pool and name."""
    where = "" if pools is None else f" WHERE pool IN ({marks(pools)})"
    return f"SELECT {SCHEDULE_COLUMNS} FROM schedules{where} ORDER BY pool, name"
