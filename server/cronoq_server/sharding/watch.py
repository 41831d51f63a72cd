"""The Watch of a sharded deployment (ShardRouter.watch): every shard's events in one stream,
with a composite cursor.

What is watched. Without WatchRequest.pool: this server's shard, from its Node, and every
other shard that has a pool the caller may read, each by a server-streaming Watch at that
shard's endpoint with the caller's own token and `cronoq-forwarded: 1` (that shard then
streams its own events only, and never asks another). With a pool: that pool's shard alone,
here or there. A Watch that arrives marked cronoq-forwarded streams this shard's events only,
with this shard's plain cursors; another shard's pool is refused (FAILED_PRECONDITION naming
the shard, WRONG_SHARD). Peers are asked under the rules of unary forwarding
(PeerChannels.refusal): a caller authenticated by client certificate has no token to forward,
so its Watch streams this shard only; another shard's pool is then refused (NOT_FORWARDED).

Composite cursor. Each event of a merged stream carries "<shard number>:<seq>" for every
shard the stream knows a position of, in shard-number order, e.g. "1:120,2:45": the event's
own shard at that event, every other shard at the last event of it this stream delivered, or
where its stream started when it delivered none yet. A shard's stream starts where the
client's cursor left it, or, live, at the shard's last event when it opened (a peer says where
in its initial metadata, `cronoq-watch-cursor`). A part this stream does not watch (another
pool's shard) is carried along unchanged. So reconnecting with the last cursor seen, to any
server, resumes every shard after exactly what was delivered of it. A shard with no part in the
cursor is watched live from when the stream opens: that is a single-shard cursor's other
shards, and a shard that could not be reached when the stream opened (it had no position,
so none is lost); one that had a part keeps it, unchanged, until its events flow again.
This server's shard is always watched (its drain or step-down ends the merged stream), but
has no part for a caller who may read none of its pools.

Shards missing at the start. A merged stream opens with every shard it can reach; the others
are named in its initial metadata (`cronoq-unavailable-shards`, comma-separated; HTTP: the
response header of the same name). A shard that could not be reached is asked again every
PEER_RETRY_S, and joins the open stream when it answers (from its part of the cursor, or live);
one refused by the rules above is not asked again. `cronoq-watch-cursor` in the same metadata
is the cursor of the stream's start: resuming from it loses nothing of the shards it names.

The end. A merged stream ends when any of its shards' streams ends, the way it ended: cleanly
(a server draining), or with its error after the events received before it (ABORTED when
that shard's watcher fell behind; UNAVAILABLE naming a shard that can no longer be reached;
OUT_OF_RANGE for a part of the cursor that shard no longer keeps). The client reconnects with
its last cursor. Closing the stream (the caller went away) cancels every shard's stream.

Flow. Shards' streams are read into one queue of MERGE_BUFFER events; when the caller reads
slower than the shards write, the queue fills and they are no longer read, so each shard's own
bounded buffer (events.WATCH_MAX_EVENTS, WATCH_MAX_BYTES) fills, and ends its stream with
ABORTED, rather than this server holding an ever longer backlog.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from cronoq.v1 import task_service_pb2 as pb

from ..auth import Principal
from ..config import ShardConfig
from ..core.events import make_cursor, parse_cursor
from ..errors import ApiError, invalid
from ..metrics import FORWARDED, WATCH_STREAMS
from ..node import Node
from ..registry import Rpc
from .call import Call, may_read
from .peers import (
    FORWARDED_HEADER,
    UNAVAILABLE_HEADER,
    PeerChannels,
    forward_metadata,
    peer_error,
    shard_refusal,
    trailer,
    unreachable,
)

log = logging.getLogger("cronoq.watch")

CURSOR_HEADER = "cronoq-watch-cursor"  # initial metadata: the cursor of where the stream starts
# Events held between the shards' streams and the caller; past it, the shards are not read.
MERGE_BUFFER = 32
# A shard that has not started its stream within this long (or server.forward_timeout, when
# shorter) is unavailable (then asked again).
PEER_OPEN_S = 5.0
# How often a shard that could not be reached is asked again, to join an open merged stream.
PEER_RETRY_S = 2.0

_PART = re.compile(r"([0-9]{1,3}):([0-9]{1,19})")


# -- composite cursors --------------------------------------------------------------------


def format_positions(positions: Mapping[int, int]) -> str:
    """The composite cursor: "<shard number>:<seq>" per shard, in shard-number order."""
    return ",".join(make_cursor(number, seq) for number, seq in sorted(positions.items()))


def parse_positions(cursor: str, numbers: Iterable[int]) -> dict[int, int]:
    """The seq each shard resumes after, by shard number; INVALID_ARGUMENT naming `cursor` for
    anything else than a cursor of these shards (each named at most once)."""
    known = sorted(set(numbers))
    shown = cursor if len(cursor) <= 80 else cursor[:80] + "…"
    positions: dict[int, int] = {}
    for part in cursor.split(",", len(known)):  # more parts than shards: the last fails below
        match = _PART.fullmatch(part)
        if match is None:
            raise invalid(
                f"cursor: {shown!r} is not a cursor this server issued (TaskEvent.cursor: '<shard number>:<seq>' "
                "for each shard, joined by commas, e.g. '1:1234,2:56')"
            )
        number, seq = int(match[1]), int(match[2])
        if number not in known:
            raise invalid(
                f"cursor: {shown!r} names shard number {number}, which no shard has "
                f"(shard numbers: {', '.join(map(str, known))})"
            )
        if number in positions:
            raise invalid(f"cursor: {shown!r} names shard number {number} twice")
        positions[number] = seq
    return positions


# -- streams --------------------------------------------------------------------------------


class WatchStream:
    """What ShardRouter.watch gives the API layers: WatchResponses, and the metadata to send
    before them (gRPC initial metadata, HTTP response headers). Close it when done."""

    kind = "shard"

    def __init__(self, metadata: Mapping[str, str]):
        self.metadata = dict(metadata)
        self._closed = False
        WATCH_STREAMS.labels(kind=self.kind).inc()

    def __aiter__(self) -> WatchStream:
        return self

    async def __anext__(self) -> Message:
        raise NotImplementedError

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            WATCH_STREAMS.labels(kind=self.kind).dec()
            await self._close()

    async def _close(self) -> None:
        raise NotImplementedError


class ShardWatch(WatchStream):
    """One shard's events as its Node streams them (unsharded, or a Watch marked cronoq-forwarded)."""

    def __init__(self, events: AsyncIterator[Message], metadata: Mapping[str, str] | None = None):
        super().__init__(metadata or {})
        self._events = events

    async def __anext__(self) -> Message:
        return await anext(self._events)

    async def _close(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()


async def shard_watch(node: Node, request: pb.WatchRequest, caller: Principal) -> ShardWatch:
    """This shard's events from its Node, stating where the stream starts (a stream that breaks
    before its first event resumes there, not live again: nothing in between is lost)."""
    start, events = await node.open_watch(request, caller)
    return ShardWatch(events, {CURSOR_HEADER: make_cursor(node.shard_number, start)})


@dataclass(eq=False)
class Source:
    """One shard's open stream, in a merged one."""

    shard: ShardConfig
    start: int | None  # the seq it streams after (None: not said)
    events: AsyncIterator[Message]
    cancel: Callable[[], Any] = lambda: None  # stops it at once (a peer's call)
    peer: bool = False
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.peer:
            WATCH_STREAMS.labels(kind="peer").inc()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.peer:
            WATCH_STREAMS.labels(kind="peer").dec()
        self.cancel()
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            await aclose()


@dataclass(frozen=True)
class _Joined:
    number: int
    start: int | None


@dataclass(frozen=True)
class _Ended:
    shard: ShardConfig
    error: ApiError | None


Join = Callable[[], Awaitable[Source]]


class MergedWatch(WatchStream):
    """Shards' streams as one (see the module's text): each event's cursor is rewritten to the
    composite one; it ends with the first shard stream that ends."""

    kind = "merged"

    def __init__(
        self,
        sources: list[Source],
        resumed: Mapping[int, int],
        metadata: Mapping[str, str],
        joins: Iterable[tuple[ShardConfig, Join]] = (),
    ):
        super().__init__(metadata)
        self._positions = dict(resumed)
        for source in sources:
            if source.start is not None:
                self._positions[source.shard.number] = source.start
        self._sources = list(sources)
        self._queue: asyncio.Queue[tuple[int, Message] | _Joined | _Ended] = asyncio.Queue(MERGE_BUFFER)
        self._ended = False
        self._tasks = [asyncio.create_task(self._pump(s)) for s in sources]
        self._tasks += [asyncio.create_task(self._join(shard, join)) for shard, join in joins]

    async def __anext__(self) -> Message:
        while not self._ended:
            item = await self._queue.get()
            if isinstance(item, _Joined):
                if item.start is not None:
                    self._positions[item.number] = item.start
                continue
            if isinstance(item, _Ended):
                self._ended = True
                log.debug("merged watch: shard %s's stream ended (%s)", item.shard.name, item.error or "cleanly")
                await self.aclose()
                if item.error is not None:
                    raise item.error
                break
            number, response = item
            event = response.event  # type: ignore[attr-defined]
            if event.seq:
                self._positions[number] = event.seq
            event.cursor = format_positions(self._positions)
            return response
        raise StopAsyncIteration

    async def _pump(self, source: Source) -> None:
        """Moves one shard's events to the queue (waiting while it is full), then its end."""
        error: ApiError | None = None
        try:
            async for response in source.events:
                await self._queue.put((source.shard.number, response))
        except ApiError as err:
            error = err
        except Exception:
            log.exception("watch: shard %s's stream failed", source.shard.name)
            error = ApiError(grpc.StatusCode.INTERNAL, "internal error in Watch; see the server log")
        await self._queue.put(_Ended(source.shard, error))

    async def _join(self, shard: ShardConfig, join: Join) -> None:
        """A shard missing at the start: its stream once it opens, from the position it states."""
        try:
            source = await join()
        except ApiError as err:  # e.g. OUT_OF_RANGE: its part of the cursor is no longer kept
            await self._queue.put(_Ended(shard, err))
            return
        except Exception:
            log.exception("watch: shard %s could not join a merged stream", shard.name)
            await self._queue.put(_Ended(shard, ApiError(grpc.StatusCode.INTERNAL, "internal error in Watch")))
            return
        self._sources.append(source)  # no await since it opened: closed with the others
        log.info("watch: shard %s joined a merged stream", shard.name)
        await self._queue.put(_Joined(shard.number, source.start))
        await self._pump(source)

    async def _close(self) -> None:
        for source in self._sources:
            source.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(s.close() for s in self._sources), return_exceptions=True)


