"""The PostgreSQL store's reads of tasks."""

from __future__ import annotations

import asyncpg

from ..base import ATTEMPT_COLUMNS, AttemptRow, DependencyRow, State, TaskFilter, TaskRow
from ..logic import attempt_row, list_filter, match_sql, scans_far
from .core import _Core
from .sql import _DIALECT


class Reads(_Core):
    """Tasks, their dependencies and attempts, and counts, as read."""

    async def get(self, seq: int) -> TaskRow | None:
        rows = await self._read(lambda c: self._select(c, "seq = $1", seq))
        return rows[0] if rows else None

    async def get_by_key(self, key: str) -> TaskRow | None:
        rows = await self._read(lambda c: self._select(c, "key = $1 AND key IS NOT NULL", key))
        return rows[0] if rows else None

    async def get_many(self, seqs: list[int]) -> list[TaskRow]:
        return await self._read(lambda c: self._select(c, "seq = ANY($1::bigint[])", seqs))

    async def dependents(self, seq: int, limit: int) -> list[tuple[int, str]]:
        sql = self._sql(
            "SELECT d.task_seq, t.pool FROM {s}.deps d JOIN {s}.tasks t ON t.seq = d.task_seq"
            " WHERE d.dep_seq = $1 ORDER BY d.task_seq LIMIT $2"
        )
        rows = await self._read(lambda c: c.fetch(sql, seq, limit))
        return [(r[0], r[1]) for r in rows]

    async def dependency_rows(self, seqs: list[int]) -> dict[int, DependencyRow]:
        sql = self._sql(
            "SELECT seq, key, state, result, result_content_type, error FROM {s}.tasks WHERE seq = ANY($1::bigint[])"
        )
        rows = await self._read(lambda c: c.fetch(sql, seqs))
        return {r[0]: DependencyRow(r[0], r[1], State(r[2]), r[3], r[4], r[5]) for r in rows}

    async def list_tasks(
        self, pools: list[str] | None, state: State | None, after_seq: int, limit: int, newest_first: bool = False
    ) -> list[TaskRow]:
        return await self.list_matching(list_filter(pools, state), after_seq, limit, newest_first)

    async def list_matching(
        self, match: TaskFilter, after_seq: int, limit: int, newest_first: bool = False
    ) -> list[TaskRow]:
        where, params = match_sql(match, after_seq, limit, _DIALECT, newest_first)
        if scans_far(match):  # as match_tasks: a filter few tasks match scans far
            return await self._scan(lambda c: self._select(c, where, *params))
        return await self._read(lambda c: self._select(c, where, *params))

    async def oldest_due_pending(self, pools: list[str], now: int) -> dict[str, int]:
        sql = self._sql(
            "SELECT greatest(run_at, created_at) FROM {s}.tasks WHERE state = 1 AND pool = $1 AND run_at <= $2"
            " ORDER BY run_at LIMIT 1"
        )

        async def oldest(conn: asyncpg.Connection) -> dict[str, int]:
            found = {p: await conn.fetchval(sql, p, now) for p in pools}
            return {p: at for p, at in found.items() if at is not None}

        return await self._read(oldest)

    async def count_by_pool_and_state(self) -> dict[tuple[str, State], int]:
        sql = self._sql("SELECT pool, state, count(*) FROM {s}.tasks GROUP BY pool, state")
        rows = await self._read(lambda c: c.fetch(sql))
        return {(r[0], State(r[1])): r[2] for r in rows}

    async def pending_by_group(self, pool: str, most: int, also: list[str]) -> dict[str, int]:
        pending = "SELECT group_key, count(*) AS n FROM {s}.tasks WHERE state = 1 AND pool = $1"
        sql = self._sql(
            f"(SELECT * FROM ({pending} GROUP BY group_key ORDER BY n DESC, group_key LIMIT $2) AS top)"
            f" UNION (SELECT * FROM ({pending} AND group_key = ANY($3::text[]) GROUP BY group_key) AS named)"
        )
        rows = await self._read(lambda c: c.fetch(sql, pool, most, also))
        return {r[0]: r[1] for r in rows}

    async def attempts(self, seq: int) -> list[AttemptRow]:
        sql = self._sql(f"SELECT {ATTEMPT_COLUMNS} FROM {{s}}.attempts WHERE task_seq = $1 ORDER BY attempt, ended_at")
        return [attempt_row(r) for r in await self._read(lambda c: c.fetch(sql, seq))]
