"""The PostgreSQL store's purges, workers, paused pools and schedules."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

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
from .sql.maintenance import (
    DELETE_SCHEDULE,
    DEREGISTER_WORKER,
    DUE_SCHEDULES,
    FIRE_SCHEDULE,
    GET_WORKER,
    LIST_SCHEDULES,
    LIST_WORKERS,
    NEXT_FIRE,
    PAUSED_POOLS,
    REAP_WORKERS,
    REGISTER_WORKER,
    RUNNING_BY_WORKER,
    SET_POOL_PAUSED,
    SKIP_FLUSH,
    purge_sql,
    put_schedule,
)
from .submit import Submit


class Maintenance(Submit):
    """Purges, workers, paused pools and schedules."""

    async def purge(self, now: int, limit: int) -> int:
        groups = retained(self.settings)
        sql = self._sql(purge_sql([states for _, states, _ in groups]))
        # A request's record is kept as long as the tasks it created can be.
        args: list[Any] = [limit, now - request_retention(self.settings)]
        for pool, _, keep in groups:
            args += [pool, now - keep]

        async def purge(conn: asyncpg.Connection) -> int:
            # Its commit need not wait for the WAL's flush (a purge lost in a crash is done again),
            # so the calls committing meanwhile do not wait for the purge's WAL either.
            await conn.execute(SKIP_FLUSH)
            return int(await conn.fetchval(sql, *args))

        return await self._tx(purge)

    async def register_worker(self, worker: WorkerRow) -> None:
        sql = self._sql(REGISTER_WORKER)
        args = (worker.id, worker.name, json.dumps(worker.pools), worker.concurrency, json.dumps(worker.labels))
        await self._tx(lambda c: c.execute(sql, *args, worker.registered_at, worker.last_seen_at, worker.principal))

    async def deregister_worker(self, worker_id: str) -> None:
        await self._tx(lambda c: c.execute(self._sql(DEREGISTER_WORKER), worker_id))

    async def get_worker(self, worker_id: str) -> WorkerRow | None:
        sql = self._sql(GET_WORKER)
        r = await self._read(lambda c: c.fetchrow(sql, worker_id))
        return _worker(r) if r else None

    async def list_workers(self) -> list[WorkerRow]:
        rows = await self._read(lambda c: c.fetch(self._sql(LIST_WORKERS)))
        return [_worker(r) for r in rows]

    async def running_by_worker(self) -> dict[str, int]:
        sql = self._sql(RUNNING_BY_WORKER)
        return {r[0]: r[1] for r in await self._read(lambda c: c.fetch(sql))}

    async def reap_workers(self, seen_before: int) -> list[str]:
        sql = self._sql(REAP_WORKERS)
        return [r[0] for r in await self._tx(lambda c: c.fetch(sql, seen_before))]

    async def set_pool_paused(self, pool: str, paused: bool, now: int, by: str) -> PoolPause:
        sql = self._sql(SET_POOL_PAUSED)
        values = pool_pause_values(pool, paused, now, by)
        return pool_pause(await self._tx(lambda c: c.fetchrow(sql, *values)))

    async def paused_pools(self) -> list[PoolPause]:
        sql = self._sql(PAUSED_POOLS)
        return [pool_pause(r) for r in await self._read(lambda c: c.fetch(sql))]

    async def put_schedule(self, schedule: ScheduleRow, now: int) -> ScheduleRow:
        values = schedule_values(schedule, now)
        sql = self._sql(put_schedule(len(values)))
        return schedule_row(await self._tx(lambda c: c.fetchrow(sql, *values)))

    async def delete_schedule(self, pool: str, name: str) -> bool:
        sql = self._sql(DELETE_SCHEDULE)
        status = await self._tx(lambda c: c.execute(sql, pool, name))
        return status != "DELETE 0"

    async def list_schedules(self, pools: list[str] | None) -> list[ScheduleRow]:
        sql = self._sql(LIST_SCHEDULES)
        return [schedule_row(r) for r in await self._read(lambda c: c.fetch(sql, pools))]

    async def due_schedules(self, now: int, limit: int) -> tuple[list[ScheduleRow], int | None]:
        due_sql = self._sql(DUE_SCHEDULES)
        next_sql = self._sql(NEXT_FIRE)

        async def due(conn: asyncpg.Connection) -> tuple[list[ScheduleRow], int | None]:
            rows = [schedule_row(r) for r in await conn.fetch(due_sql, now, limit)]
            return rows, await conn.fetchval(next_sql, now)

        return await self._read(due)

    async def fire_schedule(
        self, schedule: ScheduleRow, tasks: list[NewTask], last_fire_at: int, next_fire_at: int | None, now: int
    ) -> tuple[list[Submitted], Changes] | None:
        guard = self._sql(FIRE_SCHEDULE)

        async def fire(conn: asyncpg.Connection) -> tuple[list[Submitted], Changes] | None:
            args = (schedule.pool, schedule.name, schedule.next_fire_at, schedule.updated_at)
            if await conn.fetchval(guard, last_fire_at, next_fire_at, *args) is None:
                return None
            out: list[Submitted] = []
            changes: Changes = []
            for task in tasks:
                try:
                    subs, created = await self._submit(conn, [task], now, None, None)
                except ApiError as err:
                    if key_in_another_pool(err):  # raised before anything of this task is written
                        continue
                    raise
                out += subs
                changes += created
            return out, changes

        return await self._tx(fire)


def _worker(r: Any) -> WorkerRow:
    return WorkerRow(r[0], r[1], json.loads(r[2]), r[3], json.loads(r[4]), r[5], r[6], r[7])
