"""The SQLite store's reads of tasks: by seq, key or filter, their dependencies, attempts and counts."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from ..base import AttemptRow, DependencyRow, State, TaskFilter, TaskRow
from ..logic import attempt_row, list_filter, match_sql, scans_far, task_row
from .core import SqliteCore, _chunks
from .sql import BY_KEY, BY_SEQ, DIALECT
from .sql.reads import (
    ATTEMPTS,
    COUNT_BY_POOL_AND_STATE,
    DEPENDENTS,
    OLDEST_DUE,
    PENDING_BY_GROUP,
    dependency_rows,
    select_tasks,
    seq_in,
)


class Reads(SqliteCore):
    # -- reads ----------------------------------------------------------------

    def _select(self, db: sqlite3.Connection, where: str, params: Iterable[Any] = ()) -> list[TaskRow]:
        return [task_row(r) for r in db.execute(select_tasks(where), tuple(params))]

    def _select_seqs(self, db: sqlite3.Connection, seqs: list[int]) -> list[TaskRow]:
        rows: list[TaskRow] = []
        for chunk in _chunks(seqs):
            rows.extend(self._select(db, seq_in(len(chunk)), chunk))
        return rows

    async def get(self, seq: int) -> TaskRow | None:
        rows = await self._run(lambda: self._select(self._conn, BY_SEQ, (seq,)))
        return rows[0] if rows else None

    async def get_by_key(self, key: str) -> TaskRow | None:
        rows = await self._run(lambda: self._select(self._conn, BY_KEY, (key,)))
        return rows[0] if rows else None

    async def get_many(self, seqs: list[int]) -> list[TaskRow]:
        return await self._run(self._select_seqs, self._conn, seqs)

    async def dependents(self, seq: int, limit: int) -> list[tuple[int, str]]:
        rows = await self._run(lambda: self._conn.execute(DEPENDENTS, (seq, limit)).fetchall())
        return [(s, p) for s, p in rows]

    async def dependency_rows(self, seqs: list[int]) -> dict[int, DependencyRow]:
        def read() -> dict[int, DependencyRow]:
            found: dict[int, DependencyRow] = {}
            for chunk in _chunks(seqs):
                for r in self._conn.execute(dependency_rows(len(chunk)), chunk):
                    found[r[0]] = DependencyRow(r[0], r[1], State(r[2]), r[3], r[4], r[5])
            return found

        return await self._run(read)

    async def list_tasks(
        self, pools: list[str] | None, state: State | None, after_seq: int, limit: int, newest_first: bool = False
    ) -> list[TaskRow]:
        return await self.list_matching(list_filter(pools, state), after_seq, limit, newest_first)

    async def list_matching(
        self, match: TaskFilter, after_seq: int, limit: int, newest_first: bool = False
    ) -> list[TaskRow]:
        where, params = match_sql(match, after_seq, limit, DIALECT, newest_first)
        if scans_far(match):  # as match_tasks: a filter few tasks match scans far
            return await self._scan(lambda db: self._select(db, where, params))
        if match == list_filter(match.pools, None):  # pools alone: an index walk, on the store's thread
            return await self._run(lambda: self._select(self._conn, where, params))
        return await self._read_aside(lambda db: self._select(db, where, params))

    async def oldest_due_pending(self, pools: list[str], now: int) -> dict[str, int]:
        def oldest() -> dict[str, int]:
            found = {p: self._conn.execute(OLDEST_DUE, (p, now)).fetchone() for p in pools}
            return {p: r[0] for p, r in found.items() if r is not None}

        return await self._run(oldest)

    async def count_by_pool_and_state(self) -> dict[tuple[str, State], int]:
        return await self._read_aside(lambda db: {(p, State(s)): n for p, s, n in db.execute(COUNT_BY_POOL_AND_STATE)})

    async def pending_by_group(self, pool: str, most: int, also: list[str]) -> dict[str, int]:
        params = (pool, most, pool, json.dumps(also))
        return await self._read_aside(lambda db: dict(db.execute(PENDING_BY_GROUP, params).fetchall()))

    async def attempts(self, seq: int) -> list[AttemptRow]:
        rows = await self._run(lambda: self._conn.execute(ATTEMPTS, (seq,)).fetchall())
        return [attempt_row(r) for r in rows]
