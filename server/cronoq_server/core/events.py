"""In-process notifications: lease long polls, WaitTask waiters and Watch streams."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Iterable

import grpc

from cronoq.v1 import task_pb2

from ..errors import ApiError, invalid
from ..store.base import TERMINAL, Changes, EventRow, State, Store, StoreUnavailable, TaskRow
from .activity import Activity
from .convert import to_task
from .counts import TaskCounts

log = logging.getLogger("cronoq.events")

# What one Watch stream may hold unread before it is ended (it reconnects).
WATCH_MAX_EVENTS = 10_000
WATCH_MAX_BYTES = 8 << 20
# Events read from the store at a time: by the fan-out, by a replay, by the retention purge.
FANOUT_BATCH = 1000
REPLAY_BATCH = 1000
PURGE_BATCH = 10_000
# Events the leader's task counts read at a time, when the fan-out has not read them already.
COUNT_BATCH = 5000
# How often the leader numbers committed events (besides right after each change) and purges.
SEQUENCE_EVERY_S = 0.5
EVENT_RETENTION_EVERY_S = 10.0


class Watcher:
    """One Watch stream's buffer, bounded in events and in bytes."""

    def __init__(self, pools: frozenset[str] | None, include_payloads: bool):
        self.pools = pools
        self.include_payloads = include_payloads
        self.pos = 0  # the last event seq this stream has passed (delivered, or not its pools')
        self.live = False  # the fan-out offers it events (once any replay has caught up)
        self._events: deque[tuple[task_pb2.TaskEvent, int]] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        self.ended: str | None = None  # why the stream ends, once it must
        self._error: ApiError | None = None  # it ends with this error, not cleanly

    def offer(self, event: task_pb2.TaskEvent, size: int) -> bool:
        """Buffers the event; False when the stream is too far behind (it is then ended)."""
        if len(self._events) >= WATCH_MAX_EVENTS or self._bytes + size > WATCH_MAX_BYTES:
            self.fell_behind(
                f"watch fell behind: {len(self._events)} events ({self._bytes} bytes) unread, over the limit of "
                f"{WATCH_MAX_EVENTS} events or {WATCH_MAX_BYTES} bytes; reconnect with the last cursor to resume"
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
        self.fail(ApiError(grpc.StatusCode.ABORTED, reason, reason="WATCH_FELL_BEHIND", retry_delay=0.0))

    def fail(self, error: ApiError) -> None:
        """Ends the stream with this error, after what it holds."""
        if self.ended is None:
            self._error = error
        self.end(error.message)

    async def next(self) -> task_pb2.TaskEvent | None:
        """The next event; None when the stream ended cleanly. Raises the ApiError it was ended
        with (ABORTED when it fell behind): everything buffered before that is delivered first."""
        while not self._events:
            if self.ended is not None:
                if self._error is not None:
                    raise self._error
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
    def __init__(
        self,
        store: Store,
        shard_name: str,
        shard_number: int,
        watch_window_s: float = 3600.0,
        pools: Iterable[str] = (),
    ):
        self._store = store
        self._shard_name = shard_name
        self._shard_number = shard_number
        self._watch_window_us = int(watch_window_s * 1e6)
        self._leasers: dict[str, deque[LeaseWaiter]] = {}
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._watchers: set[Watcher] = set()
        # The last event seq the fan-out has passed to live streams (None: read it from the store).
        self._delivered: int | None = None
        self._fanout_ready = asyncio.Event()
        self._fanout_task: asyncio.Task[None] | None = None
        self.draining = False
        # The leader's unfinished tasks by pool and state (the cronoq_tasks gauge), kept from the events.
        self.activity = Activity()  # the leader's recent submissions, starts and outcomes per pool
        self.counts = TaskCounts(pools, gauge=True, activity=self.activity)

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

    def wake_pool_leasers(self, pool: str) -> None:
        """Wakes every long poll of the pool (it was resumed): each looks at the store again."""
        for waiter in self._leasers.pop(pool, ()):
            waiter.event.set()

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
    #
    # Streams read the stored event sequence, never in-process change lists: a stream that
    # resumes from a cursor replays from the store, then goes live; the fan-out reads the events
    # after the last it delivered (woken by publish and by the sequencer) and offers them to the
    # live streams. A stream's pos drops what it has already passed, so the handover from
    # replay to live repeats nothing and skips nothing.

    async def open_watch(
        self, pools: frozenset[str] | None, include_payloads: bool, after: int | None = None, cursor: str = ""
    ) -> Watcher:
        """A registered stream: live from now (after None), or replaying the events after seq
        `after` first. Raises OUT_OF_RANGE when those events are no longer all kept."""
        if after is not None:
            await self._check_resumable(after, cursor)
        watcher = Watcher(pools, include_payloads)
        if self.draining:
            watcher.end("server is shutting down")
        if after is None:
            watcher.pos = await self.position()
            watcher.live = True  # no await since the position was read: no event falls between
        else:
            watcher.pos = after
        self._watchers.add(watcher)
        return watcher

    async def _check_resumable(self, after: int, cursor: str) -> None:
        purged, last = await self._store.event_bounds()
        if after < purged:
            raise ApiError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"cursor {cursor!r}: the events after it are no longer kept (events up to {purged} were "
                f"purged; server.watch_window is {self._watch_window_us / 1e6:g}s); "
                "watch again without a cursor and read the tasks' current state",
                reason="CURSOR_EXPIRED",
            )
        if after > last:
            raise ApiError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"cursor {cursor!r} is past shard {self._shard_name!r}'s last event ({last}): "
                "its store was reset or the cursor is from another cluster; watch again without a cursor",
                reason="CURSOR_AHEAD",
            )

    async def stream(self, watcher: Watcher) -> AsyncGenerator[task_pb2.TaskEvent, None]:
        """The stream's events: any replay, then live ones until it ends (raising its error)."""
        try:
            if not watcher.live:
                try:
                    async for replayed in self._replay(watcher):
                        yield replayed
                except StoreUnavailable as err:
                    raise ApiError(
                        grpc.StatusCode.UNAVAILABLE, f"watch: {err}", reason="STORE_UNAVAILABLE", retry_delay=0.5
                    ) from None
            while (event := await watcher.next()) is not None:
                yield event
        finally:
            self.unwatch(watcher)

    async def _replay(self, watcher: Watcher) -> AsyncGenerator[task_pb2.TaskEvent, None]:
        """Stored events after watcher.pos, as fast as the caller reads, until it reaches what the
        fan-out has delivered; then it is live (the check and the switch with no await between)."""
        while watcher.ended is None:
            if watcher.pos >= await self.position():
                watcher.live = True
                self._wake_fanout()  # events past the fan-out's position go out now
                return
            events = await self._store.read_events(watcher.pos, REPLAY_BATCH)
            if (not events or events[0].seq != watcher.pos + 1) and not await self._deleted_after(watcher.pos):
                raise ApiError(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"cursor {make_cursor(self._shard_number, watcher.pos)!r}: the events after it were purged "
                    f"while replaying (server.watch_window is {self._watch_window_us / 1e6:g}s); watch again "
                    "without a cursor",
                    reason="CURSOR_EXPIRED",
                )
            if not events:  # those up to the position were deleted with their tasks
                watcher.pos = await self.position()
                continue
            for ev, row in await self._join(events):
                watcher.pos = ev.seq
                if watcher.pools is None or row.pool in watcher.pools:
                    yield self._event(ev, row, watcher.include_payloads)[0]
            watcher.pos = events[-1].seq

    async def _deleted_after(self, pos: int) -> bool:
        """Whether the events missing after pos were deleted with their tasks (an operator's
        DeleteTask), not purged: the stream goes on past them."""
        purged, _ = await self._store.event_bounds()
        return pos >= purged

    async def position(self) -> int:
        """The last event seq the fan-out has delivered (read from the store when not known)."""
        if self._delivered is None:
            last = await self._store.sequence_events()
            if self._delivered is None:
                self._delivered = last
        return self._delivered

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close_watchers(self) -> None:
        """Ends every Watch stream (on shutdown): they deliver what they hold, then end."""
        for watcher in self._watchers:
            watcher.end("server is shutting down")
        self._watchers.clear()

    def fail_watchers(self, error: ApiError) -> None:
        """Ends every Watch stream with an error after what it holds (they reconnect with a cursor)."""
        for watcher in self._watchers:
            watcher.fail(error)
        self._watchers.clear()

    def lead(self) -> None:
        """On taking over: the store moved on while this server did not lead (the sequencer
        starts the task counts again from the store)."""
        self._delivered = None
        self.counts.stop()

    def step_down(self) -> None:
        """The task counts are the leader's: a standby shows none rather than stale ones."""
        self.counts.stop()

    # -- the leader's event services --------------------------------------------

    async def sequence_once(self) -> None:
        """Numbers committed events (PostgreSQL), folds them into the task counts, and has live
        streams sent what is new."""
        if self.counts.position is None:
            self.counts.start(*await self._store.count_unfinished())
        last = await self._store.sequence_events()
        await self._count_to(last)
        if self._delivered is None or last > self._delivered:
            if any(w.live for w in self._watchers):
                self._wake_fanout()
            else:  # nobody to deliver to: a new stream starts from here
                self._delivered = last

    async def _count_to(self, last: int) -> None:
        """Folds the events up to `last` that the fan-out has not folded already."""
        while (pos := self.counts.position) is not None and pos < last:
            read = await self._store.read_event_columns(pos, COUNT_BATCH)
            if self.counts.position is None:
                return  # stepped down meanwhile
            if not self.counts.fold_columns(read) or self.counts.position == pos:  # what follows pos is gone
                # Purged before they were counted (the store was out of reach that long): recount.
                log.warning("task counts: events after %d are gone; counting the tasks again", pos)
                self.counts.start(*await self._store.count_unfinished())

    async def purge_once(self) -> None:
        """Deletes events older than the watch window, a bounded batch per transaction."""
        before = time.time_ns() // 1000 - self._watch_window_us
        purged = 0
        while (n := await self._store.purge_events(before, PURGE_BATCH)) > 0:
            purged += n
            if n < PURGE_BATCH:
                break
        if purged:
            log.info("purged %d event(s) older than server.watch_window", purged)

    # -- publishing -----------------------------------------------------------

    async def publish(self, changes: Changes, rows: list[TaskRow] | None = None) -> None:
        """Tells everyone who waits about changes (already committed, with their events); rows,
        when given, spare a read.

        Long polls and waits are told now; Watch streams are fed by a task of their own, off
        the caller's path, from the stored events.
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
            self._wake_fanout()

    def _wake_any(self, count: int) -> None:
        for pool in list(self._leasers):
            if count <= 0:
                return
            count -= self.work_available(pool, count)

    def _wake_fanout(self) -> None:
        self._fanout_ready.set()
        if self._fanout_task is None or self._fanout_task.done():
            self._fanout_task = asyncio.create_task(self._fanout_forever())

    async def _fanout_forever(self) -> None:
        while self._watchers:
            self._fanout_ready.clear()
            try:
                await self._fanout_once()
            except Exception as err:  # streams cannot be fed now: they reconnect with their cursors
                log.warning("watch: cannot read events (%s); ending live watch streams", err)
                for watcher in [w for w in self._watchers if w.live]:
                    watcher.fell_behind(f"watch fell behind: events could not be read ({err}); reconnect")
                    self._watchers.discard(watcher)
            if not self._fanout_ready.is_set():
                if not self._watchers:
                    return
                await self._fanout_ready.wait()

    async def _fanout_once(self) -> None:
        last = await self._store.sequence_events()
        pos = await self.position()
        while pos < last and self._watchers:
            if not any(w.live for w in self._watchers):
                if self._delivered == pos:
                    self._delivered = last  # replaying streams read the store up to here themselves
                return
            events = await self._store.read_events(pos, FANOUT_BATCH)
            if not events:
                return
            self.counts.fold(events)  # read anyway: the sequencer need not read them again
            joined = await self._join(events)
            if self._delivered != pos:
                return  # moved meanwhile (a new term): start again from there
            self._send(joined, events[-1].seq)
            pos = events[-1].seq

    async def _join(self, events: list[EventRow]) -> list[tuple[EventRow, TaskRow]]:
        """Each event with its task's row; events of tasks no longer stored are dropped."""
        rows = {r.seq: r for r in await self._store.get_many(list({e.task_seq for e in events}))}
        return [(e, rows[e.task_seq]) for e in events if e.task_seq in rows]

    def _send(self, joined: list[tuple[EventRow, TaskRow]], last: int) -> None:
        """Offers events to the live streams that have not passed them; no await: atomic."""
        live = [w for w in self._watchers if w.live]
        for ev, row in joined:
            full: tuple[task_pb2.TaskEvent, int] | None = None
            bare: tuple[task_pb2.TaskEvent, int] | None = None
            for watcher in live:
                if ev.seq <= watcher.pos or watcher.ended is not None:
                    continue
                watcher.pos = ev.seq
                if watcher.pools is not None and row.pool not in watcher.pools:
                    continue
                if watcher.include_payloads:
                    full = full or self._event(ev, row, True)
                    event, size = full
                else:
                    bare = bare or self._event(ev, row, False)
                    event, size = bare
                if not watcher.offer(event, size):
                    self._watchers.discard(watcher)
        for watcher in live:
            watcher.pos = max(watcher.pos, last)
        self._delivered = last

    def _event(self, ev: EventRow, row: TaskRow, include_payloads: bool) -> tuple[task_pb2.TaskEvent, int]:
        """The event, its task as its change left it (as_changed)."""
        task = to_task(as_changed(ev, row), self._shard_number)
        if not include_payloads:
            task.ClearField("payload")
            task.ClearField("result")
            task.ClearField("checkpoint")
        event = task_pb2.TaskEvent(
            task=task,
            shard=self._shard_name,
            seq=ev.seq,
            cursor=make_cursor(self._shard_number, ev.seq),
            # RUNNING to RUNNING: only a handler's progress (store.heartbeat) changes nothing else
            progress=ev.prev_state == State.RUNNING and ev.state == State.RUNNING,
            # PENDING to PENDING (or BLOCKED to BLOCKED): only a keyed submission's replace does that
            replaced=ev.prev_state == ev.state and ev.state in (State.PENDING, State.BLOCKED),
        )
        event.time.FromMicroseconds(ev.at)
        return event, event.ByteSize()


