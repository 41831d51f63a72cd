"""The HTTP listener's connection layer, on top of aiohttp's protocol: a request's headers
must arrive within HEADER_TIMEOUT_S, idle kept-alive connections close after
KEEPALIVE_TIMEOUT_S, at most MAX_CONNECTIONS connections are served at once (idle ones are
closed first to make room, then new ones are answered 503), and every refusal of aiohttp's
own HTTP parser is a JSON error body.

aiohttp offers none of these, so this subclasses its RequestHandler and Server and reads some
of their state; the aiohttp version is pinned to the minor release this was written against.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from .listen import ListenError

log = logging.getLogger("cronoq.http")

HEADER_TIMEOUT_S = 10.0  # from connecting (or a request's first byte) to the end of its headers
KEEPALIVE_TIMEOUT_S = 75.0  # an idle kept-alive connection is closed after this
MAX_CONNECTIONS = 10_000  # connections served at once; CRONOQ_HTTP_MAX_CONNECTIONS overrides it at start
MAX_CONNECTIONS_ENV = "CRONOQ_HTTP_MAX_CONNECTIONS"
MAX_HEADERS = 128  # header fields per request (aiohttp's default, named in refusals)
LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (aiohttp's default 128 overflows in bursts)
# On every response, the listener's own included: no browser reads a JSON error as HTML or script.
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff"}


def error_body(code: str, message: str, reason: str | None = None) -> bytes:
    """The API's JSON error body (the reason is the code's name unless given)."""
    return json.dumps({"code": code, "message": message, "reason": reason or code}).encode()


def one_line(value: Any, limit: int = 300) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit] + "..."


def protocol_error(exc: BaseException | None, message: str | None) -> tuple[int, str]:
    """The status and message for a request aiohttp's parser refused."""
    if isinstance(exc, LineTooLong):
        line, limit = exc.args[0], exc.args[1]
        shown = bytes(line[:40]).decode("latin-1")
        if isinstance(line, bytearray):  # the C parser's request-line buffer; header parts are bytes
            return 414, f"request line: the URL is longer than {limit} bytes (starts {shown!r})"
        return 431, f"headers: a header field is longer than {limit} bytes (starts {shown!r})"
    text = one_line(message or exc or "malformed request")
    if isinstance(exc, BadHttpMessage) and "Too many headers" in text:
        return 431, f"headers: more than {MAX_HEADERS} header fields"
    if isinstance(exc, BadHttpMethod):
        return 400, f"request line: not an HTTP/1.x request ({text})"
    return 400, f"http: malformed request ({text})"


