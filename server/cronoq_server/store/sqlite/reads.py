"""The SQLite store's reads of tasks: by seq, key or filter, their dependencies, attempts and counts."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from ..base import ATTEMPT_COLUMNS, TASK_COLUMNS, AttemptRow, DependencyRow, State, TaskFilter, TaskRow
from ..logic import attempt_row, list_filter, match_sql, scans_far, task_row
from .core import SqliteCore, _chunks
from .sql import _DIALECT, _marks


class Reads(SqliteCore):
    # -- reads ----------------------------------------------------------------

    def _select(self, db: sqlite3.Connection, where: str, params: Iterable[Any] = ()) -> list[TaskRow]:
        return [task_row(r) for r in db.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE {where}", tuple(params))]

    def _select_seqs(self, db: sqlite3.Connection, seqs: list[int]) -> list[TaskRow]:
        rows: list[TaskRow] = []
        for chunk in _chunks(seqs):
            rows.extend(self._select(db, f"seq IN ({_marks(len(chunk))})", chunk))
        return rows

    async def get(self, seq: int) -> TaskRow | None:
        rows = await self._run(lambda: self._select(self._conn, "seq = ?", (seq,)))
        return rows[0] if rows else None

    async def get_by_key(self, key: str) -> TaskRow | None:
        rows = await self._run(lambda: self._select(self._conn, "key = ?", (key,)))
        return rows[0] if rows else None

    async def get_many(self, seqs: list[int]) -> list[TaskRow]:
        return await self._run(self._select_seqs, self._conn, seqs)

    async def dependents(self, seq: int, limit: int) -> list[tuple[int, str]]:
        sql = "SELECT d.task_seq, t.pool FROM deps d JOIN tasks t ON t.seq = d.task_seq WHERE d.dep_seq = ?"
        sql += " ORDER BY d.task_seq LIMIT ?"
        rows = await self._run(lambda: self._conn.execute(sql, (seq, limit)).fetchall())
        return [(s, p) for s, p in rows]

    async def dependency_rows(self, seqs: list[int]) -> dict[int, DependencyRow]:
        def read() -> dict[int, DependencyRow]:
            found: dict[int, DependencyRow] = {}
            for chunk in _chunks(seqs):
                sql = (
                    "SELECT seq, key, state, result, result_content_type, error FROM tasks"
                    f" WHERE seq IN ({_marks(len(chunk))})"
                )
                for r in self._conn.execute(sql, chunk):
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
        where, params = match_sql(match, after_seq, limit, _DIALECT, newest_first)
        if scans_far(match):  # as match_tasks: a filter few tasks match scans far
            return await self._scan(lambda db: self._select(db, where, params))
        if match == list_filter(match.pools, None):  # pools alone: an index walk, on the store's thread
            return await self._run(lambda: self._select(self._conn, where, params))
        return await self._read_aside(lambda db: self._select(db, where, params))

    async def oldest_due_pending(self, pools: list[str], now: int) -> dict[str, int]:
        sql = (
            "SELECT max(run_at, created_at) FROM tasks WHERE state = 1 AND pool = ? AND run_at <= ?"
            " ORDER BY run_at LIMIT 1"
        )

        def oldest() -> dict[str, int]:
            found = {p: self._conn.execute(sql, (p, now)).fetchone() for p in pools}
            return {p: r[0] for p, r in found.items() if r is not None}

        return await self._run(oldest)

    async def count_by_pool_and_state(self) -> dict[tuple[str, State], int]:
        sql = "SELECT pool, state, COUNT(*) FROM tasks GROUP BY pool, state"
        return await self._read_aside(lambda db: {(p, State(s)): n for p, s, n in db.execute(sql)})

    async def pending_by_group(self, pool: str, most: int, also: list[str]) -> dict[str, int]:
        pending = "SELECT group_key, count(*) AS n FROM tasks WHERE state = 1 AND pool = ?"
        sql = (
            f"SELECT * FROM ({pending} GROUP BY group_key ORDER BY n DESC, group_key LIMIT ?)"
            f" UNION SELECT * FROM ({pending} AND group_key IN (SELECT value FROM json_each(?)) GROUP BY group_key)"
        )
        params = (pool, most, pool, json.dumps(also))
        return await self._read_aside(lambda db: dict(db.execute(sql, params).fetchall()))

    async def attempts(self, seq: int) -> list[AttemptRow]:
        sql = f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE task_seq = ? ORDER BY attempt, ended_at"
        rows = await self._run(lambda: self._conn.execute(sql, (seq,)).fetchall())
        return [attempt_row(r) for r in rows]
