"""The gRPC API (grpc.aio): thin servicers over Node.call, plus grpc.health.v1."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from cronoq.v1 import (
    admin_service_pb2_grpc,
    schedule_service_pb2_grpc,
    task_service_pb2_grpc,
    worker_service_pb2_grpc,
)

from ..auth import Principal
from ..errors import ApiError
from ..node import Node
from .listen import ListenError, precheck_bind, probe_bind

log = logging.getLogger("cronoq.grpc")

# Connection management of the gRPC listener (the HTTP listener's is in api/http.py).
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    # Ping a connection quiet for a minute; no answer in 20 s and it is closed: a client that
    # vanished (no FIN) is noticed even while it holds a long poll or a Watch stream.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),  # the server's pings need no data frames in between
    # Clients may ping too, with no call open, as often as every 10 s, without being sent GOAWAY.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    # A connection with no call for 5 minutes gets GOAWAY; clients reconnect on their next call.
    ("grpc.max_connection_idle_ms", 300_000),
]


def _metadata(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value if isinstance(value, str) else value.decode()
    return None


def _cert_subject(context: grpc.aio.ServicerContext) -> str | None:
    auth = context.auth_context()
    names = list(auth.get("x509_subject") or auth.get("x509_common_name") or ())
    return names[0].decode() if names else None


async def _abort(context: grpc.aio.ServicerContext, err: ApiError) -> None:
    await context.abort(err.code, err.message, trailing_metadata=tuple(err.metadata.items()))


class _Servicer:
    def __init__(self, node: Node):
        self._node = node

    def _caller(self, context: grpc.aio.ServicerContext) -> Principal:
        return self._node.authenticate(_metadata(context, "authorization"), _cert_subject(context))

    async def _serve(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await self._node.call(method, request, self._caller(context))
        except ApiError as err:
            await _abort(context, err)
        except Exception:
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")


def _unary(method: str) -> Callable[..., Any]:
    async def handler(self: _Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._serve(method, request, context)

    handler.__name__ = method
    return handler


class TaskServicer(_Servicer, task_service_pb2_grpc.TaskServiceServicer):
    SubmitTask = _unary("SubmitTask")
    SubmitBatch = _unary("SubmitBatch")
    GetTask = _unary("GetTask")
    WaitTask = _unary("WaitTask")
    CancelTask = _unary("CancelTask")
    ListTasks = _unary("ListTasks")

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            stream = self._node.watch(request, self._caller(context))
        except ApiError as err:
            await _abort(context, err)
            return
        try:
            async for item in stream:
                yield item
        except ApiError as err:  # e.g. ABORTED, a watcher too slow to keep up: after events were sent
            await _abort(context, err)
        finally:
            await stream.aclose()  # a cancelled call must not leave the watcher registered


class WorkerServicer(_Servicer, worker_service_pb2_grpc.WorkerServiceServicer):
    RegisterWorker = _unary("RegisterWorker")
    LeaseTasks = _unary("LeaseTasks")
    Heartbeat = _unary("Heartbeat")
    FinishTasks = _unary("FinishTasks")
    DeregisterWorker = _unary("DeregisterWorker")
    ListWorkers = _unary("ListWorkers")


class ScheduleServicer(_Servicer, schedule_service_pb2_grpc.ScheduleServiceServicer):
    """Schedules are declared in the contract; the server implements them in a later release."""

    async def _unimplemented(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._caller(context)  # credentials first, as on every call
        except ApiError as err:
            await _abort(context, err)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "schedules are not implemented yet")

    PutSchedule = DeleteSchedule = ListSchedules = _unimplemented


class AdminServicer(_Servicer, admin_service_pb2_grpc.AdminServiceServicer):
    GetSnapshot = _unary("GetSnapshot")
    GetServerInfo = _unary("GetServerInfo")


def _server_credentials(node: Node) -> grpc.ServerCredentials | None:
    tls = node.config.server.tls
    if tls is None:
        return None
    with open(tls.key, "rb") as k, open(tls.cert, "rb") as c:
        pair = [(k.read(), c.read())]
    if tls.client_ca:
        with open(tls.client_ca, "rb") as ca:
            return grpc.ssl_server_credentials(pair, root_certificates=ca.read(), require_client_auth=False)
    return grpc.ssl_server_credentials(pair)


def server_options(node: Node) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max(node.config.limits.max_payload_bytes * 2, 64 << 20)),
        ("grpc.so_reuseport", 0),
        *KEEPALIVE_OPTIONS,
    ]


async def start_grpc(node: Node, listen: str) -> tuple[grpc.aio.Server, HealthServicer]:
    """Serves the gRPC API on `listen`; raises ListenError (one line) when it cannot bind."""
    server = grpc.aio.server(options=server_options(node))
    task_service_pb2_grpc.add_TaskServiceServicer_to_server(TaskServicer(node), server)
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(node), server)
    schedule_service_pb2_grpc.add_ScheduleServiceServicer_to_server(ScheduleServicer(node), server)
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(node), server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
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
