"""SQLite store plumbing: one connection on one dedicated thread, writes committed in groups."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ...ids import make_task_id
from ..base import ScanTimedOut, StoreSettings
from ..fair import GroupRanks, rank_keep, rank_reset
from .sql import COMMIT, QUERY_ONLY
from .sql.core import BEGIN_IMMEDIATE, RELEASE_OP, ROLLBACK, ROLLBACK_TO_OP, SAVEPOINT_OP

T = TypeVar("T")

MAX_GROUP = 256  # writes committed together at most
MAX_VARS = 900  # well under SQLite's bound on host parameters per statement
PROGRESS_STEPS = 10_000  # VM steps between a timed read's looks at the clock (about a ms of a scan)


@dataclass(slots=True)
class _Op:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    write: bool
    fut: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.cancelled():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


def _chunks(items: list[T], size: int = MAX_VARS) -> Iterable[list[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _yield_cpu() -> None:
    """Makes this thread (a scan's) the lowest CPU priority: on a busy machine it leaves the cores
    to the store's thread and the event loop. Linux only, where a thread has a nice value of its own."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class SqliteCore:
    # The one writer thread runs a stream's steps one after the other anyway: one step of all
    # the worker's free slots commits more per transaction (burn-down 18.1-18.4k tasks/s
    # against 15.0-15.5k with two steps of half each).
    work_steps = 1
    # A caller queued behind a bulk action's batch waits for it: 2 ms batches keep another
    # caller's p99 at 1.1-1.9x its quiet value during a retry of 50,000 tasks, 5 ms ones at
    # 1.8-3.3x (bench/bulk.py).
    bulk_batch_s = 0.002

    def __init__(self, path: str, settings: StoreSettings, synchronous: str = "full"):
        self.path = path
        self.settings = settings
        self._synchronous = synchronous.upper()
        self._db: sqlite3.Connection | None = None
        self._ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        # Used on the store's thread only, as are the writes that rank.
        self._ranks = GroupRanks(settings.group_pools)
        self._key_after: dict[str, str] = {}  # pool -> the last key a lease visited (_keys)
        self._rank_reset = rank_reset(settings.group_pools)
        self._rank_keep = rank_keep(settings.group_pools)
        self._thread: threading.Thread | None = None
        # Bulk actions' scans run on threads of their own (settings.bulk_scans): however many
        # there are, the other reads aside keep the default executor's threads.
        self._scans: ThreadPoolExecutor | None = None

    # -- plumbing -------------------------------------------------------------
    #
    # One thread owns the connection. Writes queued while it works are committed
    # together (group commit): each runs inside its own SAVEPOINT, so one that fails
    # rolls back alone, and every caller hears back only after the shared COMMIT.

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._submit_op(fn, args, False)

    async def _tx(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._submit_op(fn, args, True)

    def _submit_op(self, fn: Callable[..., T], args: tuple[Any, ...], write: bool) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._ops.put(_Op(fn, args, write, fut, loop))
        return fut

    def _serve_ops(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            batch = [op]
            while len(batch) < MAX_GROUP:
                try:
                    nxt = self._ops.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._ops.put(None)
                    break
                batch.append(nxt)
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Op]) -> None:
        db = self._conn
        done: list[tuple[_Op, bool, Any]] = []
        writes = [op for op in batch if op.write]
        try:
            if writes:
                db.execute(BEGIN_IMMEDIATE)
                for op in writes:
                    db.execute(SAVEPOINT_OP)
                    try:
                        done.append((op, True, op.fn(db, *op.args)))
                        db.execute(RELEASE_OP)
                    except Exception as err:
                        db.execute(ROLLBACK_TO_OP)
                        db.execute(RELEASE_OP)
                        done.append((op, False, err))
                db.execute(COMMIT)
        except Exception as err:
            if db.in_transaction:
                db.execute(ROLLBACK)
            done = [(op, False, err) for op in writes]
        for op in batch:
            if not op.write:
                try:
                    done.append((op, True, op.fn(*op.args)))
                except Exception as err:
                    done.append((op, False, err))
        for op, ok, value in done:
            try:
                op.loop.call_soon_threadsafe(_settle, op.fut, ok, value)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting
                pass

    @property
    def _conn(self) -> sqlite3.Connection:
        assert self._db is not None, "store is not open"
        return self._db

    def _full_id(self, seq: int) -> int:
        return make_task_id(self.settings.shard_number, seq)

    async def _read_aside(
        self, fn: Callable[[sqlite3.Connection], T], on: Executor | None = None, timeout_us: int | None = None
    ) -> T:
        """fn on a read-only connection of its own, off the store's thread: a long scan must not
        hold up the calls queued there (WAL lets it read beside them); it sees committed data.

        on: the executor to run it (None: the default one); timeout_us: its statements are
        interrupted (sqlite3.OperationalError, SQLITE_INTERRUPT) once it has run this long."""

        def read() -> T:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=30)
            try:
                db.execute(QUERY_ONLY)
                if timeout_us is not None:
                    deadline = time.monotonic() + timeout_us / 1e6
                    db.set_progress_handler(lambda: time.monotonic() > deadline, PROGRESS_STEPS)
                return fn(db)
            finally:
                db.close()

        return await asyncio.get_running_loop().run_in_executor(on, read)

    async def _scan(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """fn, a read that may scan far (a filter few tasks match: 18 ms for 200,000 tasks),
        aside on the scans' threads, stopped past bulk_scan_timeout (ScanTimedOut): other calls
        would wait behind it on the store's thread."""
        timeout_us = self.settings.bulk_scan_timeout_us
        try:
            return await self._read_aside(fn, self._scans, timeout_us)
        except sqlite3.OperationalError as err:
            if err.sqlite_errorcode != sqlite3.SQLITE_INTERRUPT:
                raise
            raise ScanTimedOut(f"interrupted after {timeout_us / 1e6:g} s") from None
