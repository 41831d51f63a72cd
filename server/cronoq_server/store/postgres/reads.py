"""The PostgreSQL store's reads of tasks."""

from __future__ import annotations

import asyncpg

from ..base import AttemptRow, DependencyRow, State, TaskFilter, TaskRow
from ..logic import attempt_row, list_filter, match_sql, scans_far
from .core import _Core
from .sql import _DIALECT
from .sql.core import BY_KEY, BY_SEQ, BY_SEQS
from .sql.reads import (
    ATTEMPTS,
    COUNT_BY_POOL_AND_STATE,
    DEPENDENCY_ROWS,
    DEPENDENTS,
    OLDEST_DUE_PENDING,
    PENDING_BY_GROUP,
)


class Reads(_Core):
    """Tasks, their dependencies and attempts, and counts, as read."""

    async def get(self, seq: int) -> TaskRow | None:
        rows = await self._read(lambda c: self._select(c, BY_SEQ, seq))
        return rows[0] if rows else None

    async def get_by_key(self, key: str) -> TaskRow | None:
        rows = await self._read(lambda c: self._select(c, BY_KEY, key))
        return rows[0] if rows else None

    async def get_many(self, seqs: list[int]) -> list[TaskRow]:
        return await self._read(lambda c: self._select(c, BY_SEQS, seqs))

    async def dependents(self, seq: int, limit: int) -> list[tuple[int, str]]:
        sql = self._sql(DEPENDENTS)
        rows = await self._read(lambda c: c.fetch(sql, seq, limit))
        return [(r[0], r[1]) for r in rows]

    async def dependency_rows(self, seqs: list[int]) -> dict[int, DependencyRow]:
        sql = self._sql(DEPENDENCY_ROWS)
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
        sql = self._sql(OLDEST_DUE_PENDING)

        async def oldest(conn: asyncpg.Connection) -> dict[str, int]:
            found = {p: await conn.fetchval(sql, p, now) for p in pools}
            return {p: at for p, at in found.items() if at is not None}

        return await self._read(oldest)

    async def count_by_pool_and_state(self) -> dict[tuple[str, State], int]:
        sql = self._sql(COUNT_BY_POOL_AND_STATE)
        rows = await self._read(lambda c: c.fetch(sql))
        return {(r[0], State(r[1])): r[2] for r in rows}

    async def pending_by_group(self, pool: str, most: int, also: list[str]) -> dict[str, int]:
        sql = self._sql(PENDING_BY_GROUP)
        rows = await self._read(lambda c: c.fetch(sql, pool, most, also))
        return {r[0]: r[1] for r in rows}

    async def attempts(self, seq: int) -> list[AttemptRow]:
        sql = self._sql(ATTEMPTS)
        return [attempt_row(r) for r in await self._read(lambda c: c.fetch(sql, seq))]