class Connection(RequestHandler):
    """aiohttp's protocol, plus: a deadline for each request's headers, JSON bodies for the
    parser's own refusals, and the bookkeeping of the connection cap."""

    __slots__ = ("_guard", "_head_timer", "_heads_seen", "_lost", "_released", "refused")

    def __init__(self, manager: GuardedServer, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._head_timer: asyncio.TimerHandle | None = None
        self._heads_seen = 0
        self._lost: asyncio.Future[None] | None = None
        self._released = False
        self.refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        verdict = self._guard.admit(self)
        super().connection_made(transport)
        if verdict == "drop":
            self._released = True
            self.force_close()
            return
        self.refused = verdict == "refuse"
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._release()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        super().connection_lost(exc)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._guard.release(self)

    def data_received(self, data: bytes) -> None:
        self._guard.touch(self)
        queued = len(self._messages)
        super().data_received(data)
        request = self._current_request
        if request is not None and len(self._messages) > queued and not request.content.is_eof():
            # aiohttp queues a framing error in a body (a bad chunk size) as the next message
            # and leaves the handler reading that body forever: fail the read instead.
            for message, _ in list(self._messages)[queued:]:
                exc = getattr(message, "exc", None)
                if isinstance(exc, BaseException):
                    request.content.set_exception(web.RequestPayloadError(one_line(exc)))
                    break
        if self._request_count != self._heads_seen:  # a request's headers arrived
            self._heads_seen = self._request_count
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        waiting = self._waiter is not None and not self._waiter.done()
        if data and waiting and self._head_timer is None and not self._force_close:
            self._arm_head_timer()  # the first bytes of the next request on a kept-alive connection

    def _arm_head_timer(self) -> None:
        self._head_timer = self._loop.call_later(HEADER_TIMEOUT_S, self._head_timeout, self._request_count)

    def _head_timeout(self, count: int) -> None:
        self._head_timer = None
        if self._request_count != count or self._force_close or self.transport is None:
            return
        body = error_body(
            "DEADLINE_EXCEEDED", f"http: the request's headers did not arrive within {HEADER_TIMEOUT_S:g}s"
        )
        head = (
            "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json; charset=utf-8\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in SECURITY_HEADERS.items())
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.force_close()

    def lost(self) -> asyncio.Future[None]:
        """Done when the client is gone: streaming handlers stop then (aiohttp does not cancel them)."""
        if self._lost is None:
            self._lost = self._loop.create_future()
            if self.transport is None:
                self._lost.set_result(None)
        return self._lost

    def evict(self) -> None:
        """Closes an idle connection to make room (it is counted out at once)."""
        self._release()
        self.force_close()

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """A client's malformed or abandoned body is not a server error: no traceback for it."""
        exc = kw.get("exc_info")
        if isinstance(exc, (web.RequestPayloadError, HttpProcessingError, ConnectionError)):
            log.debug("http: %s", one_line(exc))
            return
        super().log_exception(*args, **kw)

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("the response was sent already; cannot send another with the error")
        if status == 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            code, text = "INTERNAL", "internal error; see the server log"
        elif status == 504:
            code, text = "DEADLINE_EXCEEDED", "the request handler timed out"
        else:
            status, text = protocol_error(exc, message)
            code = "INVALID_ARGUMENT"
            log.debug("refused a malformed request from %s: %s", request.remote, text)
        response = web.Response(
            status=status, body=error_body(code, text), content_type="application/json", headers=SECURITY_HEADERS
        )
        response.force_close()
        return response


class GuardedServer(Server):
    """aiohttp's connection factory with a cap: at the cap the least recently active idle
    connection is closed to make room; when every connection is busy, new ones are answered
    503 (up to a slack beyond the cap) or closed at once."""

    def setup_guard(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.refusal_slack = max(16, max_connections // 100)
        self.admitted = 0
        self.refusing = 0
        self.idle: collections.OrderedDict[Connection, None] = collections.OrderedDict()
        self._logged_at: dict[str, float] = {}

    def __call__(self) -> RequestHandler:
        return Connection(self, loop=self._loop, **self._kwargs)

    def admit(self, conn: Connection) -> str:
        if self.admitted >= self.max_connections and not self._evict_one():
            self._warn()
            if self.refusing >= self.refusal_slack:
                return "drop"
            self.refusing += 1
            conn.refused = True
            return "refuse"
        self.admitted += 1
        self.idle[conn] = None
        return "admit"

    def release(self, conn: Connection) -> None:
        if conn.refused:
            self.refusing -= 1
        else:
            self.admitted -= 1
            self.idle.pop(conn, None)

    def touch(self, conn: Connection) -> None:
        if conn in self.idle:
            self.idle.move_to_end(conn)

    def busy(self, conn: Connection) -> None:
        self.idle.pop(conn, None)

    def rest(self, conn: Connection) -> None:
        if not conn._released and not conn.refused:
            self.idle[conn] = None

    def _evict_one(self) -> bool:
        skipped: list[Connection] = []
        try:
            while self.idle:
                conn, _ = self.idle.popitem(last=False)
                if conn._messages or conn._request_in_progress:
                    skipped.append(conn)  # a request is queued or its response still being written
                    continue
                conn.evict()
                if self._due("evicted"):
                    log.info(
                        "http: at the connection cap (%d, %s); closing the least recently active idle connections",
                        self.max_connections, MAX_CONNECTIONS_ENV,
                    )  # fmt: skip
                return True
            return False
        finally:
            for conn in skipped:
                self.idle[conn] = None

    def _due(self, what: str, every_s: float = 10.0) -> bool:
        """Rate-limits a log line: True at most once per every_s per `what`."""
        now = self._loop.time()
        if now - self._logged_at.get(what, -math.inf) < every_s:
            return False
        self._logged_at[what] = now
        return True

    def _warn(self) -> None:
        if self._due("refused"):
            log.warning(
                "http: %d connections open and busy (cap %d, %s); refusing new ones with 503",
                self.admitted, self.max_connections, MAX_CONNECTIONS_ENV,
            )  # fmt: skip


class GuardedRunner(web.AppRunner):
    def __init__(self, app: web.Application, max_connections: int, **kwargs: Any):
        super().__init__(app, **kwargs)
        self._max_connections = max_connections

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = GuardedServer  # same state, our protocol factory
        assert isinstance(server, GuardedServer)
        server.setup_guard(self._max_connections)
        return server


def max_connections_from_env() -> int:
    text = os.environ.get(MAX_CONNECTIONS_ENV, "")
    if not text:
        return MAX_CONNECTIONS
    if not (text.isascii() and text.isdigit() and 0 < int(text) <= 10_000_000):
        raise ListenError(f"{MAX_CONNECTIONS_ENV}: expected a positive integer, got {text!r}")
    return int(text)


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: SECURITY_HEADERS on every response the application sends."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


REFUSED_BODY = "http: too many connections ({} busy, cap {}); retry shortly"


@web.middleware
async def connection_guard(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Marks the connection busy (not evictable) while a request is served; answers 503 on
    connections over the cap."""
    conn = request.protocol
    if not isinstance(conn, Connection):
        return await handler(request)
    guard = conn._guard
    if conn.refused:
        body = {"code": "UNAVAILABLE", "message": REFUSED_BODY.format(guard.admitted, guard.max_connections)}
        response = web.json_response(body, status=503, headers={"Retry-After": "1"})
        response.force_close()
        return response
    guard.busy(conn)
    try:
        return await handler(request)
    finally:
        guard.rest(conn)
