"""In-process notifications: lease long polls, WaitTask waiters and Watch streams."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable

import grpc

from cronoq.v1 import task_pb2

from ..errors import ApiError
from ..store.base import TERMINAL, Changes, State, Store, TaskRow
from .convert import to_task

log = logging.getLogger("cronoq.events")

# What one Watch stream may hold unread before it is ended (it reconnects).
WATCH_MAX_EVENTS = 10_000
WATCH_MAX_BYTES = 8 << 20
# Changes waiting to be sent to Watch streams; past this, every stream is behind and ends.
FANOUT_MAX_BATCHES = 10_000


class Watcher:
    """One Watch stream's buffer, bounded in events and in bytes."""

    def __init__(self, pools: frozenset[str] | None, include_payloads: bool):
        self.pools = pools
        self.include_payloads = include_payloads
        self._events: deque[tuple[task_pb2.TaskEvent, int]] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        self.ended: str | None = None  # why the stream ends, once it must
        self._behind = False  # it ends because it fell behind: an error, not a clean end

    def offer(self, event: task_pb2.TaskEvent, size: int) -> bool:
        """Buffers the event; False when the stream is too far behind (it is then ended)."""
        if len(self._events) >= WATCH_MAX_EVENTS or self._bytes + size > WATCH_MAX_BYTES:
            self.fell_behind(
                f"watch fell behind: {len(self._events)} events ({self._bytes} bytes) unread, over the limit of "
                f"{WATCH_MAX_EVENTS} events or {WATCH_MAX_BYTES} bytes; reconnect to resume"
            )
            return False
        self._events.append((event, size))
        self._bytes += size
        self._ready.set()
        return True

    def end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
        self._ready.set()

    def fell_behind(self, reason: str) -> None:
        """Ends the stream with an error (ABORTED) after what it holds: the caller reconnects."""
        if self.ended is None:
            self._behind = True
        self.end(reason)

    async def next(self) -> task_pb2.TaskEvent | None:
        """The next event; None when the stream ended cleanly. Raises ApiError (ABORTED) when
        it fell behind: everything buffered before that is delivered first."""
        while not self._events:
            if self.ended is not None:
                if self._behind:
                    raise ApiError(grpc.StatusCode.ABORTED, self.ended, reason="WATCH_FELL_BEHIND", retry_delay=0.0)
                return None
            self._ready.clear()
            await self._ready.wait()
        event, size = self._events.popleft()
        self._bytes -= size
        return event


class LeaseWaiter:
    """One lease long poll waiting for work in its pools."""

    __slots__ = ("event", "pools")

    def __init__(self, pools: Iterable[str]):
        self.pools = tuple(pools)
        self.event = asyncio.Event()