# -- opening ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Missing:
    """A shard whose stream did not open: refused by the forwarding rules, or unreachable."""

    shard: ShardConfig
    error: ApiError
    retry: bool  # unreachable (asked again); False: refused


async def open_watch(node: Node, peers: PeerChannels, rpc: Rpc, request: pb.WatchRequest, call: Call) -> WatchStream:
    """ShardRouter.watch in a sharded deployment: checks the request, opens every shard's
    stream it concerns (in parallel), and returns them merged; raises the first shard's
    refusal (a cursor it cannot resume from) before any event."""
    shards = {s.number: s for s in node.config.shards}
    here = shards[node.shard_number]
    caller = call.caller
    owner: ShardConfig | None = None
    if request.pool:
        caller.require("read", request.pool)  # credentials first: then where the pool is served
        owner = next((s for s in shards.values() if request.pool in s.pools), None)
    resumed = parse_positions(request.cursor, shards) if request.cursor else {}
    opener = _Opener(node, peers, rpc, request, call, resumed)
    if call.forwarded:
        if owner is not None and owner is not here:
            why = f"this call is marked {FORWARDED_HEADER} and is answered by shard {here.name!r} only"
            raise shard_refusal(owner, why, "WRONG_SHARD")
        if resumed and here.number not in resumed:
            shown = request.cursor if len(request.cursor) <= 80 else request.cursor[:80] + "…"
            raise invalid(
                f"cursor: {shown!r} has no part for shard number {here.number} ({here.name!r}), "
                f"which alone answers a call marked {FORWARDED_HEADER}"
            )
        return await shard_watch(node, opener.shard_request(here), caller)

    if owner is not None and owner is not here:  # another shard's pool: that shard, or an error
        opened = await opener.peer(owner)
        if isinstance(opened, _Missing):
            raise opened.error
        return MergedWatch([opened], resumed, _metadata(resumed, [opened], []))

    targets = [here]  # its stream ends the merged one when this server drains or steps down
    if not request.pool:  # with a pool, this shard's (or one no shard has: the Node names it)
        targets += [s for _, s in sorted(shards.items()) if s is not here and may_read(caller, s)]
    results = await opener.all(targets)
    sources = [r for r in results if isinstance(r, Source)]
    missing = [r for r in results if isinstance(r, _Missing)]
    for m in missing:
        log.info("watch: shard %s left out of a merged stream: %s", m.shard.name, m.error.message)
    joins = [(m.shard, opener.rejoin(m.shard)) for m in missing if m.retry]
    return MergedWatch(sources, resumed, _metadata(resumed, sources, missing), joins)


