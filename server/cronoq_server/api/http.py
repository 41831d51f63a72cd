"""The HTTP API (aiohttp, same event loop): JSON bodies in the proto3 JSON form with
proto field names, ids as strings, and `payload_json` for JSON payloads (SPEC.md §6)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
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

log = logging.getLogger("cronoq.http")
INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1


def _error_response(err: ApiError) -> web.Response:
    body: dict[str, Any] = {"code": err.code.name, "message": err.message}
    if "cronoq-shard" in err.metadata:
        body["shard"] = err.metadata["cronoq-shard"]
    if "cronoq-shard-endpoint" in err.metadata:
        body["shard_endpoint"] = err.metadata["cronoq-shard-endpoint"]
    return web.json_response(body, status=err.http_status, headers=err.metadata)


def _spec_from_json(body: Any, where: str) -> task_pb.SubmitTaskRequest:
    if not isinstance(body, dict):
        raise invalid(f"{where or 'body'}: expected a JSON object")
    body = dict(body)
    if "payload_json" in body:
        if "payload" in body:
            raise invalid(f"{where}payload_json: give payload or payload_json, not both")
        body["payload"] = base64.b64encode(json.dumps(body.pop("payload_json")).encode()).decode()
        body.setdefault("content_type", JSON_CONTENT_TYPE)
    return _parse(body, task_pb.SubmitTaskRequest(), where)


def _parse(body: Any, message: Message, where: str = "") -> Any:
    try:
        return json_format.ParseDict(body, message)
    except json_format.ParseError as err:
        raise invalid(f"{where}{err}") from None


async def _body(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise invalid(
            f"body: larger than the {request.client_max_size} bytes this server reads "
            f"(content-length {request.content_length}); payloads are capped by limits.max_payload_bytes"
        ) from None
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError as err:
        raise invalid(f"body: not valid JSON ({err})") from None


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
    if int(text) > maximum:
        raise invalid(f"{name}: {text} is more than {maximum}")
    return int(text)


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
    extra = set(body) - {"tasks"}
    if extra:
        raise invalid(f"body: unknown field {sorted(extra)[0]!r}")
    return task_pb.SubmitBatchRequest(tasks=[_spec_from_json(t, f"tasks[{i}].") for i, t in enumerate(body["tasks"])])


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


class HttpApi:
    def __init__(self, node: Node):
        self.node = node
        self.app = web.Application(
            middlewares=[_json_http_errors], client_max_size=max(node.config.limits.max_payload_bytes * 2, 4 << 20)
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
            self.app.router.add_route(verb, path, self._handler(method, build))
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
        try:
            caller = self._caller(request)
            stream = self.node.watch(task_pb.WatchRequest(pool=request.query.get("pool", "")), caller)
        except ApiError as err:
            return _error_response(err)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(b": watching\n\n")
        async for item in stream:
            await response.write(f"data: {json.dumps(to_dict(item)['event'])}\n\n".encode())
        return response

    async def _unimplemented(self, request: web.Request) -> web.Response:
        return _error_response(
            ApiError(
                grpc.StatusCode.UNIMPLEMENTED, f"{request.method} {request.path}: schedules are not implemented yet"
            )
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        await self.node.refresh_gauges()
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.node.is_leader and not self.node.leases.draining:
            return web.json_response({"status": "leader", "shard": self.node.shard_name})
        return web.json_response({"status": "standby", "shard": self.node.shard_name}, status=503)


async def start_http(node: Node, listen: str) -> web.AppRunner:
    api = HttpApi(node)
    runner = web.AppRunner(api.app, access_log=None, handle_signals=False)
    await runner.setup()
    host, _, port = listen.rpartition(":")
    await web.TCPSite(runner, host.strip("[]"), int(port)).start()
    return runner