class EventBus:
    def __init__(self, store: Store, shard_name: str, shard_number: int):
        self._store = store
        self._shard_name = shard_name
        self._shard_number = shard_number
        self._leasers: dict[str, deque[LeaseWaiter]] = {}
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._watchers: set[Watcher] = set()
        self._fanout: deque[tuple[Changes, list[TaskRow] | None]] = deque()
        self._fanout_ready = asyncio.Event()
        self._fanout_task: asyncio.Task[None] | None = None
        self.draining = False

    # -- lease long polls -----------------------------------------------------

    def lease_waiter(self, pools: Iterable[str]) -> LeaseWaiter:
        """Registers a long poll; take it before querying the store so no wake is missed."""
        waiter = LeaseWaiter(pools)
        for pool in waiter.pools:
            self._leasers.setdefault(pool, deque()).append(waiter)
        return waiter

    def forget_leaser(self, waiter: LeaseWaiter) -> None:
        for pool in waiter.pools:
            queue = self._leasers.get(pool)
            if queue is not None:
                try:
                    queue.remove(waiter)
                except ValueError:
                    pass
                if not queue:
                    del self._leasers[pool]

    def work_available(self, pool: str, count: int) -> int:
        """Wakes up to count long polls of the pool, longest waiting first; returns how many."""
        queue = self._leasers.get(pool)
        woken = 0
        while queue and woken < count:
            waiter = queue.popleft()
            if not waiter.event.is_set():
                waiter.event.set()
                woken += 1
        if queue is not None and not queue:
            self._leasers.pop(pool, None)
        return woken

    def nudge_leasers(self) -> None:
        """Wakes the longest-waiting long poll of each pool: it looks at the store once more.

        For work that no in-process change announced (a NOTIFY, the leader's periodic check).
        """
        for pool in list(self._leasers):
            self.work_available(pool, 1)

    def wake_leasers(self) -> None:
        """Wakes every long poll (leadership changes, drain): each sees why and returns."""
        for queue in self._leasers.values():
            for waiter in queue:
                waiter.event.set()
        self._leasers.clear()

    # -- waiters --------------------------------------------------------------

    def wait_terminal(self, seq: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.draining:
            fut.set_result(None)  # a draining server answers at once
        else:
            self._waiters.setdefault(seq, []).append(fut)
        return fut

    def forget_waiter(self, seq: int, fut: asyncio.Future[None]) -> None:
        futs = self._waiters.get(seq)
        if futs and fut in futs:
            futs.remove(fut)
            if not futs:
                del self._waiters[seq]

    def drain(self) -> None:
        """Answers every open wait and long poll now, and ends every Watch stream."""
        self.draining = True
        for futs in self._waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(None)
        self._waiters.clear()
        self.wake_leasers()
        self.close_watchers()

    # -- watch ----------------------------------------------------------------

    def watch(self, pools: frozenset[str] | None, include_payloads: bool = False) -> Watcher:
        watcher = Watcher(pools, include_payloads)
        if self.draining:
            watcher.end("server is shutting down")
        self._watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close_watchers(self) -> None:
        """Ends every Watch stream (on shutdown): they deliver what they hold, then end."""
        for watcher in self._watchers:
            watcher.end("server is shutting down")
        self._watchers.clear()

    # -- publishing -----------------------------------------------------------

    async def publish(self, changes: Changes, rows: list[TaskRow] | None = None) -> None:
        """Tells everyone who waits about changes; rows, when given, spare a read.

        Long polls and waits are told now; Watch streams are fed by a task of their own, off
        the caller's path.
        """
        if not changes:
            return
        pending = [seq for seq, state in changes if state == State.PENDING]
        if pending:
            if rows is not None:
                by_pool = Counter(r.pool for r in rows if r.state == State.PENDING)
                for pool, count in by_pool.items():
                    self.work_available(pool, count)
            else:  # pools unknown: wake as many long polls as tasks became available
                self._wake_any(len(pending))
        for seq, state in changes:
            if state in TERMINAL and seq in self._waiters:
                for fut in self._waiters.pop(seq):
                    if not fut.done():
                        fut.set_result(None)
        if self._watchers:
            self._queue_fanout(changes, rows)

    def _wake_any(self, count: int) -> None:
        for pool in list(self._leasers):
            if count <= 0:
                return
            count -= self.work_available(pool, count)

    def _queue_fanout(self, changes: Changes, rows: list[TaskRow] | None) -> None:
        if len(self._fanout) >= FANOUT_MAX_BATCHES:
            self._fanout.clear()
            for watcher in list(self._watchers):
                watcher.fell_behind(
                    f"watch fell behind: more than {FANOUT_MAX_BATCHES} changes unsent; reconnect to resume"
                )
            self._watchers.clear()
            return
        self._fanout.append((changes, rows))
        self._fanout_ready.set()
        if self._fanout_task is None or self._fanout_task.done():
            self._fanout_task = asyncio.create_task(self._fanout_forever())

    async def _fanout_forever(self) -> None:
        while True:
            while not self._fanout:
                if not self._watchers:
                    return
                self._fanout_ready.clear()
                await self._fanout_ready.wait()
            changes, rows = self._fanout.popleft()
            if not self._watchers:
                continue
            try:
                if rows is None:
                    rows = await self._store.get_many([seq for seq, _ in changes])
                else:
                    wanted = {seq for seq, _ in changes}
                    rows = [r for r in rows if r.seq in wanted]
            except Exception as err:  # a store hiccup loses events: end streams, they reconnect
                log.warning("watch: cannot read changed tasks (%s); ending watch streams", err)
                for watcher in list(self._watchers):
                    watcher.fell_behind(f"watch fell behind: changed tasks could not be read ({err}); reconnect")
                self._watchers.clear()
                continue
            self._send_to_watchers(rows)

    def _send_to_watchers(self, rows: list[TaskRow]) -> None:
        now_us = time.time_ns() // 1000
        for row in rows:
            full: tuple[task_pb2.TaskEvent, int] | None = None
            bare: tuple[task_pb2.TaskEvent, int] | None = None
            for watcher in list(self._watchers):
                if watcher.pools is not None and row.pool not in watcher.pools:
                    continue
                if watcher.include_payloads:
                    full = full or self._event(row, now_us, True)
                    event, size = full
                else:
                    bare = bare or self._event(row, now_us, False)
                    event, size = bare
                if not watcher.offer(event, size):
                    self._watchers.discard(watcher)

    def _event(self, row: TaskRow, now_us: int, include_payloads: bool) -> tuple[task_pb2.TaskEvent, int]:
        task = to_task(row, self._shard_number)
        if not include_payloads:
            task.ClearField("payload")
            task.ClearField("result")
        event = task_pb2.TaskEvent(task=task, shard=self._shard_name)
        event.time.FromMicroseconds(now_us)
        return event, event.ByteSize()
