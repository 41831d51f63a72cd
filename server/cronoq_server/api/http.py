"""The HTTP API (aiohttp, same event loop): JSON bodies in the proto3 JSON form with
proto field names, ids as strings, and `payload_json` for JSON payloads. Its listener's
connection layer (timeouts, the connection cap) is in http_listener."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from google.protobuf import json_format
from google.protobuf.message import Message
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cronoq.jsonform import JSON_CONTENT_TYPE, to_dict
from cronoq.v1 import (
    admin_service_pb2 as admin_pb,
)
from cronoq.v1 import (
    task_pb2,
)
from cronoq.v1 import (
    task_service_pb2 as task_pb,
)
from cronoq.v1 import (
    worker_service_pb2 as worker_pb,
)

from ..auth import Principal
from ..errors import ApiError, invalid
from ..ids import parse_task_id
from ..node import Node
from . import http_listener
from .http_body import check_base64, decode_json
from .http_listener import Connection, GuardedRunner, connection_guard, error_body, one_line
from .listen import ListenError, os_reason, split_listen

log = logging.getLogger("cronoq.http")
INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1

# -- limits of the HTTP listener ---------------------------------------------------
BODY_TIMEOUT_S = 30.0  # for a request's body, once its headers have arrived
WATCH_HEARTBEAT_S = 15.0  # an SSE comment this often keeps proxies from closing a quiet Watch


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
    body: dict[str, Any] = {"code": err.code.name, "message": err.message}
    if "cronoq-shard" in err.metadata:
        body["shard"] = err.metadata["cronoq-shard"]
    if "cronoq-shard-endpoint" in err.metadata:
        body["shard_endpoint"] = err.metadata["cronoq-shard-endpoint"]
    response = web.json_response(body, status=err.http_status, headers=err.metadata)
    if isinstance(err, _HttpError) and err.close:
        response.force_close()
    return response


def _spec_from_json(body: Any, where: str) -> task_pb.SubmitTaskRequest:
    if not isinstance(body, dict):
        raise invalid(f"{where or 'body'}: expected a JSON object")
    body = dict(body)
    if "payload_json" in body:
        if "payload" in body:
            raise invalid(f"{where}payload_json: give payload or payload_json, not both")
        body["payload"] = base64.b64encode(json.dumps(body.pop("payload_json")).encode()).decode()
        body.setdefault("content_type", JSON_CONTENT_TYPE)
    elif "payload" in body:
        check_base64(body["payload"], f"{where}payload")
    return _parse(body, task_pb.SubmitTaskRequest(), where)


def _parse(body: Any, message: Message, where: str = "") -> Any:
    try:
        return json_format.ParseDict(body, message)
    except json_format.ParseError as err:
        raise invalid(f"{where}{err}") from None


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


def _ref(request: web.Request) -> task_pb2.TaskRef:
    if "id" in request.match_info:
        text = request.match_info["id"]
        if not text.isascii():  # str.isdigit() accepts digits such as '١' and '²'
            raise invalid(f"id: task id {text!r} is not a positive unsigned 64-bit decimal integer")
        try:
            return task_pb2.TaskRef(id=parse_task_id(text))
        except ValueError as err:
            raise invalid(f"id: {err}") from None
    return task_pb2.TaskRef(key=request.match_info["key"])


def _query_int(request: web.Request, name: str, maximum: int) -> int:
    text = request.query.get(name, "")
    if not text:
        return 0
    if not (text.isascii() and text.isdigit()):
        raise invalid(f"{name}: {text!r} is not a non-negative integer")
    if len(text) > 20 or int(text) > maximum:
        raise invalid(f"{name}: {text[:40]} is more than {maximum}")
    return int(text)


def _query_bool(request: web.Request, name: str) -> bool:
    text = request.query.get(name, "").lower()
    if text in ("", "false", "0"):
        return False
    if text in ("true", "1"):
        return True
    raise invalid(f"{name}: {request.query[name]!r} is not true or false")


def _state(text: str) -> int:
    if not text:
        return 0
    name = text.upper()
    name = name if name.startswith("TASK_STATE_") else f"TASK_STATE_{name}"
    try:
        return task_pb2.TaskState.Value(name)
    except ValueError:
        raise invalid(f"state: unknown state {text!r}") from None


Builder = Callable[[web.Request], Awaitable[Message]]


async def _submit_task(r: web.Request) -> Message:
    return _spec_from_json(await _body(r), "")


async def _submit_batch(r: web.Request) -> Message:
    body = await _body(r)
    if not isinstance(body, dict) or not isinstance(body.get("tasks"), list):
        raise invalid("tasks: expected a JSON object with a list of tasks")
    extra = set(body) - {"tasks", "request_id"}
    if extra:
        raise invalid(f"body: unknown field {sorted(extra)[0]!r}")
    request_id = body.get("request_id", "")
    if not isinstance(request_id, str):
        raise invalid(f"request_id: expected a string, got {json.dumps(request_id)[:40]}")
    return task_pb.SubmitBatchRequest(
        tasks=[_spec_from_json(t, f"tasks[{i}].") for i, t in enumerate(body["tasks"])], request_id=request_id
    )


async def _get_task(r: web.Request) -> Message:
    return task_pb.GetTaskRequest(task=_ref(r))


async def _wait_task(r: web.Request) -> Message:
    return task_pb.WaitTaskRequest(task=_ref(r), timeout_ms=_query_int(r, "timeout_ms", UINT32_MAX))


async def _cancel_task(r: web.Request) -> Message:
    return task_pb.CancelTaskRequest(task=_ref(r))


async def _list_tasks(r: web.Request) -> Message:
    return task_pb.ListTasksRequest(
        pool=r.query.get("pool", ""),
        state=_state(r.query.get("state", "")),  # type: ignore[arg-type]
        page_size=_query_int(r, "page_size", INT32_MAX),
        page_token=r.query.get("page_token", ""),
    )


async def _list_workers(r: web.Request) -> Message:
    return worker_pb.ListWorkersRequest(pool=r.query.get("pool", ""))


async def _empty_snapshot(r: web.Request) -> Message:
    return admin_pb.GetSnapshotRequest()


async def _empty_info(r: web.Request) -> Message:
    return admin_pb.GetServerInfoRequest()


@web.middleware
async def _json_http_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Unknown routes and methods answer with the same JSON error body as the API."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        err = ApiError(grpc.StatusCode.NOT_FOUND, f"no route {request.method} {request.path}")
        return _error_response(err)
    except web.HTTPMethodNotAllowed as exc:
        body = {
            "code": "UNIMPLEMENTED",
            "message": f"{request.method} is not allowed on {request.path} "
            f"(allowed: {', '.join(sorted(exc.allowed_methods))})",
        }
        return web.json_response(body, status=405, headers={"Allow": ",".join(sorted(exc.allowed_methods))})


# -- the API -----------------------------------------------------------------------


_PAYLOAD_FIELDS = ("payload", "payload_json", "result")


def _sse_error(err: ApiError) -> bytes:
    return b"event: error\ndata: " + error_body(err.code.name, err.message) + b"\n\n"


class HttpApi:
    def __init__(self, node: Node):
        self.node = node
        self.app = web.Application(
            middlewares=[connection_guard, _json_http_errors],
            client_max_size=max(node.config.limits.max_payload_bytes * 2, 4 << 20),
        )
        routes = [
            ("POST", "/v1/tasks", "SubmitTask", _submit_task),
            ("POST", "/v1/batches", "SubmitBatch", _submit_batch),
            ("GET", "/v1/tasks/{id}", "GetTask", _get_task),
            ("GET", "/v1/keys/{key}", "GetTask", _get_task),
            ("GET", "/v1/tasks/{id}/wait", "WaitTask", _wait_task),
            ("GET", "/v1/keys/{key}/wait", "WaitTask", _wait_task),
            ("POST", "/v1/tasks/{id}/cancel", "CancelTask", _cancel_task),
            ("POST", "/v1/keys/{key}/cancel", "CancelTask", _cancel_task),
            ("GET", "/v1/tasks", "ListTasks", _list_tasks),
            ("GET", "/v1/workers", "ListWorkers", _list_workers),
            ("GET", "/v1/snapshot", "GetSnapshot", _empty_snapshot),
            ("GET", "/v1/info", "GetServerInfo", _empty_info),
        ]
        for verb, path, method, build in routes:
            self.app.router.add_route(verb, path, self._handler(method, build), expect_handler=_expect)
        self.app.router.add_get("/v1/watch", self._watch)
        for verb, path in (
            ("GET", "/v1/schedules"),
            ("PUT", "/v1/pools/{pool}/schedules/{name}"),
            ("DELETE", "/v1/pools/{pool}/schedules/{name}"),
        ):
            self.app.router.add_route(verb, path, self._unimplemented)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/readyz", self._readyz)

    def _caller(self, request: web.Request) -> Principal:
        return self.node.authenticate(request.headers.get("Authorization"), None)

    def _handler(self, method: str, build: Builder) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                caller = self._caller(request)
                response = await self.node.call(method, await build(request), caller)
            except ApiError as err:
                return _error_response(err)
            except Exception:
                log.exception("%s %s failed", request.method, request.path)
                return web.json_response(
                    {"code": "INTERNAL", "message": "internal error; see the server log"}, status=500
                )
            return web.json_response(to_dict(response))

        return handle

    async def _watch(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: `data: <TaskEvent JSON>` per event; a stream the server ends with
        an error (a watcher too slow to keep up) ends with `event: error` and a JSON error body."""
        try:
            caller = self._caller(request)
            watch = task_pb.WatchRequest(
                pool=request.query.get("pool", ""), include_payloads=_query_bool(request, "include_payloads")
            )
            stream = self.node.watch(watch, caller)
        except ApiError as err:
            return _error_response(err)
        conn = request.protocol
        lost = conn.lost() if isinstance(conn, Connection) else asyncio.get_running_loop().create_future()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        events = self._events(stream, lost, watch.include_payloads)
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
        ends, fails (a last error event) or the client disconnects."""
        while True:
            step: asyncio.Future[Any] = asyncio.ensure_future(anext(stream))
            waiting: set[asyncio.Future[Any]] = {step, lost}
            try:
                while True:
                    done, _ = await asyncio.wait(
                        waiting, timeout=WATCH_HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED
                    )
                    if step in done:
                        break
                    if lost.done():
                        return
                    yield b": keep-alive\n\n"
            finally:
                if not step.done():
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            except ApiError as err:
                yield _sse_error(err)
                return
            except Exception:
                log.exception("GET /v1/watch failed")
                yield _sse_error(ApiError(grpc.StatusCode.INTERNAL, "internal error; see the server log"))
                return
            event = to_dict(item)["event"]
            if not include_payloads and isinstance(event.get("task"), dict):
                for name in _PAYLOAD_FIELDS:  # not sent: absent, rather than shown empty or null
                    event["task"].pop(name, None)
            yield f"data: {json.dumps(event)}\n\n".encode()

    async def _unimplemented(self, request: web.Request) -> web.Response:
        """Credentials are checked first, as on every route: an unknown caller learns nothing."""
        try:
            self._caller(request)
        except ApiError as err:
            return _error_response(err)
        return _error_response(
            ApiError(
                grpc.StatusCode.UNIMPLEMENTED, f"{request.method} {request.path}: schedules are not implemented yet"
            )
        )

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
        await self.node.refresh_gauges()
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.node.is_leader and not self.node.leases.draining:
            return web.json_response({"status": "leader", "shard": self.node.shard_name})
        return web.json_response({"status": "standby", "shard": self.node.shard_name}, status=503)


async def start_http(node: Node, listen: str) -> web.AppRunner:
    """Serves the HTTP API on `listen`; raises ListenError (one line) when it cannot bind."""
    api = HttpApi(node)
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
        await web.TCPSite(runner, host, port, backlog=http_listener.LISTEN_BACKLOG).start()
    except OSError as err:
        await runner.cleanup()
        raise ListenError(f"server.http_listen: cannot listen on {listen}: {os_reason(err)}") from None
    return runner
