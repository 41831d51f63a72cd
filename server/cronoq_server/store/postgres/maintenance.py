"""The PostgreSQL store's purges, workers, paused pools and schedules."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

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
from .sql import WORKER_COLUMNS, purge_sql
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
        return await self._tx(lambda c: c.fetchval(sql, *args))

    async def register_worker(self, worker: WorkerRow) -> None:
        sql = self._sql(
            f"INSERT INTO {{s}}.workers ({WORKER_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
            " ON CONFLICT (id) DO UPDATE SET"
            " name = excluded.name, pools = excluded.pools, concurrency = excluded.concurrency,"
            " labels = excluded.labels, last_seen_at = excluded.last_seen_at"
        )
        args = (worker.id, worker.name, json.dumps(worker.pools), worker.concurrency, json.dumps(worker.labels))
        await self._tx(lambda c: c.execute(sql, *args, worker.registered_at, worker.last_seen_at, worker.principal))

    async def deregister_worker(self, worker_id: str) -> None:
        await self._tx(lambda c: c.execute(self._sql("DELETE FROM {s}.workers WHERE id = $1"), worker_id))

    async def get_worker(self, worker_id: str) -> WorkerRow | None:
        sql = self._sql(f"SELECT {WORKER_COLUMNS} FROM {{s}}.workers WHERE id = $1")
        r = await self._read(lambda c: c.fetchrow(sql, worker_id))
        return _worker(r) if r else None

    async def list_workers(self) -> list[WorkerRow]:
        rows = await self._read(lambda c: c.fetch(self._sql(f"SELECT {WORKER_COLUMNS} FROM {{s}}.workers ORDER BY id")))
        return [_worker(r) for r in rows]

    async def running_by_worker(self) -> dict[str, int]:
        sql = self._sql("SELECT worker_id, count(*) FROM {s}.tasks WHERE state = 3 GROUP BY worker_id")
        return {r[0]: r[1] for r in await self._read(lambda c: c.fetch(sql))}

    async def reap_workers(self, seen_before: int) -> list[str]:
        sql = self._sql("DELETE FROM {s}.workers WHERE last_seen_at < $1 RETURNING id")
        return [r[0] for r in await self._tx(lambda c: c.fetch(sql, seen_before))]

    async def set_pool_paused(self, pool: str, paused: bool, now: int, by: str) -> PoolPause:
        sql = self._sql(POOL_PAUSE_UPSERT.format(s="{s}.", p1="$1", p2="$2", p3="$3", p4="$4"))
        values = pool_pause_values(pool, paused, now, by)
        return pool_pause(await self._tx(lambda c: c.fetchrow(sql, *values)))

    async def paused_pools(self) -> list[PoolPause]:
        sql = self._sql(f"SELECT {POOL_PAUSE_COLUMNS} FROM {{s}}.pools WHERE paused ORDER BY name")
        return [pool_pause(r) for r in await self._read(lambda c: c.fetch(sql))]

    async def put_schedule(self, schedule: ScheduleRow, now: int) -> ScheduleRow:
        values = schedule_values(schedule, now)
        marks = ", ".join(f"${n}" for n in range(1, len(values) + 1))
        sql = self._sql(f"INSERT INTO {{s}}.schedules ({SCHEDULE_COLUMNS}) VALUES ({marks})" + SCHEDULE_UPSERT)
        return schedule_row(await self._tx(lambda c: c.fetchrow(sql, *values)))

    async def delete_schedule(self, pool: str, name: str) -> bool:
        sql = self._sql("DELETE FROM {s}.schedules WHERE pool = $1 AND name = $2")
        status = await self._tx(lambda c: c.execute(sql, pool, name))
        return status != "DELETE 0"

    async def list_schedules(self, pools: list[str] | None) -> list[ScheduleRow]:
        sql = self._sql(
            f"SELECT {SCHEDULE_COLUMNS} FROM {{s}}.schedules WHERE $1::text[] IS NULL OR pool = ANY($1)"
            " ORDER BY pool, name"
        )
        return [schedule_row(r) for r in await self._read(lambda c: c.fetch(sql, pools))]

    async def due_schedules(self, now: int, limit: int) -> tuple[list[ScheduleRow], int | None]:
        due_sql = self._sql(
            f"SELECT {SCHEDULE_COLUMNS} FROM {{s}}.schedules WHERE NOT paused AND next_fire_at <= $1"
            " ORDER BY next_fire_at LIMIT $2"
        )
        next_sql = self._sql("SELECT min(next_fire_at) FROM {s}.schedules WHERE NOT paused AND next_fire_at > $1")

        async def due(conn: asyncpg.Connection) -> tuple[list[ScheduleRow], int | None]:
            rows = [schedule_row(r) for r in await conn.fetch(due_sql, now, limit)]
            return rows, await conn.fetchval(next_sql, now)

        return await self._read(due)

    async def fire_schedule(
        self, schedule: ScheduleRow, tasks: list[NewTask], last_fire_at: int, next_fire_at: int | None, now: int
    ) -> tuple[list[Submitted], Changes] | None:
        # The guard: a duplicate or stale fire, or a Put since the read, moves nothing (a
        # concurrent one waits on the row lock, then finds next_fire_at moved).
        guard = self._sql(
            "UPDATE {s}.schedules SET last_fire_at = $1, next_fire_at = $2 WHERE pool = $3 AND name = $4"
            " AND NOT paused AND next_fire_at = $5 AND updated_at = $6 RETURNING 1"
        )

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
