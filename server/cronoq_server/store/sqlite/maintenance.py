"""The SQLite store's upkeep: purges, workers, paused pools and schedules."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ...errors import ApiError
from ..base import Changes, NewTask, PoolPause, ScheduleRow, Submitted, WorkerRow
from ..logic import (
    key_in_another_pool,
    pool_pause,
    pool_pause_values,
    request_retention,
    retained,
    schedule_row,
    schedule_values,
)
from .core import _chunks
from .sql import delete_attempts, delete_deps
from .sql.maintenance import (
    DELETE_OLD_REQUESTS,
    DELETE_SCHEDULE,
    DEREGISTER_WORKER,
    DUE_SCHEDULES,
    FIRE_SCHEDULE,
    GET_WORKER,
    LIST_WORKERS,
    NEXT_FIRE,
    PAUSED_POOLS,
    REAP_WORKERS,
    REGISTER_WORKER,
    RUNNING_BY_WORKER,
    SET_POOL_PAUSED,
    delete_tasks,
    list_schedules,
    past_retention,
    put_schedule,
)
from .submit import Submit


def _worker(r: tuple[Any, ...]) -> WorkerRow:
    return WorkerRow(r[0], r[1], json.loads(r[2]), r[3], json.loads(r[4]), r[5], r[6], r[7])


class Maintenance(Submit):
    async def purge(self, now: int, limit: int) -> int:
        return await self._tx(self._purge, now, limit)

    def _purge(self, db: sqlite3.Connection, now: int, limit: int) -> int:
        found: list[tuple[int, int]] = []  # (finished_at, seq)
        for pool, states, keep in retained(self.settings):
            for state in states.split(", "):
                found += db.execute(past_retention(state), (pool, now - keep, limit)).fetchall()
        victims = [seq for _, seq in sorted(found)[:limit]]
        for chunk in _chunks(victims):
            for delete in (delete_deps, delete_attempts):
                db.execute(delete(len(chunk)), chunk)
            db.execute(delete_tasks(len(chunk)), chunk)
        # A request's record is kept as long as the tasks it created can be.
        db.execute(DELETE_OLD_REQUESTS, (now - request_retention(self.settings),))
        return len(victims)

    # -- workers --------------------------------------------------------------

    async def register_worker(self, worker: WorkerRow) -> None:
        def insert(db: sqlite3.Connection) -> None:
            db.execute(
                REGISTER_WORKER,
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
        await self._tx(lambda db: db.execute(DEREGISTER_WORKER, (worker_id,)))

    async def get_worker(self, worker_id: str) -> WorkerRow | None:
        def get(db: sqlite3.Connection) -> WorkerRow | None:
            r = db.execute(GET_WORKER, (worker_id,)).fetchone()
            return _worker(r) if r else None

        return await self._run(get, self._conn)

    async def list_workers(self) -> list[WorkerRow]:
        return await self._run(lambda: [_worker(r) for r in self._conn.execute(LIST_WORKERS)])

    async def running_by_worker(self) -> dict[str, int]:
        return await self._run(lambda: {r[0]: r[1] for r in self._conn.execute(RUNNING_BY_WORKER)})

    async def reap_workers(self, seen_before: int) -> list[str]:
        return await self._tx(lambda db: [r[0] for r in db.execute(REAP_WORKERS, (seen_before,))])

    # -- paused pools ---------------------------------------------------------

    async def set_pool_paused(self, pool: str, paused: bool, now: int, by: str) -> PoolPause:
        values = pool_pause_values(pool, paused, now, by)
        return await self._tx(lambda db: pool_pause(db.execute(SET_POOL_PAUSED, values).fetchone()))

    async def paused_pools(self) -> list[PoolPause]:
        return await self._run(lambda: [pool_pause(r) for r in self._conn.execute(PAUSED_POOLS)])

    # -- schedules ------------------------------------------------------------

    async def put_schedule(self, schedule: ScheduleRow, now: int) -> ScheduleRow:
        values = schedule_values(schedule, now)
        sql = put_schedule(len(values))
        return await self._tx(lambda db: schedule_row(db.execute(sql, values).fetchone()))

    async def delete_schedule(self, pool: str, name: str) -> bool:
        return bool(await self._tx(lambda db: db.execute(DELETE_SCHEDULE, (pool, name)).rowcount))

    async def list_schedules(self, pools: list[str] | None) -> list[ScheduleRow]:
        params: list[Any] = [] if pools is None else list(pools)
        sql = list_schedules(None if pools is None else len(pools))
        return await self._run(lambda: [schedule_row(r) for r in self._conn.execute(sql, params)])

    async def due_schedules(self, now: int, limit: int) -> tuple[list[ScheduleRow], int | None]:
        def due() -> tuple[list[ScheduleRow], int | None]:
            db = self._conn
            rows = [schedule_row(r) for r in db.execute(DUE_SCHEDULES, (now, limit))]
            return rows, db.execute(NEXT_FIRE, (now,)).fetchone()[0]

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
            FIRE_SCHEDULE,
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
