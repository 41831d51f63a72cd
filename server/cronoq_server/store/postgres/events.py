"""The PostgreSQL store's event log."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any

import asyncpg

from ..base import COUNTED_COLUMNS, EVENT_COLUMNS, Changes, EventColumns, EventRow, State
from ..logic import event_row
from .core import _Core
from .sql.events import (
    EVENT_BOUNDS,
    LAST_POS_FOR_UPDATE,
    NUMBER_BATCH,
    PURGE_EVENTS,
    RECORD_EVENTS,
    UNFINISHED_BY_POOL_AND_STATE,
    events_after,
)

# How many rows of events or event_batches read_events reads at a time.
READ_ROWS = 64


def _row_columns(r: asyncpg.Record) -> tuple[range, list[Sequence[Any]]]:
    """The positions of a row of events_sql.events_after's (last pos, n, columns as arrays), and its columns
    (one that is NULL: a None an event)."""
    n = r[1]
    return range(r[0] - n + 1, r[0] + 1), [c if c is not None else (None,) * n for c in r[2:]]


def unbatched(r: asyncpg.Record, after: int, limit: int) -> list[EventRow]:
    """The events after pos `after` of a row of read_events' (EVENT_COLUMNS), but those of
    deleted tasks (task_seq 0); the first `limit` of them."""
    pos, columns = _row_columns(r)
    rows = zip(pos, *columns, strict=True)  # (pos, EVENT_COLUMNS) of each
    events = islice((e for e in islice(rows, max(0, after + 1 - pos.start), None) if e[1]), limit)
    return [event_row(e) for e in events]


class Events(_Core):
    """The event log: recorded by each change, numbered by the leader, read by position."""

    # Each change inserts its event in its own transaction, after locking the task's row: so a
    # task's later change draws a higher id than its earlier ones (the earlier committed before
    # the later could lock the row). Identity values are not in commit order across tasks, so
    # readers never see ids: the leader's sequence_events gives committed events their pos,
    # after the last given, in id order, one batch at a time under the event_log row lock.
    # Every committed event of a task is visible once a later one is, so each batch holds a
    # task's events in order and a later batch never holds an earlier change of a task.
    #
    # A statement records its events as one row of event_batches (insert_events), whose pos are
    # a range; rows of `events` (an event a row: recorded before migration 12, or by an older
    # leader, which ran before this one) are numbered before any row of event_batches.

    async def _record_events(self, conn: asyncpg.Connection, changes: Changes, prev: Sequence[int], now: int) -> None:
        """An event per change, with the task's pool, state, attempt and EVENT_TASK_COLUMNS as this
        transaction left them, and prev: the state each change left (0: a new task)."""
        if not changes:
            return
        await conn.execute(
            self._sql(RECORD_EVENTS),
            [seq for seq, _ in changes],
            now,
            [int(p) for p in prev],
        )

    async def sequence_events(self, limit: int = 10_000) -> int:
        """Gives committed events their pos, up to limit at a time, until none is left."""

        while True:
            last, numbered = await self._tx(lambda c: self._number_batch(c, limit))
            if numbered < limit:
                return last

    async def _number_batch(self, conn: asyncpg.Connection, limit: int) -> tuple[int, int]:
        """Numbers up to limit committed rows of events, then of event_batches while fewer were
        left; (last pos, how many rows were numbered)."""
        # The lock first, then a new statement: its snapshot sees what earlier batches numbered.
        last = await conn.fetchval(self._sql(LAST_POS_FOR_UPDATE))
        row = await conn.fetchrow(
            self._sql(NUMBER_BATCH),
            last,
            limit,
        )
        return row[0], row[1]

    async def _number_events(self, conn: asyncpg.Connection, batch: int = 10_000) -> int:
        """Numbers every committed event this transaction sees, in batches; the last pos."""
        while True:
            last, numbered = await self._number_batch(conn, batch)
            if numbered < batch:
                return last

    async def _read_event_rows(self, columns: str, after: int, take: Callable[[asyncpg.Record], bool]) -> None:
        """Hands take each row of both tables after pos `after` (events_sql.events_after's, of these
        columns), in pos order, READ_ROWS at a time (each read one statement: one snapshot),
        until take says it has enough or none is left."""
        sql = self._sql(events_after(columns))

        async def read(conn: asyncpg.Connection) -> None:
            pos = after
            while True:
                rows = await conn.fetch(sql, pos, READ_ROWS)
                for r in rows:
                    if take(r):
                        return
                    pos = r[0]
                if len(rows) < READ_ROWS:
                    return

        await self._read(read)

    async def read_events(self, after: int, limit: int) -> list[EventRow]:
        read: list[EventRow] = []

        def take(r: asyncpg.Record) -> bool:
            read.extend(unbatched(r, after, limit - len(read)))
            return len(read) >= limit

        await self._read_event_rows(EVENT_COLUMNS, after, take)
        return read

    async def read_event_columns(self, after: int, limit: int) -> list[EventColumns]:
        # Whole rows, only the columns counted: no event is built, and most of what an event
        # records is never read.
        read: list[EventColumns] = []
        count = 0

        def take(r: asyncpg.Record) -> bool:
            nonlocal count
            positions, columns = _row_columns(r)
            read.append(EventColumns(positions, *columns))
            count += r[1]
            return count >= limit

        await self._read_event_rows(COUNTED_COLUMNS, after, take)
        return read

    async def count_unfinished(self) -> tuple[int, dict[tuple[str, State], int]]:
        """One REPEATABLE READ transaction: its snapshot holds the task changes of exactly the
        transactions whose events it sees; it numbers every one of those not yet numbered (so
        they are all at or below its last pos, and everything committed later is above it),
        then counts in the same snapshot. A concurrent numbering makes it start again."""

        async def count(conn: asyncpg.Connection) -> tuple[int, dict[tuple[str, State], int]]:
            last = await self._number_events(conn)
            sql = self._sql(UNFINISHED_BY_POOL_AND_STATE)
            return last, {(r[0], State(r[1])): r[2] for r in await conn.fetch(sql)}

        for attempt in range(20):
            try:
                return await self._tx(count, isolation="repeatable_read")
            except asyncpg.exceptions.SerializationError:
                if attempt == 19:
                    raise
        raise AssertionError("unreachable")

    async def event_bounds(self) -> tuple[int, int]:
        sql = self._sql(EVENT_BOUNDS)
        row = await self._read(lambda c: c.fetchrow(sql))
        return row[0], row[1]

    async def purge_events(self, before: int, limit: int) -> int:
        sql = self._sql(PURGE_EVENTS)
        return await self._tx(lambda c: c.fetchval(sql, before, limit))
