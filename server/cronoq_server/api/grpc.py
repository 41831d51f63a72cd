"""The gRPC API (grpc.aio): a handler per RPC of the registry over the shard router, plus grpc.health.v1."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from ..auth import Principal, one_authorization
from ..core.limits import largest_request, request_limits, small_request_limit
from ..errors import ApiError, invalid
from ..node import Node
from ..registry import Rpc, registry
from ..sharding import FORWARDED_HEADER, Call, ShardRouter, unavailable_metadata
from .listen import ListenError, precheck_bind, probe_bind
from .reflection import enable_reflection
from .tls import grpc_cert_subject, grpc_server_credentials
from .wire import MALFORMED, TOO_LARGE, check_unparsed, parse

log = logging.getLogger("cronoq.grpc")

# Connection management of the gRPC listener (the HTTP listener's is in api/http.py).
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    # Ping a connection quiet for a minute; no answer in 20 s and it is closed: a client that
    # vanished (no FIN) is noticed even while it holds a long poll or a Watch stream.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),  # the server's pings need no data frames in between
    # Clients may ping too, with no call open or none sending, as often as every 10 s, without
    # being sent GOAWAY "too_many_pings" (gRPC's default allows one ping in 5 minutes).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # A connection with no call for 5 minutes gets GOAWAY; clients reconnect on their next call.
    ("grpc.max_connection_idle_ms", 300_000),
]


def _metadata(context: grpc.aio.ServicerContext, name: str) -> list[str]:
    """Every value of one metadata key, in the order sent."""
    return [
        value if isinstance(value, str) else value.decode()
        for key, value in context.invocation_metadata() or ()
        if key == name
    ]


def _cert_subject(context: grpc.aio.ServicerContext) -> str | None:
    return grpc_cert_subject(context)


async def _abort(context: grpc.aio.ServicerContext, err: ApiError, also: tuple[tuple[str, str], ...] = ()) -> None:
    await context.abort(err.code, err.message, trailing_metadata=also + err.trailers())


async def _fail(context: grpc.aio.ServicerContext, rpc: Rpc, err: Exception) -> None:
    """Ends a call that failed: with the ApiError's code, or INTERNAL (the rest is logged here,
    never sent: no stack trace reaches the caller)."""
    if isinstance(err, ApiError):
        await _refuse(context, rpc, err)
    log.error("%s failed", rpc.name, exc_info=err)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {rpc.name}; see the server log")


async def _refuse(context: grpc.aio.ServicerContext, rpc: Rpc, err: ApiError) -> None:
    """Ends a call with the ApiError; one log line for a request that does not decode or is over
    its limit, and for a Work stream refused as malformed (no SDK's worker sends any of these)."""
    if err.reason in (MALFORMED, TOO_LARGE) or (rpc.client_streaming and err.code == grpc.StatusCode.INVALID_ARGUMENT):
        log.warning("%s from %s: refused a malformed or oversized request: %s", rpc.name, context.peer(), err.message)
    if err.reason in (MALFORMED, TOO_LARGE) or err.code == grpc.StatusCode.UNAUTHENTICATED:
        _trim.soon()
    await _abort(context, err)


class _Trim:
    """Gives the heap's free memory back to the system after a burst of refused calls (a second
    after the last, at most five after the first): glibc keeps the freed buffers of their
    messages otherwise, and a burst of them would leave the server at its peak for good."""

    QUIET_S = 1.0
    LATEST_S = 5.0

    def __init__(self) -> None:
        self._libc_trim: Callable[[int], int] | None = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
        self._handle: asyncio.TimerHandle | None = None
        self._first = 0.0

    def soon(self) -> None:
        if self._libc_trim is None:
            return
        loop = asyncio.get_running_loop()
        if self._handle is None:
            self._first = loop.time()
        elif loop.time() + self.QUIET_S < self._first + self.LATEST_S:
            self._handle.cancel()
        else:
            return
        self._handle = loop.call_later(self.QUIET_S, self._run)

    def _run(self) -> None:
        self._handle = None
        started = time.monotonic()
        if self._libc_trim is not None:
            self._libc_trim(0)
        log.debug("malloc_trim after refused calls took %.3fs", time.monotonic() - started)


_trim = _Trim()


class _Handlers:
    """The gRPC handler of every RPC in the registry, each a thin call into the shard router.

    Every handler is registered as reading a stream of requests, so that gRPC reads no message
    before the handler asks for it: the caller is authenticated first (a caller without valid
    credentials is refused unread), and each message is checked against its RPC's limit before
    it is parsed (check_unparsed)."""

    def __init__(self, router: ShardRouter):
        self._node = router.node
        self._router = router
        self._limits = request_limits(router.node.config.limits)

    def _parse(self, rpc: Rpc, data: bytes) -> Any:
        check_unparsed(rpc.name, rpc.request, data, self._limits.get(rpc.name) or small_request_limit())
        return parse(rpc.request, data)

    async def _request(self, rpc: Rpc, context: grpc.aio.ServicerContext) -> tuple[Call, Any]:
        """The call, and the request of a call of one message: read with context.read(), not
        the request iterator, whose generator would hold the message's bytes until collected
        (a burst of large batches kept the server 100 MB larger)."""
        call = self._call(context)  # credentials first: a caller without them is refused unread
        return call, await self._read_one(rpc, context)

    async def _read_one(self, rpc: Rpc, context: grpc.aio.ServicerContext) -> Any:
        data = await context.read()
        if data is grpc.aio.EOF:  # type: ignore[attr-defined]  # (grpc-stubs lack it)
            raise invalid(f"{rpc.name}: the call ended before its request message")
        return self._parse(rpc, data)

    async def _each(self, rpc: Rpc, requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for data in requests:
            yield self._parse(rpc, data)

    def _caller(self, context: grpc.aio.ServicerContext) -> Principal:
        return self._node.authenticate(one_authorization(_metadata(context, "authorization")), _cert_subject(context))

    def _call(self, context: grpc.aio.ServicerContext) -> Call:
        """Credentials first: the caller is authenticated before anything is routed."""
        return Call(
            self._caller(context),
            forwarded=bool(_metadata(context, FORWARDED_HEADER)),
            timeout=context.time_remaining(),
            traceparent=next(iter(_metadata(context, "traceparent")), ""),
            tracestate=next(iter(_metadata(context, "tracestate")), ""),
        )

    def unary(self, rpc: Rpc) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Awaitable[Any]]:
        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            try:
                call, request = await self._request(rpc, context)
                response = await self._router.call(rpc.name, request, call)
                missing = unavailable_metadata(response)
                if missing:
                    context.set_trailing_metadata(tuple(missing.items()))
                return response
            except Exception as err:
                await _fail(context, rpc, err)

        return handle

    def stream(self, rpc: Rpc) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], AsyncIterator[Any]]:
        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                call, request = await self._request(rpc, context)
                self._router.admit(rpc.name, call)
                stream = await self._router.watch(request, call)
            except ApiError as err:
                await _refuse(context, rpc, err)
                return
            # A sharded Watch states where it starts and the shards it could not open. Again in the
            # trailers: grpc.aio gives a client empty initial metadata when the call ends before
            # they are read, and a stream that breaks at once must still resume from its start.
            stated = tuple(stream.metadata.items())
            try:
                if stated:
                    await context.send_initial_metadata(stated)
                    context.set_trailing_metadata(stated)
                async for item in stream:
                    yield item
            except ApiError as err:  # e.g. ABORTED, a watcher too slow to keep up: after events were sent
                await _abort(context, err, also=stated)
            finally:
                await stream.aclose()  # a cancelled call must not leave the watcher registered

        return handle

    def bidi(self, rpc: Rpc) -> Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]:
        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                call = self._call(context)  # credentials first, before any message is read
                async for answer in self._router.work(self._each(rpc, requests), call):
                    yield answer
            except Exception as err:
                await _fail(context, rpc, err)

        return handle

    def generic(self) -> list[grpc.GenericRpcHandler]:
        by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for rpc in registry().values():
            # Read as streams of raw bytes (see the class): clients see no difference on the wire.
            if rpc.client_streaming:  # the Work stream, the one bidirectional RPC
                handler = grpc.stream_stream_rpc_method_handler(self.bidi(rpc), None, rpc.response.SerializeToString)
            elif rpc.server_streaming:
                handler = grpc.stream_stream_rpc_method_handler(self.stream(rpc), None, rpc.response.SerializeToString)
            else:
                handler = grpc.stream_unary_rpc_method_handler(self.unary(rpc), None, rpc.response.SerializeToString)
            by_service.setdefault(rpc.service, {})[rpc.name] = handler
        return [grpc.method_handlers_generic_handler(name, methods) for name, methods in by_service.items()]