def _metadata(resumed: Mapping[int, int], sources: list[Source], missing: list[_Missing]) -> dict[str, str]:
    start = dict(resumed)
    start.update({s.shard.number: s.start for s in sources if s.start is not None})
    metadata = {CURSOR_HEADER: format_positions(start)} if start else {}
    if missing:
        metadata[UNAVAILABLE_HEADER] = ",".join(m.shard.name for m in missing)
    return metadata


class _Opener:
    """Opens one Watch's stream of a shard: here (the Node) or at a peer."""

    def __init__(
        self, node: Node, peers: PeerChannels, rpc: Rpc, request: pb.WatchRequest, call: Call, resumed: dict[int, int]
    ):
        self._node, self._peers, self._rpc = node, peers, rpc
        self._request, self._caller, self._resumed = request, call.caller, resumed
        self._metadata = forward_metadata(call.caller)
        loop = asyncio.get_running_loop()
        self._deadline = None if call.timeout is None else loop.time() + call.timeout

    def shard_request(self, shard: ShardConfig) -> pb.WatchRequest:
        seq = self._resumed.get(shard.number)
        return pb.WatchRequest(
            pool=self._request.pool,
            include_payloads=self._request.include_payloads,
            cursor="" if seq is None else make_cursor(shard.number, seq),
        )

    def _remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - asyncio.get_running_loop().time(), 0.0)

    async def local(self, shard: ShardConfig) -> Source:
        """This shard's stream (always part of a merged one: it ends it when this server drains
        or steps down); its position is kept out of cursors for a caller who reads none of it."""
        start, events = await self._node.open_watch(self.shard_request(shard), self._caller)
        return Source(shard, start if may_read(self._caller, shard) else None, events)

    async def all(self, targets: list[ShardConfig]) -> list[Source | _Missing]:
        """Every target's stream, opened in parallel; the first refusal (in target order, of those
        settled) is raised, and then whatever opened is closed."""
        here = self._node.shard_number
        tasks = [asyncio.ensure_future(self.local(s) if s.number == here else self.peer(s)) for s in targets]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return [task.result() for task in tasks]
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks:
                opened = None if task.cancelled() or task.exception() is not None else task.result()
                if isinstance(opened, Source):
                    await opened.close()
            raise

    def rejoin(self, shard: ShardConfig) -> Join:
        async def join() -> Source:
            while True:
                await asyncio.sleep(PEER_RETRY_S)
                opened = await self.peer(shard)
                if isinstance(opened, Source):
                    return opened

        return join

    async def peer(self, shard: ShardConfig) -> Source | _Missing:
        """The shard's stream at its endpoint (once more at the leader a standby names); a shard
        that cannot be reached or is refused by the forwarding rules is missing, any other
        refusal of it (its part of the cursor) is raised."""
        reason = self._peers.refusal(shard.endpoint, self._caller)
        if reason:
            return _Missing(shard, shard_refusal(shard, reason, "NOT_FORWARDED"), retry=False)
        request = self.shard_request(shard)
        endpoint = shard.endpoint
        for redirected in (False, True):
            remaining = self._remaining()
            opening = min(PEER_OPEN_S, self._peers.timeout(self._rpc, request, remaining))
            call = self._peers.stream(endpoint, self._rpc, request, self._metadata, remaining)
            try:
                opened = await asyncio.wait_for(call.initial_metadata(), opening)
                stated = trailer(opened, CURSOR_HEADER)
                if stated is None and call.done():
                    await call.read()  # it ended before it started: raises its error, if any
                    return _Missing(shard, unreachable(shard, endpoint, "its stream ended at once"), True)
            except TimeoutError:
                call.cancel()
                FORWARDED.labels(shard=shard.name, code="DEADLINE_EXCEEDED").inc()
                return _Missing(shard, unreachable(shard, endpoint, f"no stream within {opening:g}s"), True)
            except grpc.aio.AioRpcError as err:
                leader = self._peers.leader_to_follow(err, endpoint, self._caller)
                if leader and not redirected:
                    endpoint = leader
                    continue
                FORWARDED.labels(shard=shard.name, code=err.code().name).inc()
                error = peer_error(shard, endpoint, err)
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    return _Missing(shard, error, retry=True)
                raise error from None
            except BaseException:
                call.cancel()
                raise
            FORWARDED.labels(shard=shard.name, code="OK").inc()
            start = _stated_start(stated, shard)
            return Source(shard, start, _peer_events(shard, endpoint, call), call.cancel, peer=True)
        raise AssertionError("unreachable")


def _stated_start(stated: str | None, shard: ShardConfig) -> int | None:
    """Where a peer's stream starts, from its initial metadata (None: it did not say)."""
    if stated is None:
        return None
    try:
        return parse_cursor(stated, shard.number)
    except ApiError:
        log.warning("watch: shard %s stated its stream's start as %r; not a cursor of it", shard.name, stated)
        return None


async def _peer_events(
    shard: ShardConfig, endpoint: str, call: grpc.aio.UnaryStreamCall[Any, Any]
) -> AsyncIterator[Message]:
    """A peer's stream, its failure as this server's error (UNAVAILABLE naming an unreachable shard)."""
    try:
        async for response in call:
            yield response
    except grpc.aio.AioRpcError as err:
        raise peer_error(shard, endpoint, err) from None
