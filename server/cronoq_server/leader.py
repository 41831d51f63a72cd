"""Leader election. SQLite: an exclusive lock on a file beside the database, which
standbys on the same host wait for; the file names the leader's address."""

from __future__ import annotations

import asyncio
import fcntl
import os

RETRY_S = 0.2


class FileLeadership:
    def __init__(self, db_path: str, advertise: str):
        self.path = os.path.abspath(db_path) + ".leader"
        self._advertise = advertise
        self._fd: int | None = None

    def try_acquire(self) -> bool:
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
        """Returns once this server holds the lock; standbys keep trying."""
        while not self.try_acquire():
            await asyncio.sleep(RETRY_S)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def current_leader(self) -> str:
        try:
            with open(self.path) as f:
                return f.read().strip()
        except OSError:
            return ""

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
