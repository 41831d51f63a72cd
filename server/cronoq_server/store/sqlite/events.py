"""The SQLite store's event log: recorded with each change, read, counted and purged."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence

from ..base import Changes, EventColumns, EventRow, State
from ..logic import event_row
from .core import SqliteCore
from .sql import COMMIT, QUERY_ONLY
from .sql.events import (
    BEGIN,
    COUNT_UNFINISHED,
    DELETE_EVENTS_THROUGH,
    LAST_EVENT,
    MARK_PURGED,
    PURGE_BOUND,
    PURGED_THROUGH,
    READ_EVENT_COLUMNS,
    READ_EVENTS,
    RECORD_EVENT,
    RECORD_EVENTS_OF_RANGE,
)


class Events(SqliteCore):
    # -- events ---------------------------------------------------------------
    #
    # Written in the op that changes the task, so committed with it. One transaction commits at
    # a time, so ids are in commit order: they are the event sequence (dense, since a rolled
    # back op rolls back its ids too). Nothing to number: sequence_events reads the last id.

    def _record_events(self, db: sqlite3.Connection, changes: Changes, prev: Sequence[int], now: int) -> None:
        """An event per change, with the task's pool, state, attempt and EVENT_TASK_COLUMNS as the
        op left them, and prev: the state each change left (0: a new task)."""
        rows = [(now, int(p), seq) for (seq, _), p in zip(changes, prev, strict=True)]
        # A run of consecutive tasks with the same prev (a batch's new tasks): one statement.
        start = 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and rows[end][2] == rows[end - 1][2] + 1 and rows[end][1] == rows[start][1]:
                end += 1
            if end - start > 1:
                db.execute(RECORD_EVENTS_OF_RANGE, (now, rows[start][1], rows[start][2], rows[end - 1][2]))
            else:
                db.execute(RECORD_EVENT, rows[start])
            start = end

    def _last_event(self, db: sqlite3.Connection) -> int:
        row = db.execute(LAST_EVENT).fetchone()
        return row[0] if row else 0

    async def sequence_events(self) -> int:
        return await self._run(self._last_event, self._conn)

    async def read_events(self, after: int, limit: int) -> list[EventRow]:
        rows = await self._run(lambda: self._conn.execute(READ_EVENTS, (after, limit)).fetchall())
        return [event_row(r) for r in rows]

    async def read_event_columns(self, after: int, limit: int) -> list[EventColumns]:
        rows = await self._run(lambda: self._conn.execute(READ_EVENT_COLUMNS, (after, limit)).fetchall())
        return [EventColumns(*zip(*rows, strict=True))] if rows else []

    async def count_unfinished(self) -> tuple[int, dict[tuple[str, State], int]]:
        """Read in one read transaction on a connection of its own (WAL: one snapshot, and the
        writes queued on the store's thread go on beside it)."""

        def count() -> tuple[int, dict[tuple[str, State], int]]:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=30)
            try:
                db.execute(QUERY_ONLY)
                db.execute(BEGIN)
                last = self._last_event(db)
                counts = {(p, State(s)): n for p, s, n in db.execute(COUNT_UNFINISHED)}
                db.execute(COMMIT)
                return last, counts
            finally:
                db.close()

        return await asyncio.get_running_loop().run_in_executor(None, count)

    async def event_bounds(self) -> tuple[int, int]:
        def bounds() -> tuple[int, int]:
            purged = self._conn.execute(PURGED_THROUGH).fetchone()[0]
            return purged, max(self._last_event(self._conn), purged)

        return await self._run(bounds)

    async def purge_events(self, before: int, limit: int) -> int:
        return await self._tx(self._purge_events, before, limit)

    def _purge_events(self, db: sqlite3.Connection, before: int, limit: int) -> int:
        # Only the oldest `limit` events are looked at: the scan never reaches into the window.
        bound = db.execute(PURGE_BOUND, (limit, before)).fetchone()[0]
        if bound is None:
            return 0
        deleted = db.execute(DELETE_EVENTS_THROUGH, (bound,)).rowcount
        db.execute(MARK_PURGED, (bound,))
        return deleted
