"""Leader election: one leader per store, standbys that keep trying.

SQLite: an exclusive lock on a file beside the database (standbys on the same host wait
for it); the file names the leader's address. PostgreSQL: a session advisory lock held
on a dedicated connection, plus a fencing term in the store that the new leader bumps
and every leader write checks. The lock connection also LISTENs for new-task
notifications; if it breaks, leadership is lost at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from collections.abc import Callable

import asyncpg

from .store.postgres import CONNECTION_ERRORS, notify_channel, quote_ident

log = logging.getLogger("cronoq.leader")

RETRY_S = 0.2
PING_S = 0.25


class FileLeadership:
    term = 0  # a flock cannot be lost while the process lives: no fencing needed

    def __init__(self, db_path: str, advertise: str):
        self.path = os.path.abspath(db_path) + ".leader"
        self._advertise = advertise
        self._fd: int | None = None
        self.describe = f"lock file {self.path}"

    async def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._advertise.encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return True

    async def acquire(self) -> None:
        while not await self.try_acquire():
            await asyncio.sleep(RETRY_S)

    async def lost(self) -> None:
        await asyncio.Event().wait()

    def mark_lost(self) -> None:
        """No fencing on SQLite: a flock cannot be taken over while its holder lives."""

    def current_leader(self) -> str:
        try:
            with open(self.path) as f:
                return f.read().strip()
        except OSError:
            return ""

    async def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class PgLeadership:
    def __init__(self, url: str, schema: str, advertise: str, holder: str, on_notify: Callable[[], None]):
        self._url = url
        self._schema = schema
        self._s = quote_ident(schema)
        self._advertise = advertise
        self._holder = holder
        self._on_notify = on_notify
        self._conn: asyncpg.Connection | None = None
        self._lost = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        self._leader = ""
        self.term = 0
        self.describe = f"advisory lock on schema {schema}"

    async def _connect(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(self._url, timeout=5)
        return self._conn

    async def try_acquire(self) -> bool:
        try:
            conn = await self._connect()
            key = f"cronoq-leader:{self._schema}"
            if not await conn.fetchval("SELECT pg_try_advisory_lock(hashtextextended($1, 0))", key):
                self._leader = await self._read_leader(conn)
                return False
            async with conn.transaction():
                self.term = await conn.fetchval(
                    f"UPDATE {self._s}.leader SET term = term + 1, holder = $1, advertise = $2,"
                    " acquired_at = now() WHERE id = 1 RETURNING term",
                    self._holder,
                    self._advertise,
                )
            await conn.add_listener(notify_channel(self._schema), self._notified)
        except (*CONNECTION_ERRORS, asyncpg.PostgresError) as err:
            log.debug("leadership attempt failed: %s", err)
            await self._drop_connection()
            return False
        self._leader = self._advertise
        self._lost.clear()
        conn.add_termination_listener(lambda _c: self._lost.set())
        self._watch = asyncio.create_task(self._watch_connection(conn))
        return True

    async def _read_leader(self, conn: asyncpg.Connection) -> str:
        try:
            return str(await conn.fetchval(f"SELECT advertise FROM {self._s}.leader WHERE id = 1") or "")
        except asyncpg.exceptions.UndefinedTableError:
            return ""

    def _notified(self, *_args: object) -> None:
        self._on_notify()

    async def _watch_connection(self, conn: asyncpg.Connection) -> None:
        """A leader whose lock connection breaks must stop acting at once."""
        while not self._lost.is_set():
            try:
                await asyncio.wait_for(conn.fetchval("SELECT 1"), PING_S * 4)
            except Exception as err:
                log.error("leadership lock connection lost: %s: %s", type(err).__name__, err)
                self._lost.set()
                break
            await asyncio.sleep(PING_S)

    async def acquire(self) -> None:
        while not await self.try_acquire():
            await asyncio.sleep(RETRY_S)

    def mark_lost(self) -> None:
        """A write was fenced: another server has a newer term, so this one no longer leads."""
        self._lost.set()

    async def lost(self) -> None:
        await self._lost.wait()
        await self._drop_connection()

    def current_leader(self) -> str:
        return self._leader

    async def _drop_connection(self) -> None:
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        self._watch = None
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.terminate()

    async def release(self) -> None:
        """Gives the lock up (closing its session releases it) so a standby takes over now."""
        self._lost.set()
        await self._drop_connection()
