"""The HTTP API (aiohttp, same event loop): JSON bodies in the proto3 JSON form with
proto field names, ids as strings, and `payload_json` for JSON payloads. Its listener's
connection layer (timeouts, the connection cap) is in http_listener."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from google.protobuf.message import Message
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cronoq.jsonform import task_event_to_dict, to_dict

from ..auth import Principal, one_authorization
from ..errors import ApiError
from ..node import Node
from ..registry import HttpRoute, Rpc, registry
from ..sharding import FORWARDED_HEADER, Call, ShardRouter, unavailable_metadata
from ..ui import add_ui_routes
from . import http_listener
from .http_body import decode_json
from .http_listener import Connection, GuardedRunner, add_security_headers, connection_guard, error_body, one_line
from .http_origin import check_browser_request
from .http_request import build_request
from .listen import ListenError, os_reason, split_listen
from .openapi import openapi_json
from .tls import http_cert_subject, http_site

log = logging.getLogger("cronoq.http")

# -- limits of the HTTP listener ---------------------------------------------------
BODY_TIMEOUT_S = 30.0  # for a request's body, once its headers have arrived
WATCH_HEARTBEAT_S = 15.0  # an SSE comment this often keeps proxies from closing a quiet Watch
SSE_BATCH = 256  # events written together at most


class _HttpError(ApiError):
    """A refusal by the HTTP layer itself, with its own status (413, 408) rather than its code's."""

    def __init__(self, status: int, code: grpc.StatusCode, message: str, close: bool = False):
        super().__init__(code, message)
        self.status = status
        self.close = close

    @property
    def http_status(self) -> int:
        return self.status


def _error_response(err: ApiError) -> web.Response:
    body: dict[str, Any] = {"code": err.code.name, "message": err.message, "reason": err.reason}
    if "cronoq-shard" in err.metadata:
        body["shard"] = err.metadata["cronoq-shard"]
    if "cronoq-shard-endpoint" in err.metadata:
        body["shard_endpoint"] = err.metadata["cronoq-shard-endpoint"]
    response = web.json_response(body, status=err.http_status, headers=err.metadata)
    if isinstance(err, _HttpError) and err.close:
        response.force_close()
    return response