def _server_credentials(node: Node) -> grpc.ServerCredentials | None:
    return grpc_server_credentials(node.config.server.tls)


def server_options(node: Node) -> list[tuple[str, int]]:
    return [
        # The largest request of any RPC; each RPC's own limit is checked by its handler (check_unparsed).
        ("grpc.max_receive_message_length", largest_request(node.config.limits)),
        ("grpc.so_reuseport", 0),
        *KEEPALIVE_OPTIONS,
    ]


async def start_grpc(
    node: Node, listen: str, router: ShardRouter | None = None
) -> tuple[grpc.aio.Server, HealthServicer]:
    """Serves the gRPC API on `listen` (through `router`, or a router of its own); raises
    ListenError (one line) when it cannot bind."""
    server = grpc.aio.server(options=server_options(node))
    server.add_generic_rpc_handlers(_Handlers(router or ShardRouter(node)).generic())
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server)  # the descriptors, for grpcurl and grpcui; needs no credentials
    creds = _server_credentials(node)
    reason = precheck_bind(listen)
    if reason:
        raise ListenError(f"server.listen: cannot listen on {listen}: {reason}")
    try:
        port = server.add_insecure_port(listen) if creds is None else server.add_secure_port(listen, creds)
    except RuntimeError:  # grpc.aio raises where grpc returns 0
        port = 0
    if port == 0:
        raise ListenError(f"server.listen: cannot listen on {listen}: {probe_bind(listen)}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer
