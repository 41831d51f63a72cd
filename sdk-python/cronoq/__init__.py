"""cronoq Python SDK: an async Client (with SyncClient), a Worker, and one error tree."""

from ._transport import RetryConfig, TlsConfig
from .client import (
    TERMINAL_STATES,
    Client,
    Submitted,
    Task,
    TaskState,
    WaitResult,
    payload_of,
    result_of,
    task_spec,
)
from .errors import CronoqError, from_grpc_error
from .sync import SyncClient
from .worker import TaskContext, TaskError, Worker

__version__ = "0.1.0"

__all__ = [
    "TERMINAL_STATES",
    "Client",
    "CronoqError",
    "RetryConfig",
    "Submitted",
    "SyncClient",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskState",
    "TlsConfig",
    "WaitResult",
    "Worker",
    "from_grpc_error",
    "payload_of",
    "result_of",
    "task_spec",
]
