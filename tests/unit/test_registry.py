"""The method registry: every RPC is declared once, has a handler, and every documented HTTP
route maps to exactly one RPC."""

from __future__ import annotations

from pathlib import Path

import pytest

from cronoq_server.api.http import HttpApi
from cronoq_server.config import parse_config
from cronoq_server.node import Node
from cronoq_server.registry import FILES, registry

# The HTTP API as the README documents it: (method, path) -> RPC.
DOCUMENTED_ROUTES = {
    ("POST", "/v1/tasks"): "SubmitTask",
    ("POST", "/v1/batches"): "SubmitBatch",
    ("GET", "/v1/tasks/{task.id}"): "GetTask",
    ("GET", "/v1/keys/{task.key}"): "GetTask",
    ("GET", "/v1/tasks/{task.id}/wait"): "WaitTask",
    ("GET", "/v1/keys/{task.key}/wait"): "WaitTask",
    ("POST", "/v1/tasks/{task.id}/cancel"): "CancelTask",
    ("POST", "/v1/keys/{task.key}/cancel"): "CancelTask",
    ("GET", "/v1/tasks"): "ListTasks",
    ("GET", "/v1/watch"): "Watch",
    ("GET", "/v1/workers"): "ListWorkers",
    ("GET", "/v1/schedules"): "ListSchedules",
    ("PUT", "/v1/pools/{schedule.pool}/schedules/{schedule.name}"): "PutSchedule",
    ("DELETE", "/v1/pools/{pool}/schedules/{name}"): "DeleteSchedule",
    ("GET", "/v1/snapshot"): "GetSnapshot",
    ("GET", "/v1/info"): "GetServerInfo",
    ("POST", "/v1/tasks/{task.id}/retry"): "RetryTask",
    ("POST", "/v1/keys/{task.key}/retry"): "RetryTask",
    ("DELETE", "/v1/tasks/{task.id}"): "DeleteTask",
    ("DELETE", "/v1/keys/{task.key}"): "DeleteTask",
    ("POST", "/v1/tasks/bulk-cancel"): "CancelTasks",
    ("POST", "/v1/tasks/bulk-retry"): "RetryTasks",
    ("POST", "/v1/tasks/bulk-delete"): "DeleteTasks",
    ("POST", "/v1/pools/{pool}/pause"): "PausePool",
    ("POST", "/v1/pools/{pool}/resume"): "ResumePool",
}


def test_every_rpc_of_every_service_is_in_the_registry_with_a_routing() -> None:
    methods = {m.name for f in FILES for s in f.services_by_name.values() for m in s.methods}
    assert set(registry()) == methods
    for rpc in registry().values():
        assert rpc.routing in ("local", "by_pool", "by_task", "fan_out", "by_worker"), rpc.name


def test_permissions_are_declared_and_only_server_info_needs_none() -> None:
    none = [r.name for r in registry().values() if r.permission is None]
    assert none == ["GetServerInfo"]
    assert [r.name for r in registry().values() if r.standby] == ["GetServerInfo"]
    snapshot = registry()["GetSnapshot"]
    assert (snapshot.permission, snapshot.or_permission) == ("admin", "read")
    assert [r.name for r in registry().values() if r.or_permission] == ["GetSnapshot"]
    assert {registry()[n].permission for n in ("PutSchedule", "DeleteSchedule")} == {"schedule"}


def test_every_documented_route_maps_to_one_rpc_and_no_other_route_exists() -> None:
    declared = {(h.method, h.path): r.name for r in registry().values() for h in r.http}
    assert declared == DOCUMENTED_ROUTES


async def test_every_rpc_has_a_handler_and_every_route_is_served(tmp_path: Path) -> None:
    node = Node(parse_config({"store": {"path": str(tmp_path / "cronoq.db")}}))  # raises if a handler is missing
    for rpc in registry().values():
        assert rpc.server_streaming or rpc.name in node._unary, rpc.name
    served = {(r.method, r.resource.canonical) for r in HttpApi(node).app.router.routes() if r.resource}
    for rpc in registry().values():
        for route in rpc.http:
            assert (route.method, route.aiohttp_path) in served, route


def test_a_method_without_a_declaration_is_refused() -> None:
    from google.protobuf import descriptor_pb2

    from cronoq_server.registry import RegistryError, _rpc

    class Undeclared:  # what a MethodDescriptor offers, with no (cronoq.v1.rule) option
        full_name = "cronoq.v1.TaskService.Undeclared"
        client_streaming = False

        def GetOptions(self) -> descriptor_pb2.MethodOptions:
            return descriptor_pb2.MethodOptions()

    with pytest.raises(RegistryError, match=r"no \(cronoq\.v1\.rule\) option"):
        _rpc(Undeclared())  # type: ignore[arg-type]
