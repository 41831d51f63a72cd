"""cronoq Python SDK: an async Client (with SyncClient), a Worker, and one error tree.

`cronoq` is shared by two distributions: this one (the SDK) and `cronoq-api`
(proto/python: the generated `cronoq.v1` and `cronoq.jsonform`), which the server
uses without the SDK. `__path__` takes in every `cronoq` directory on sys.path, so
`cronoq.v1` is found wherever cronoq-api is installed; and the public names are
imported on first use, so `import cronoq.v1.task_pb2` loads neither the client nor the
worker.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from typing import TYPE_CHECKING, Any

__path__ = pkgutil.extend_path(__path__, __name__)

__version__ = importlib.metadata.version("cronoq-sdk")  # the installed distribution's (VERSION at release)

# public name -> the submodule that defines it
_EXPORTS: dict[str, str] = {
    "KeepaliveConfig": "_transport",
    "RetryConfig": "_transport",
    "TlsConfig": "_transport",
    "TERMINAL_STATES": "client",
    "Attempt": "client",
    "AttemptOutcome": "client",
    "Client": "client",
    "DependencyResult": "client",
    "PoolPause": "client",
    "Retried": "client",
    "RunWhen": "client",
    "KeyMode": "client",
    "Schedule": "client",
    "Submitted": "client",
    "Task": "client",
    "TaskEvent": "client",
    "TaskFilter": "client",
    "TaskState": "client",
    "TraceContext": "client",
    "WaitResult": "client",
    "dependencies_of": "client",
    "payload_of": "client",
    "result_of": "client",
    "task_filter": "client",
    "task_spec": "client",
    "CronoqError": "errors",
    "from_grpc_error": "errors",
    "SyncClient": "sync",
    "Snooze": "worker",
    "TaskContext": "worker",
    "TaskError": "worker",
    "Worker": "worker",
}

__all__ = [
    "TERMINAL_STATES",
    "Attempt",
    "AttemptOutcome",
    "Client",
    "CronoqError",
    "DependencyResult",
    "KeepaliveConfig",
    "KeyMode",
    "PoolPause",
    "Retried",
    "RetryConfig",
    "RunWhen",
    "Schedule",
    "Snooze",
    "Submitted",
    "SyncClient",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskEvent",
    "TaskFilter",
    "TaskState",
    "TlsConfig",
    "TraceContext",
    "WaitResult",
    "Worker",
    "dependencies_of",
    "from_grpc_error",
    "payload_of",
    "result_of",
    "task_filter",
    "task_spec",
]

if TYPE_CHECKING:
    from . import outbox as outbox
    from ._transport import KeepaliveConfig, RetryConfig, TlsConfig
    from .client import (
        TERMINAL_STATES,
        Attempt,
        AttemptOutcome,
        Client,
        DependencyResult,
        KeyMode,
        PoolPause,
        Retried,
        RunWhen,
        Schedule,
        Submitted,
        Task,
        TaskEvent,
        TaskFilter,
        TaskState,
        TraceContext,
        WaitResult,
        dependencies_of,
        payload_of,
        result_of,
        task_filter,
        task_spec,
    )
    from .errors import CronoqError, from_grpc_error
    from .sync import SyncClient
    from .worker import Snooze, TaskContext, TaskError, Worker


# Submodules reached as attributes (cronoq.outbox.enqueue), imported on first use.
_SUBMODULES = frozenset({"outbox"})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
