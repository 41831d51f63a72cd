"""The method registry: every RPC of cronoq.v1 with what its `cronoq.v1.rule` option declares
(permission, standby answer, routing between shards, HTTP routes), read from the descriptors.

The gRPC handlers, the HTTP routes, the authorization pre-check, the standby check and the
metrics labels are all built from it: adding an RPC means the proto and one handler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from google.protobuf.descriptor import FileDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from cronoq.v1 import (
    admin_service_pb2,
    options_pb2,
    schedule_service_pb2,
    task_service_pb2,
    worker_service_pb2,
)

FILES: tuple[FileDescriptor, ...] = (
    task_service_pb2.DESCRIPTOR,
    worker_service_pb2.DESCRIPTOR,
    schedule_service_pb2.DESCRIPTOR,
    admin_service_pb2.DESCRIPTOR,
)

PERMISSIONS = {
    options_pb2.PERMISSION_UNSPECIFIED: None,
    options_pb2.PERMISSION_SUBMIT: "submit",
    options_pb2.PERMISSION_READ: "read",
    options_pb2.PERMISSION_CANCEL: "cancel",
    options_pb2.PERMISSION_WORK: "work",
    options_pb2.PERMISSION_SCHEDULE: "schedule",
    options_pb2.PERMISSION_ADMIN: "admin",
}
ROUTINGS = {
    options_pb2.ROUTING_LOCAL: "local",
    options_pb2.ROUTING_BY_POOL: "by_pool",
    options_pb2.ROUTING_BY_TASK: "by_task",
    options_pb2.ROUTING_FAN_OUT: "fan_out",
    options_pb2.ROUTING_BY_WORKER: "by_worker",
}
_VARIABLE = re.compile(r"\{([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)\}")


class RegistryError(Exception):
    """A method whose declaration is missing or inconsistent (a bug in the protos)."""


@dataclass(frozen=True, slots=True)
class HttpRoute:
    method: str
    path: str  # as declared: "/v1/tasks/{task.id}"
    sse: bool
    body: str  # the request field the JSON body fills; "" for the whole request
    variables: tuple[str, ...]  # request field paths named in the path, in order

    @property
    def aiohttp_path(self) -> str:
        """The path with aiohttp-compatible variable names ("task.id" -> "task__id")."""
        return _VARIABLE.sub(lambda m: "{" + m.group(1).replace(".", "__") + "}", self.path)


@dataclass(frozen=True, slots=True)
class Rpc:
    service: str  # "cronoq.v1.TaskService"
    name: str  # "SubmitTask"
    request: type[Message]
    response: type[Message]
    server_streaming: bool
    client_streaming: bool  # a bidirectional stream (gRPC only: no HTTP route)
    permission: str | None  # None: valid credentials are enough
    standby: bool
    routing: str
    http: tuple[HttpRoute, ...]
    or_permission: str | None = None  # enough instead of `permission`

    def admits(self, permissions: frozenset[str]) -> bool:
        """Whether a caller holding these permissions (on some pool) may make the call at all."""
        wanted = (self.permission, self.or_permission)
        return self.permission is None or any(p is not None and p in permissions for p in wanted)

    @property
    def path(self) -> str:
        """The gRPC method path: /cronoq.v1.TaskService/SubmitTask."""
        return f"/{self.service}/{self.name}"


def _http_route(method: MethodDescriptor, route: options_pb2.HttpRoute) -> HttpRoute:
    variables = tuple(_VARIABLE.findall(route.path))
    for var in variables:
        desc: Any = method.input_type
        for part in var.split("."):
            field = desc.fields_by_name.get(part)
            if field is None:
                raise RegistryError(f"{method.full_name}: HTTP path {route.path!r} names no field {var!r}")
            desc = field.message_type
    if route.method not in ("GET", "POST", "PUT", "DELETE"):
        raise RegistryError(f"{method.full_name}: HTTP method {route.method!r}")
    if route.body and route.body not in method.input_type.fields_by_name:
        raise RegistryError(f"{method.full_name}: HTTP body {route.body!r} names no field")
    return HttpRoute(route.method, route.path, route.sse, route.body, variables)


def _rpc(method: MethodDescriptor) -> Rpc:
    options = method.GetOptions()
    if not options.HasExtension(options_pb2.rule):
        raise RegistryError(f"{method.full_name}: no (cronoq.v1.rule) option")
    rule = options.Extensions[options_pb2.rule]
    if rule.routing not in ROUTINGS:
        raise RegistryError(f"{method.full_name}: no routing declared")
    if method.client_streaming and not method.server_streaming:
        raise RegistryError(f"{method.full_name}: client streaming is supported only both ways")
    if method.client_streaming and rule.http:
        raise RegistryError(f"{method.full_name}: a bidirectional stream has no HTTP route")
    return Rpc(
        service=method.containing_service.full_name,
        name=method.name,
        request=GetMessageClass(method.input_type),
        response=GetMessageClass(method.output_type),
        server_streaming=method.server_streaming,
        client_streaming=method.client_streaming,
        permission=PERMISSIONS[rule.permission],
        standby=rule.standby,
        routing=ROUTINGS[rule.routing],
        http=tuple(_http_route(method, r) for r in rule.http),
        or_permission=PERMISSIONS[rule.or_permission],
    )


@cache
def registry() -> dict[str, Rpc]:
    """Every RPC by its name (names are unique across cronoq's services)."""
    rpcs: dict[str, Rpc] = {}
    for file in FILES:
        for service in file.services_by_name.values():
            for method in service.methods:
                if method.name in rpcs:
                    raise RegistryError(f"{method.full_name}: the name is used by {rpcs[method.name].service} too")
                rpcs[method.name] = _rpc(method)
    return rpcs