def as_changed(ev: EventRow, row: TaskRow) -> TaskRow:
    """The task as the event's change left it: what changes over a task's life as the event
    recorded it, the rest (never changed) from the task's row now. The result only at an event
    that ended the task: that change set it, and nothing changes a task after it."""
    if ev.run_at is None:  # recorded before the store kept these (gone after one watch window)
        return dataclasses.replace(row, state=ev.state, attempt=ev.attempt)
    ended = ev.state in TERMINAL
    return dataclasses.replace(
        row,
        state=ev.state,
        attempt=ev.attempt,
        run_at=ev.run_at,
        worker_id=ev.worker_id,
        error=ev.error or "",
        started_at=ev.started_at,
        finished_at=ev.finished_at,
        lease_expires_at=ev.lease_expires_at,
        cancel_requested=bool(ev.cancel_requested),
        result=row.result if ended else None,
        result_content_type=row.result_content_type if ended else "",
    )


# -- cursors ------------------------------------------------------------------------
#
# "<shard number>:<event seq>": a Watch across shards (issue 9) joins one per shard.


def make_cursor(shard_number: int, seq: int) -> str:
    return f"{shard_number}:{seq}"


def parse_cursor(cursor: str, shard_number: int) -> int:
    """The event seq a cursor of this shard resumes after; INVALID_ARGUMENT naming `cursor` else."""
    shown = cursor if len(cursor) <= 40 else cursor[:40] + "…"
    shard, sep, seq = cursor.partition(":")
    if not (sep and shard.isascii() and shard.isdigit() and seq.isascii() and seq.isdigit() and len(seq) <= 19):
        raise invalid(f"cursor: {shown!r} is not a cursor this server issued (TaskEvent.cursor, e.g. '0:1234')")
    if int(shard) != shard_number:
        raise invalid(f"cursor: {shown!r} was issued by shard number {int(shard)}, not this one ({shard_number})")
    return int(seq)
