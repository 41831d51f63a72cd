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

log = logging.getLogger("cronoq.grpc")


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
            async for item in self._node.watch(request, self._caller(context)):
                yield item
        except ApiError as err:
            await _abort(context, err)


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


async def start_grpc(node: Node, listen: str) -> tuple[grpc.aio.Server, HealthServicer]:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max(node.config.limits.max_payload_bytes * 2, 64 << 20)),
            ("grpc.so_reuseport", 0),
        ]
    )
    task_service_pb2_grpc.add_TaskServiceServicer_to_server(TaskServicer(node), server)
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(node), server)
    schedule_service_pb2_grpc.add_ScheduleServiceServicer_to_server(ScheduleServicer(node), server)
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(node), server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    creds = _server_credentials(node)
    if creds is None:
        server.add_insecure_port(listen)
    else:
        server.add_secure_port(listen, creds)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer
