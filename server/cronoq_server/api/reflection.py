"""gRPC server reflection (grpc.reflection.v1alpha): lets grpcurl and other generic clients
list the services and fetch their descriptors, with no .proto files at hand."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, cast

import grpc
from google.protobuf import descriptor, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

import cronoq.v1


def service_names() -> list[str]:
    """Every service of cronoq.v1 (found in its generated *_pb2 modules), grpc.health.v1.Health
    and the reflection service itself."""
    names: list[str] = []
    for info in sorted(pkgutil.iter_modules(cronoq.v1.__path__), key=lambda m: m.name):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"{cronoq.v1.__name__}.{info.name}")
        names += sorted(service.full_name for service in module.DESCRIPTOR.services_by_name.values())
    names.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    names.append(reflection.SERVICE_NAME)
    return names


class _Pool:
    """The default descriptor pool (where the generated modules registered their files), which
    also finds the file of a method, `pkg.Service.Method`: protobuf's own lookup does not
    (grpc/grpc#34743), and `grpcurl describe pkg.Service.Method` asks for exactly that."""

    def __init__(self, pool: descriptor_pool.DescriptorPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str) -> descriptor.FileDescriptor:
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service, _, method = symbol.rpartition(".")
            try:
                found = self._pool.FindServiceByName(service)
            except KeyError:
                raise KeyError(symbol) from None
            if method not in found.methods_by_name:
                raise KeyError(symbol) from None
            return found.file


def enable_reflection(server: grpc.aio.Server) -> None:
    """Adds the reflection service to `server` (before it starts)."""
    pool = cast(descriptor_pool.DescriptorPool, _Pool(descriptor_pool.Default()))
    reflection.enable_server_reflection(service_names(), server, pool=pool)
