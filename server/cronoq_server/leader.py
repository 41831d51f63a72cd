"""Leader election: one leader per store, standbys that keep trying.

SQLite: an exclusive lock on a file beside the database (standbys on the same host wait
for it); the file names the leader's address. PostgreSQL: a session advisory lock held
on a dedicated connection, plus a fencing term in the store that the new leader bumps
and every leader write checks. The lock connection also LISTENs for new-task
notifications; if it breaks, leadership is lost at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable

import asyncpg

from .store.postgres import CONNECTION_ERRORS, notify_channel, quote_ident

log = logging.getLogger("cronoq.leader")

RETRY_S = 0.2
PING_S = 0.25
# A standby says it is there at most this often, and is listed while it said so this recently.
STANDBY_SAY_S = 1.0
STANDBY_SEEN_S = 5.0


class FileLeadership:
    term = 0  # a flock cannot be lost while the process lives: no fencing needed

    def __init__(self, db_path: str, advertise: str, holder: str = ""):
        self.path = os.path.abspath(db_path) + ".leader"
        self._advertise = advertise
        self._fd: int | None = None
        self.describe = f"lock file {self.path}"
        # A standby touches a file of its own beside the lock file, naming its address.
        self._standby_path = f"{self.path}.standby-{holder or os.getpid()}"
        self._said_at = 0.0

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
        with contextlib.suppress(OSError):
            os.unlink(self._standby_path)
        return True

    async def acquire(self) -> None:
        while not await self.try_acquire():
            self._say_standby()
            await asyncio.sleep(RETRY_S)

    def _say_standby(self) -> None:
        if time.monotonic() - self._said_at < STANDBY_SAY_S:
            return
        self._said_at = time.monotonic()
        try:
            with open(self._standby_path, "w") as f:
                f.write(self._advertise)
        except OSError as err:
            log.debug("cannot write %s: %s", self._standby_path, err)

    async def standbys(self) -> list[str]:
        """The addresses of the standbys that waited for the lock in the last STANDBY_SEEN_S."""
        return self._read_standbys()

    def _read_standbys(self) -> list[str]:
        folder, prefix = os.path.split(self.path)
        found = []
        for name in os.listdir(folder or "."):
            if not name.startswith(os.path.basename(prefix) + ".standby-"):
                continue
            path = os.path.join(folder, name)
            try:
                age = time.time() - os.stat(path).st_mtime
                if age > 60:
                    os.unlink(path)  # a standby that went away without a word
                if age > STANDBY_SEEN_S:
                    continue
                with open(path) as f:
                    found.append(f.read().strip())
            except OSError:
                continue
        return sorted(a for a in found if a)

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
        with contextlib.suppress(OSError):
            os.unlink(self._standby_path)
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
        self._said_at = 0.0
        self._conn_lock = asyncio.Lock()  # the ping and the standbys query share the lock connection

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
                await self._say_standby(conn)
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

    async def _say_standby(self, conn: asyncpg.Connection) -> None:
        if time.monotonic() - self._said_at < STANDBY_SAY_S:
            return
        self._said_at = time.monotonic()
        try:
            await conn.execute(
                f"INSERT INTO {self._s}.standbys (holder, advertise, seen_at) VALUES ($1, $2, now())"
                " ON CONFLICT (holder) DO UPDATE SET advertise = $2, seen_at = now()",
                self._holder,
                self._advertise,
            )
        except asyncpg.exceptions.UndefinedTableError:
            pass  # the leader has not made (or migrated) the store yet

    async def standbys(self) -> list[str]:
        """The addresses of the standbys that tried for the lock in the last STANDBY_SEEN_S
        (read on the lock connection; those not seen for a minute are deleted)."""
        conn = self._conn
        if conn is None:
            return []
        try:
            async with self._conn_lock:
                rows = await asyncio.wait_for(
                    conn.fetch(
                        f"WITH gone AS (DELETE FROM {self._s}.standbys WHERE seen_at < now() - interval '60 seconds')"
                        f" SELECT advertise FROM {self._s}.standbys"
                        " WHERE seen_at > now() - $1::float8 * interval '1 second' AND holder <> $2 ORDER BY advertise",
                        STANDBY_SEEN_S,
                        self._holder,
                    ),
                    PING_S * 4,
                )
        except (*CONNECTION_ERRORS, asyncpg.PostgresError, TimeoutError) as err:
            log.debug("cannot read the standbys: %s", err)
            return []
        return [r[0] for r in rows]

    def _notified(self, *_args: object) -> None:
        self._on_notify()

    async def _watch_connection(self, conn: asyncpg.Connection) -> None:
        """A leader whose lock connection breaks must stop acting at once."""
        while not self._lost.is_set():
            try:
                async with self._conn_lock:
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