def _too_large(request: web.BaseRequest) -> _HttpError:
    return _HttpError(
        413,
        grpc.StatusCode.INVALID_ARGUMENT,
        f"body: larger than the {request.client_max_size} bytes this server reads "
        f"(content-length {request.content_length}); payloads are capped by limits.max_payload_bytes",
        close=True,
    )


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: a body declared too large is refused before the client sends it."""
    if request.content_length is not None and request.content_length > request.client_max_size:
        return _error_response(_too_large(request))
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        message = f"Expect: {expect!r} is not supported (only 100-continue)"
        response = web.Response(
            status=417, body=error_body("INVALID_ARGUMENT", message), content_type="application/json"
        )
        response.force_close()
        return response
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started
    return None


async def _body(request: web.Request) -> Any:
    if request.content_length is not None and request.content_length > request.client_max_size:
        raise _too_large(request)
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(request) from None
    except TimeoutError:
        # Ends aiohttp's lingering read of the rest: the connection closes after the 408.
        request.content.set_exception(web.RequestPayloadError("body timeout"))
        raise _HttpError(
            408,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"body: not received within {BODY_TIMEOUT_S:g}s (content-length {request.content_length})",
            close=True,
        ) from None
    except (web.RequestPayloadError, HttpProcessingError) as err:
        raise _HttpError(
            400, grpc.StatusCode.INVALID_ARGUMENT, f"body: malformed ({one_line(err)})", close=True
        ) from None
    except ConnectionError:
        raise _HttpError(
            400, grpc.StatusCode.INVALID_ARGUMENT, "body: the connection closed before the body arrived", close=True
        ) from None
    if not raw:
        return {}
    return decode_json(raw)


@web.middleware
async def _json_http_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Unknown routes and methods, and refusals before the handler, answer with the same JSON
    error body as the API."""
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(err)
    except web.HTTPNotFound:
        return _error_response(ApiError(grpc.StatusCode.NOT_FOUND, f"no route {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed as exc:
        body = {
            "code": "UNIMPLEMENTED",
            "message": f"{request.method} is not allowed on {request.path} "
            f"(allowed: {', '.join(sorted(exc.allowed_methods))})",
        }
        return web.json_response(body, status=405, headers={"Allow": ",".join(sorted(exc.allowed_methods))})


# -- the API -----------------------------------------------------------------------


def _sse_error(err: ApiError) -> bytes:
    return b"event: error\ndata: " + error_body(err.code.name, err.message, err.reason) + b"\n\n"


@dataclass(frozen=True, slots=True)
class _Chunk:
    data: bytes
    final: bool  # the stream ended (data may hold its error event)


def _sse_chunk(step: asyncio.Future[Any], include_payloads: bool) -> _Chunk:
    """One finished step of a Watch stream as SSE: `id: <cursor>` and `data: <TaskEvent JSON>`
    (payloads and results only when asked for: absent, rather than shown empty or null), or
    the end of the stream."""
    try:
        item = step.result()
    except StopAsyncIteration:
        return _Chunk(b"", True)
    except ApiError as err:
        return _Chunk(_sse_error(err), True)
    except Exception:
        log.exception("GET /v1/watch failed")
        return _Chunk(_sse_error(ApiError(grpc.StatusCode.INTERNAL, "internal error; see the server log")), True)
    event = task_event_to_dict(item.event, include_payloads)
    cursor = event.get("cursor")  # digits, colons and commas: safe on an SSE line
    head = f"id: {cursor}\n" if cursor else ""
    return _Chunk(f"{head}data: {json.dumps(event)}\n\n".encode(), False)


class HttpApi:
    def __init__(self, node: Node, router: ShardRouter | None = None):
        self.node = node
        self.router = router or ShardRouter(node)
        self.app = web.Application(
            middlewares=[connection_guard, _json_http_errors, self._browser_guard],
            client_max_size=max(node.config.limits.max_payload_bytes * 2, 4 << 20),
        )
        self.app.on_response_prepare.append(add_security_headers)
        self._listen_host = split_listen(node.config.server.http_listen)[0]
        self._any_host = node.auth.enabled or node.config.server.tls is not None  # see http_origin
        for rpc in registry().values():
            for route in rpc.http:
                handle = self._sse(rpc, route) if route.sse else self._handler(rpc, route)
                self.app.router.add_route(route.method, route.aiohttp_path, handle, expect_handler=_expect)
        self.app.router.add_get("/v1/openapi.json", self._openapi)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/readyz", self._readyz)
        add_ui_routes(self.app)  # the dashboard's static files

    @web.middleware
    async def _browser_guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Another site's page, through its visitor's browser, changes nothing (see http_origin)."""
        check_browser_request(request, self._any_host, self._listen_host)
        return await handler(request)

    def _caller(self, request: web.Request) -> Principal:
        authorization = one_authorization(request.headers.getall("Authorization", ()))
        return self.node.authenticate(authorization, http_cert_subject(request))

    def _call(self, request: web.Request) -> Call:
        """Credentials first: the caller is authenticated before anything is routed. An HTTP
        call has no deadline to pass on; a forwarded one is answered for this shard only."""
        return Call(
            self._caller(request),
            forwarded=request.headers.get(FORWARDED_HEADER) is not None,
            traceparent=request.headers.get("traceparent", ""),
            tracestate=request.headers.get("tracestate", ""),
        )

    def _handler(self, rpc: Rpc, route: HttpRoute) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                call = self._call(request)  # credentials first, then the permission, then the body
                self.router.admit(rpc.name, call)
                body = await _body(request) if route.method in ("POST", "PUT") else None
                message = build_request(rpc, route, request.match_info, request.query, body)
                response = await self.router.call(rpc.name, message, call)
            except ApiError as err:
                return _error_response(err)
            except Exception:
                log.exception("%s %s failed", request.method, request.path)
                return web.json_response(
                    {"code": "INTERNAL", "message": "internal error; see the server log"}, status=500
                )
            return web.json_response(to_dict(response), headers=unavailable_metadata(response))

        return handle

    def _sse(self, rpc: Rpc, route: HttpRoute) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._watch(rpc, route, request)

        return handle

    async def _watch(self, rpc: Rpc, route: HttpRoute, request: web.Request) -> web.StreamResponse:
        """Server-sent events: `id: <cursor>` and `data: <TaskEvent JSON>` per event; a stream the
        server ends with an error (a watcher too slow to keep up) ends with `event: error` and a
        JSON error body. `Last-Event-ID` (an EventSource reconnecting) resumes like `?cursor=`,
        and wins over it: the query is the one the stream was first opened with."""
        try:
            call = self._call(request)
            self.router.admit(rpc.name, call)
            watch = build_request(rpc, route, request.match_info, request.query, None)
            last_event_id = request.headers.get("Last-Event-ID", "").strip()
            if last_event_id:
                watch.cursor = last_event_id  # type: ignore[attr-defined]
            stream = await self.router.watch(watch, call)
        except ApiError as err:
            return _error_response(err)
        conn = request.protocol
        lost = conn.lost() if isinstance(conn, Connection) else asyncio.get_running_loop().create_future()
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **stream.metadata}
        response = web.StreamResponse(headers=headers)
        events = self._events(stream, lost, watch.include_payloads)  # type: ignore[attr-defined]
        try:
            await response.prepare(request)
            await response.write(b": watching\n\n")
            async for chunk in events:
                await response.write(chunk)
        except ConnectionError:
            pass  # the client went away
        finally:
            await events.aclose()  # first: it may be waiting on the stream
            await stream.aclose()
            if not isinstance(conn, Connection):
                lost.cancel()
        return response

    async def _events(
        self, stream: AsyncIterator[Message], lost: asyncio.Future[None], include_payloads: bool
    ) -> AsyncGenerator[bytes, None]:
        """The stream's events as SSE chunks, a comment every WATCH_HEARTBEAT_S, until the stream
        ends, fails (a last error event) or the client disconnects. The events that are ready
        together go out in one write (a busy stream would otherwise cost a write per event)."""
        step: asyncio.Future[Any] | None = None
        try:
            while True:
                step = step or asyncio.ensure_future(anext(stream))
                waiting: set[asyncio.Future[Any]] = {step, lost}
                while not step.done():
                    await asyncio.wait(waiting, timeout=WATCH_HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED)
                    if lost.done():
                        return
                    if not step.done():
                        yield b": keep-alive\n\n"
                chunks: list[bytes] = []
                while step is not None and step.done() and len(chunks) < SSE_BATCH:
                    done, step = step, None
                    last = _sse_chunk(done, include_payloads)
                    chunks.append(last.data)
                    if last.final:
                        yield b"".join(chunks)
                        return
                    step = asyncio.ensure_future(anext(stream))
                    await asyncio.sleep(0)  # the next event, if it is ready
                yield b"".join(chunks)
        finally:
            if step is not None and not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)

    async def _metrics(self, request: web.Request) -> web.Response:
        """Open without credentials configured or with server.metrics_public; else needs `admin` on any pool."""
        if self.node.auth.enabled and not self.node.config.server.metrics_public:
            try:
                caller = self._caller(request)
            except ApiError as err:
                response = _error_response(err)
                response.headers["WWW-Authenticate"] = 'Bearer realm="cronoq"'
                return response
            if "admin" not in caller.permissions:
                return _error_response(
                    ApiError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"/metrics: {caller.name!r} lacks permission 'admin' (on any pool); "
                        "or set server.metrics_public = true",
                    )
                )
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _openapi(self, request: web.Request) -> web.Response:
        """The API's description, open to anyone: it is the same for every server of a version."""
        return web.Response(body=openapi_json(), content_type="application/json")

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.node.is_leader and not self.node.leases.draining:
            return web.json_response({"status": "leader", "shard": self.node.shard_name})
        return web.json_response({"status": "standby", "shard": self.node.shard_name}, status=503)


async def start_http(node: Node, listen: str, router: ShardRouter | None = None) -> web.AppRunner:
    """Serves the HTTP API on `listen` (through `router`, or a router of its own); raises
    ListenError (one line) when it cannot bind."""
    api = HttpApi(node, router)
    runner = GuardedRunner(
        api.app,
        http_listener.max_connections_from_env(),
        access_log=None,
        handle_signals=False,
        keepalive_timeout=http_listener.KEEPALIVE_TIMEOUT_S,
        max_headers=http_listener.MAX_HEADERS,
    )
    await runner.setup()
    host, port = split_listen(listen)
    try:
        await http_site(runner, host, port, http_listener.LISTEN_BACKLOG, node.config.server.tls).start()
    except OSError as err:
        await runner.cleanup()
        raise ListenError(f"server.http_listen: cannot listen on {listen}: {os_reason(err)}") from None
    return runner
