"""The SQLite store's upkeep: purges, workers, paused pools and schedules."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ...errors import ApiError
from ..base import Changes, NewTask, PoolPause, ScheduleRow, Submitted, WorkerRow
from ..logic import (
    POOL_PAUSE_COLUMNS,
    POOL_PAUSE_UPSERT,
    SCHEDULE_COLUMNS,
    SCHEDULE_UPSERT,
    key_in_another_pool,
    pool_pause,
    pool_pause_values,
    request_retention,
    retained,
    schedule_row,
    schedule_values,
)
from .core import _chunks
from .sql import WORKER_COLUMNS, _marks
from .submit import Submit

# The oldest ended tasks of a pool in some states (pool, finished before, how many): the partial
# index of ended tasks, in finished_at order (its own condition first, so the planner takes it).
_PAST_RETENTION = (
    "SELECT finished_at, seq FROM tasks INDEXED BY tasks_finished WHERE state IN (4, 5, 6, 7) AND state IN ({states})"
    " AND pool = ? AND finished_at < ? ORDER BY finished_at LIMIT ?"
)


def _worker(r: tuple[Any, ...]) -> WorkerRow:
    return WorkerRow(r[0], r[1], json.loads(r[2]), r[3], json.loads(r[4]), r[5], r[6], r[7])


class Maintenance(Submit):
    async def purge(self, now: int, limit: int) -> int:
        return await self._tx(self._purge, now, limit)

    def _purge(self, db: sqlite3.Connection, now: int, limit: int) -> int:
        found: list[tuple[int, int]] = []  # (finished_at, seq)
        for pool, states, keep in retained(self.settings):
            found += db.execute(_PAST_RETENTION.format(states=states), (pool, now - keep, limit)).fetchall()
        victims = [seq for _, seq in sorted(found)[:limit]]
        for chunk in _chunks(victims):
            for table in ("deps", "attempts"):
                db.execute(f"DELETE FROM {table} WHERE task_seq IN ({_marks(len(chunk))})", chunk)
            db.execute(f"DELETE FROM tasks WHERE seq IN ({_marks(len(chunk))})", chunk)
        # A request's record is kept as long as the tasks it created can be.
        db.execute("DELETE FROM requests WHERE created_at < ?", (now - request_retention(self.settings),))
        return len(victims)

    # -- workers --------------------------------------------------------------

    async def register_worker(self, worker: WorkerRow) -> None:
        def insert(db: sqlite3.Connection) -> None:
            db.execute(
                f"INSERT OR REPLACE INTO workers ({WORKER_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
                (
                    worker.id,
                    worker.name,
                    json.dumps(worker.pools),
                    worker.concurrency,
                    json.dumps(worker.labels),
                    worker.registered_at,
                    worker.last_seen_at,
                    worker.principal,
                ),
            )

        await self._tx(insert)

    async def deregister_worker(self, worker_id: str) -> None:
        await self._tx(lambda db: db.execute("DELETE FROM workers WHERE id = ?", (worker_id,)))

    async def get_worker(self, worker_id: str) -> WorkerRow | None:
        def get(db: sqlite3.Connection) -> WorkerRow | None:
            r = db.execute(f"SELECT {WORKER_COLUMNS} FROM workers WHERE id = ?", (worker_id,)).fetchone()
            return _worker(r) if r else None

        return await self._run(get, self._conn)

    async def list_workers(self) -> list[WorkerRow]:
        sql = f"SELECT {WORKER_COLUMNS} FROM workers ORDER BY id"
        return await self._run(lambda: [_worker(r) for r in self._conn.execute(sql)])

    async def running_by_worker(self) -> dict[str, int]:
        sql = "SELECT worker_id, COUNT(*) FROM tasks WHERE state = 3 GROUP BY worker_id"
        return await self._run(lambda: {r[0]: r[1] for r in self._conn.execute(sql)})

    async def reap_workers(self, seen_before: int) -> list[str]:
        sql = "DELETE FROM workers WHERE last_seen_at < ? RETURNING id"
        return await self._tx(lambda db: [r[0] for r in db.execute(sql, (seen_before,))])

    # -- paused pools ---------------------------------------------------------

    async def set_pool_paused(self, pool: str, paused: bool, now: int, by: str) -> PoolPause:
        sql = POOL_PAUSE_UPSERT.format(s="", p1="?", p2="?", p3="?", p4="?")
        values = pool_pause_values(pool, paused, now, by)
        return await self._tx(lambda db: pool_pause(db.execute(sql, values).fetchone()))

    async def paused_pools(self) -> list[PoolPause]:
        sql = f"SELECT {POOL_PAUSE_COLUMNS} FROM pools WHERE paused ORDER BY name"
        return await self._run(lambda: [pool_pause(r) for r in self._conn.execute(sql)])

    # -- schedules ------------------------------------------------------------

    async def put_schedule(self, schedule: ScheduleRow, now: int) -> ScheduleRow:
        values = schedule_values(schedule, now)
        sql = f"INSERT INTO schedules ({SCHEDULE_COLUMNS}) VALUES ({_marks(len(values))})" + SCHEDULE_UPSERT
        return await self._tx(lambda db: schedule_row(db.execute(sql, values).fetchone()))

    async def delete_schedule(self, pool: str, name: str) -> bool:
        sql = "DELETE FROM schedules WHERE pool = ? AND name = ?"
        return bool(await self._tx(lambda db: db.execute(sql, (pool, name)).rowcount))

    async def list_schedules(self, pools: list[str] | None) -> list[ScheduleRow]:
        where, params = "", list[Any]()
        if pools is not None:
            where, params = f" WHERE pool IN ({_marks(len(pools))})", list(pools)
        sql = f"SELECT {SCHEDULE_COLUMNS} FROM schedules{where} ORDER BY pool, name"
        return await self._run(lambda: [schedule_row(r) for r in self._conn.execute(sql, params)])

    async def due_schedules(self, now: int, limit: int) -> tuple[list[ScheduleRow], int | None]:
        def due() -> tuple[list[ScheduleRow], int | None]:
            db = self._conn
            sql = (
                f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE paused = 0 AND next_fire_at <= ?"
                " ORDER BY next_fire_at LIMIT ?"
            )
            rows = [schedule_row(r) for r in db.execute(sql, (now, limit))]
            sql = "SELECT MIN(next_fire_at) FROM schedules WHERE paused = 0 AND next_fire_at > ?"
            return rows, db.execute(sql, (now,)).fetchone()[0]

        return await self._run(due)

    async def fire_schedule(
        self, schedule: ScheduleRow, tasks: list[NewTask], last_fire_at: int, next_fire_at: int | None, now: int
    ) -> tuple[list[Submitted], Changes] | None:
        return await self._tx(self._fire_schedule, schedule, tasks, last_fire_at, next_fire_at, now)

    def _fire_schedule(
        self,
        db: sqlite3.Connection,
        schedule: ScheduleRow,
        tasks: list[NewTask],
        last_fire_at: int,
        next_fire_at: int | None,
        now: int,
    ) -> tuple[list[Submitted], Changes] | None:
        # The guard: a duplicate or stale fire, or a Put since the read, moves nothing.
        moved = db.execute(
            "UPDATE schedules SET last_fire_at = ?, next_fire_at = ? WHERE pool = ? AND name = ? AND paused = 0"
            " AND next_fire_at = ? AND updated_at = ?",
            (last_fire_at, next_fire_at, schedule.pool, schedule.name, schedule.next_fire_at, schedule.updated_at),
        ).rowcount
        if not moved:
            return None
        out: list[Submitted] = []
        changes: Changes = []
        for task in tasks:
            try:
                subs, created = self._submit(db, [task], now, None, None)
            except ApiError as err:
                if key_in_another_pool(err):
                    continue
                raise
            out += subs
            changes += created
        return out, changes
