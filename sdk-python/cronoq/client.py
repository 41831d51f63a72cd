"""The async Client: submit, submit_batch, get, wait, cancel, list.

async with Client("http://127.0.0.1:7070") as client:
    sub = await client.submit("default", {"n": 1}, key="invoice-42")
    done = await client.wait(sub.task.id, timeout=30)
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._transport import Connection, Endpoint, RetryConfig, TlsConfig
from .jsonform import JSON_CONTENT_TYPE
from .v1 import task_pb2, task_service_pb2_grpc
from .v1 import task_service_pb2 as pb

Task = task_pb2.Task
TaskState = task_pb2.TaskState
TERMINAL_STATES = frozenset({task_pb2.TASK_STATE_SUCCEEDED, task_pb2.TASK_STATE_FAILED, task_pb2.TASK_STATE_CANCELLED})

TaskRefLike = int | str


def task_ref(ref: TaskRefLike) -> task_pb2.TaskRef:
    """An int names a task id, a str a key."""
    if isinstance(ref, bool) or not isinstance(ref, (int, str)):
        raise TypeError(f"task reference must be an id (int) or a key (str), got {ref!r}")
    return task_pb2.TaskRef(id=ref) if isinstance(ref, int) else task_pb2.TaskRef(key=ref)


def encode_payload(payload: Any) -> tuple[bytes, str]:
    """bytes stay as they are; anything else is stored as JSON."""
    if payload is None:
        return b"", ""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload), ""
    return json.dumps(payload, separators=(",", ":")).encode(), JSON_CONTENT_TYPE


def decode(data: bytes, content_type: str) -> Any:
    return json.loads(data or b"null") if content_type == JSON_CONTENT_TYPE else data


def payload_of(task: Task) -> Any:
    """The task's payload: the JSON value for JSON payloads, else bytes."""
    return decode(task.payload, task.content_type)


def result_of(task: Task) -> Any:
    """The task's result: the JSON value for JSON results, else bytes."""
    return decode(task.result, task.result_content_type)


def task_spec(
    pool: str,
    payload: Any = None,
    *,
    key: str | None = None,
    priority: int = 0,
    run_at: dt.datetime | None = None,
    delay: float | None = None,
    max_attempts: int = 0,
    depends_on: Sequence[TaskRefLike] = (),
    resources: Mapping[str, int] | None = None,
    timeout: float | None = None,
) -> pb.SubmitTaskRequest:
    """One task to submit. payload: bytes, or any JSON value. delay: seconds from now.
    timeout: seconds each attempt may run (capped by the pool's); the worker cancels it then."""
    data, content_type = encode_payload(payload)
    req = pb.SubmitTaskRequest(
        pool=pool,
        key=key or "",
        payload=data,
        content_type=content_type,
        priority=priority,
        max_attempts=max_attempts,
        depends_on=[task_ref(r) for r in depends_on],
        resources=dict(resources or {}),
        timeout_ms=max(int(timeout * 1000), 1) if timeout is not None else 0,
    )
    if delay is not None:
        run_at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay)
    if run_at is not None:
        if run_at.tzinfo is None:
            raise ValueError("run_at: give a timezone-aware datetime")
        req.run_at.FromDatetime(run_at)
    return req


def new_request_id() -> str:
    """A fresh request id: the server answers a repeated one with what the first call created."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Submitted:
    task: Task
    deduplicated: bool


@dataclass(frozen=True)
class WaitResult:
    task: Task
    done: bool


class Client:
    """Async client of cronoq: any shard's server, or several servers separated by commas
    (UNAVAILABLE moves to the leader a standby names, or to the next endpoint)."""

    def __init__(
        self,
        endpoint: str = "http://127.0.0.1:7070",
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
        retry: RetryConfig = RetryConfig(),
        timeout: float = 30.0,
    ):
        self._conn = Connection(endpoint, task_service_pb2_grpc.TaskServiceStub, token=token, tls=tls)
        self._retry = retry
        self._timeout = timeout

    @property
    def endpoint(self) -> Endpoint:
        """The server this client talks to now."""
        return self._conn.current

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._conn.close()

    async def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        return await self._conn.call(method, request, timeout or self._timeout, self._retry)

    async def submit(
        self, pool: str, payload: Any = None, *, request_id: str | None = None, **options: Any
    ) -> Submitted:
        """Submits one task (see task_spec for options); a known key returns the existing task.

        request_id (a fresh UUID unless given) is sent with every transport retry of this
        call, so a retry after UNAVAILABLE returns the task the first attempt created.
        """
        req = task_spec(pool, payload, **options)
        req.request_id = request_id or new_request_id()
        resp = await self._call("SubmitTask", req)
        return Submitted(resp.task, resp.deduplicated)

    async def submit_batch(
        self, specs: Sequence[pb.SubmitTaskRequest], *, request_id: str | None = None
    ) -> pb.SubmitBatchResponse:
        """Admits every task or none; tasks may depend on the batch's own keys.

        request_id works as in submit, for the whole batch (the specs' own are cleared).
        """
        req = pb.SubmitBatchRequest(tasks=list(specs), request_id=request_id or new_request_id())
        for spec in req.tasks:  # copies: the caller's specs are untouched
            spec.ClearField("request_id")
        return await self._call("SubmitBatch", req)

    async def get(self, ref: TaskRefLike) -> Task:
        return (await self._call("GetTask", pb.GetTaskRequest(task=task_ref(ref)))).task

    async def wait(self, ref: TaskRefLike, timeout: float = 30.0) -> WaitResult:
        """Blocks until the task is terminal or timeout seconds pass."""
        req = pb.WaitTaskRequest(task=task_ref(ref), timeout_ms=max(int(timeout * 1000), 1))
        resp = await self._call("WaitTask", req, timeout=timeout + self._timeout)
        return WaitResult(resp.task, resp.done)

    async def cancel(self, ref: TaskRefLike) -> Task:
        return (await self._call("CancelTask", pb.CancelTaskRequest(task=task_ref(ref)))).task

    async def list(
        self, pool: str = "", state: int = 0, page_size: int = 100, page_token: str = ""
    ) -> pb.ListTasksResponse:
        """One page of tasks in id order; pass next_page_token for the next."""
        req = pb.ListTasksRequest(pool=pool, state=state, page_size=page_size, page_token=page_token)  # type: ignore[arg-type]
        return await self._call("ListTasks", req)

    async def iter_tasks(self, pool: str = "", state: int = 0, page_size: int = 500) -> AsyncIterator[Task]:
        token = ""
        while True:
            page = await self.list(pool, state, page_size, token)
            for task in page.tasks:
                yield task
            token = page.next_page_token
            if not token:
                return
