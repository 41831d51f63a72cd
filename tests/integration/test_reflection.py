"""gRPC server reflection: a generic client (grpc_reflection's, as grpcurl would) lists the
services and resolves their messages without the .proto files."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cronoq_server.api.reflection import enable_reflection

SERVICES = {
    "cronoq.v1.TaskService",
    "cronoq.v1.WorkerService",
    "cronoq.v1.ScheduleService",
    "cronoq.v1.AdminService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
}


def _check(target: str) -> None:
    """Lists the services of `target` and resolves messages through a pool fed by reflection only."""
    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert services >= SERVICES, f"missing: {sorted(SERVICES - services)}"
        _resolve(DescriptorPool(database))
        # the file of a method, as `grpcurl describe cronoq.v1.TaskService.SubmitTask` asks
        assert database.FindFileContainingSymbol("cronoq.v1.TaskService.SubmitTask").name == (
            "cronoq/v1/task_service.proto"
        )


def _resolve(pool: DescriptorPool) -> None:
    submit = pool.FindServiceByName("cronoq.v1.TaskService").methods_by_name["SubmitTask"]
    assert submit.input_type.full_name == "cronoq.v1.SubmitTaskRequest"
    assert "pool" in submit.input_type.fields_by_name
    lease = pool.FindServiceByName("cronoq.v1.WorkerService").methods_by_name["LeaseTasks"]
    assert lease.output_type.full_name == "cronoq.v1.LeaseTasksResponse"
    check = pool.FindServiceByName("grpc.health.v1.Health").methods_by_name["Check"]
    assert check.input_type.full_name == "grpc.health.v1.HealthCheckRequest"


async def test_enable_reflection_on_a_bare_server() -> None:
    """enable_reflection alone, on a grpc.aio server with nothing else: every service is listed."""
    server = grpc.aio.server()
    enable_reflection(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await asyncio.to_thread(_check, f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


def test_server_answers_reflection(server) -> None:
    """A real cronoq-server (start_grpc calls enable_reflection)."""
    _check(server.grpc_target)
