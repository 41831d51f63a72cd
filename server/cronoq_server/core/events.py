"""In-process notifications: lease long polls, WaitTask waiters and Watch streams."""

from __future__ import annotations

import asyncio
import time

from cronoq.v1 import task_pb2

from ..store.base import TERMINAL, Changes, State, Store, TaskRow
from .convert import to_task

WATCH_QUEUE_SIZE = 10_000


class Watcher:
    def __init__(self, pools: frozenset[str] | None):
        self.pools = pools
        self.queue: asyncio.Queue[task_pb2.TaskEvent | None] = asyncio.Queue(WATCH_QUEUE_SIZE)
        self.overflowed = False


class EventBus:
    def __init__(self, store: Store, shard_name: str, shard_number: int):
        self._store = store
        self._shard_name = shard_name
        self._shard_number = shard_number
        self._lease_signal = asyncio.Event()
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._watchers: set[Watcher] = set()

    # -- lease long polls -----------------------------------------------------

    def lease_signal(self) -> asyncio.Event:
        """The event the next wake sets; take it before querying to miss nothing."""
        return self._lease_signal

    def wake_leasers(self) -> None:
        signal, self._lease_signal = self._lease_signal, asyncio.Event()
        signal.set()

    # -- waiters --------------------------------------------------------------

    def wait_terminal(self, seq: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(seq, []).append(fut)
        return fut

    def forget_waiter(self, seq: int, fut: asyncio.Future[None]) -> None:
        futs = self._waiters.get(seq)
        if futs and fut in futs:
            futs.remove(fut)
            if not futs:
                del self._waiters[seq]

    # -- watch ----------------------------------------------------------------

    def watch(self, pools: frozenset[str] | None) -> Watcher:
        watcher = Watcher(pools)
        self._watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close_watchers(self) -> None:
        """Ends every Watch stream (on shutdown); a full queue's consumer was already dropped."""
        for watcher in self._watchers:
            if not watcher.queue.full():
                watcher.queue.put_nowait(None)

    # -- publishing -----------------------------------------------------------

    async def publish(self, changes: Changes, rows: list[TaskRow] | None = None) -> None:
        """Tells everyone who waits about changes; rows, when given, spare a read."""
        if not changes:
            return
        if any(state == State.PENDING for _, state in changes):
            self.wake_leasers()
        for seq, state in changes:
            if state in TERMINAL and seq in self._waiters:
                for fut in self._waiters.pop(seq):
                    if not fut.done():
                        fut.set_result(None)
        if self._watchers:
            if rows is None:
                rows = await self._store.get_many([seq for seq, _ in changes])
            self._send_to_watchers(rows)

    def _send_to_watchers(self, rows: list[TaskRow]) -> None:
        now_us = int(time.time() * 1e6)
        for row in rows:
            event = task_pb2.TaskEvent(task=to_task(row, self._shard_number), shard=self._shard_name)
            event.time.FromMicroseconds(now_us)
            for watcher in list(self._watchers):
                if watcher.pools is not None and row.pool not in watcher.pools:
                    continue
                if watcher.queue.full():
                    # A consumer too slow to keep up is ended; it reconnects.
                    watcher.overflowed = True
                    self._watchers.discard(watcher)
                    continue
                watcher.queue.put_nowait(event)
