"""The async Client: tasks (submit, submit_batch, get, wait, cancel, retry, delete, list, watch),
workflows (run_when, a task's children and dependency results, cancel with its descendants),
bulk actions by filter (cancel_tasks, retry_tasks, delete_tasks), workers, schedules, pools
(pause_pool, resume_pool) and the cluster's snapshot.

async with Client("http://127.0.0.1:7070") as client:
    sub = await client.submit("default", {"n": 1}, key="invoice-42")
    done = await client.wait(sub.task.id, timeout=30)
    async for event in client.watch("default"):   # resumes after a reconnect
        print(event.task.id, event.task.state)
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import grpc

from . import _tracing
from ._transport import HEALTHY_STREAM_S, Connection, Endpoint, KeepaliveConfig, RetryConfig, TlsConfig, backoff_delay
from .errors import Aborted, Cancelled, CronoqError, Internal, Unavailable, from_grpc_error
from .jsonform import JSON_CONTENT_TYPE
from .v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    schedule_service_pb2,
    schedule_service_pb2_grpc,
    task_pb2,
    task_service_pb2_grpc,
    worker_service_pb2,
    worker_service_pb2_grpc,
)
from .v1 import task_service_pb2 as pb

log = logging.getLogger("cronoq")

Task = task_pb2.Task
TaskState = task_pb2.TaskState
TaskEvent = task_pb2.TaskEvent
Schedule = schedule_service_pb2.Schedule
Attempt = task_pb2.Attempt
AttemptOutcome = task_pb2.AttemptOutcome
TaskFilter = pb.TaskFilter
TraceContext = task_pb2.TraceContext
RunWhen = task_pb2.RunWhen
KeyMode = task_pb2.KeyMode
PoolPause = admin_service_pb2.PoolPause
TERMINAL_STATES = frozenset({
    task_pb2.TASK_STATE_SUCCEEDED, task_pb2.TASK_STATE_FAILED, task_pb2.TASK_STATE_CANCELLED,
    task_pb2.TASK_STATE_EXPIRED,
})  # fmt: skip
# A bulk action goes through its matches in bounded batches on every shard: it may take minutes.
BULK_TIMEOUT = 300.0

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


@dataclass(frozen=True)
class DependencyResult:
    """How one dependency of a task ended: its id, key ("" none), state (a TaskState value),
    value (its result decoded: the JSON value of a JSON result, else bytes; None when it has
    none, e.g. it failed) and error ("" none)."""

    id: int
    key: str
    state: int
    value: Any
    error: str


def dependencies_of(task: Task) -> list[DependencyResult]:
    """The task's dependency results (a leased task's, or GetTask's with
    include_dependency_results), decoded, in depends_on order."""
    return [
        DependencyResult(d.id, d.key, d.state, decode(d.result, d.content_type) if d.result else None, d.error)
        for d in task.dependency_results
    ]


# run_when's names: "succeeded" (the default) and "ended" (a finalizer: runs whatever they ended with).
RUN_WHEN_NAMES = {
    "succeeded": task_pb2.RUN_WHEN_DEPENDENCIES_SUCCEEDED,
    "ended": task_pb2.RUN_WHEN_DEPENDENCIES_ENDED,
}


def run_when_value(run_when: str | int | None) -> int:
    """A RunWhen value from "succeeded", "ended", a RunWhen value, or None (unspecified)."""
    if run_when is None:
        return task_pb2.RUN_WHEN_UNSPECIFIED
    if isinstance(run_when, str) and run_when in RUN_WHEN_NAMES:
        return RUN_WHEN_NAMES[run_when]
    if isinstance(run_when, int) and not isinstance(run_when, bool) and run_when in RunWhen.values():
        return run_when
    raise ValueError(f"run_when: {run_when!r} is not 'succeeded', 'ended' or a RunWhen value")


# key_mode's names: what a submission does when its key already names a task.
KEY_MODE_NAMES = {
    "return_existing": task_pb2.KEY_MODE_RETURN_EXISTING,
    "replace_pending": task_pb2.KEY_MODE_REPLACE_PENDING,
    "debounce": task_pb2.KEY_MODE_DEBOUNCE,
}


def key_mode_value(key_mode: str | int | None) -> int:
    """A KeyMode value from "return_existing", "replace_pending", "debounce", a KeyMode value
    (or its name, "KEY_MODE_DEBOUNCE"), or None (unspecified: the pool's default)."""
    if key_mode is None:
        return task_pb2.KEY_MODE_UNSPECIFIED
    if isinstance(key_mode, str) and key_mode in KEY_MODE_NAMES:
        return KEY_MODE_NAMES[key_mode]
    if isinstance(key_mode, str) and key_mode in KeyMode.keys():
        return KeyMode.Value(key_mode)
    if isinstance(key_mode, int) and not isinstance(key_mode, bool) and key_mode in KeyMode.values():
        return key_mode
    raise ValueError(
        f"key_mode: {key_mode!r} is not 'return_existing', 'replace_pending', 'debounce' or a KeyMode value"
    )


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
    run_when: str | int | None = None,
    resources: Mapping[str, int] | None = None,
    timeout: float | None = None,
    group_key: str | None = None,
    trace: TraceContext | None = None,
    key_mode: str | int | None = None,
    debounce_ms: int = 0,
    max_debounce_ms: int = 0,
    key_ttl_ms: int = 0,
    start_by: dt.datetime | None = None,
) -> pb.SubmitTaskRequest:
    """One task to submit. payload: bytes, or any JSON value. delay: seconds from now.
    depends_on: ids (int) and keys (str) of tasks it waits for; run_when: when it runs, given
    them: "succeeded" (the default: once all succeeded) or "ended" (once all ended, however:
    a finalizer, which sees their states and errors in its dependency results).
    timeout: seconds each attempt may run (capped by the pool's); the worker cancels it then.
    group_key: the task's group (a tenant, a user); in a pool with max_running_per_group, at
    most that many tasks of one group run at once. trace: the W3C trace context the task is
    submitted in (default: the current OpenTelemetry span's, taken when it is submitted).
    key_mode: what the submission does when its key already names a task: "return_existing"
    (return it, changing nothing), "replace_pending" (a PENDING or BLOCKED one takes this
    payload, priority and run_at: Submitted.replaced) or "debounce" (as replace_pending, and it
    is due debounce_ms after the latest submission, at most max_debounce_ms after the first);
    default: the pool's default_key_mode. key_ttl_ms: once the task has ended and this long has
    passed, its key is free for a new task (unique for a period). start_by: if no attempt has
    started by then, the task ends EXPIRED without running."""
    data, content_type = encode_payload(payload)
    req = pb.SubmitTaskRequest(
        pool=pool,
        key=key or "",
        payload=data,
        content_type=content_type,
        priority=priority,
        max_attempts=max_attempts,
        depends_on=[task_ref(r) for r in depends_on],
        run_when=run_when_value(run_when),  # type: ignore[arg-type]
        resources=dict(resources or {}),
        timeout_ms=max(int(timeout * 1000), 1) if timeout is not None else 0,
        group_key=group_key or "",
        key_mode=key_mode_value(key_mode),  # type: ignore[arg-type]
        debounce_ms=debounce_ms,
        max_debounce_ms=max_debounce_ms,
        key_ttl_ms=key_ttl_ms,
    )
    _set_time(req, "start_by", start_by)
    if trace is not None:
        req.trace.SetInParent()
        req.trace.CopyFrom(trace)
    if delay is not None:
        run_at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay)
    if run_at is not None:
        if run_at.tzinfo is None:
            raise ValueError("run_at: give a timezone-aware datetime")
        req.run_at.FromDatetime(run_at)
    return req


def _set_time(msg: Any, field: str, when: dt.datetime | None) -> None:
    if when is None:
        return
    if when.tzinfo is None:
        raise ValueError(f"{field}: give a timezone-aware datetime")
    getattr(msg, field).FromDatetime(when)


def task_filter(
    pool: str | None = None,
    *,
    states: Sequence[int] = (),
    created_after: dt.datetime | None = None,
    created_before: dt.datetime | None = None,
    finished_after: dt.datetime | None = None,
    finished_before: dt.datetime | None = None,
    key_prefix: str | None = None,
    error_contains: str | None = None,
    ids: Sequence[int] = (),
    parent_id: int | None = None,
) -> pb.TaskFilter:
    """Which tasks a bulk action (or a listing) applies to: those that match every part given
    (times are timezone-aware datetimes). No states: every state the action applies to.
    parent_id: only the tasks that task's handler spawned."""
    req = pb.TaskFilter(
        pool=pool or "",
        states=list(states),  # type: ignore[arg-type]
        key_prefix=key_prefix or "",
        error_contains=error_contains or "",
        ids=list(ids),
        parent_id=parent_id or 0,
    )
    for field, when in (
        ("created_after", created_after),
        ("created_before", created_before),
        ("finished_after", finished_after),
        ("finished_before", finished_before),
    ):
        _set_time(req, field, when)
    return req


def new_request_id() -> str:
    """A fresh request id: the server answers a repeated one with what the first call created."""
    return uuid.uuid4().hex


class ServiceStubs:
    """The stubs of every service the client calls, on one channel (their method names differ)."""

    def __init__(self, channel: grpc.aio.Channel):
        for stub in (
            task_service_pb2_grpc.TaskServiceStub(channel),
            worker_service_pb2_grpc.WorkerServiceStub(channel),
            schedule_service_pb2_grpc.ScheduleServiceStub(channel),
            admin_service_pb2_grpc.AdminServiceStub(channel),
        ):
            self.__dict__.update(vars(stub))


# Watch failures a new stream gets past: the server went away or was replaced (UNAVAILABLE,
# CANCELLED, INTERNAL from a reset connection), or it ended this stream (ABORTED: the
# watcher fell behind). Anything else (PERMISSION_DENIED, INVALID_ARGUMENT, OUT_OF_RANGE for
# a cursor older than the server keeps, ...) is raised.
WATCH_TRANSIENT = (Unavailable, Cancelled, Aborted, Internal)

# Initial metadata of a sharded server's Watch: the cursor of where the stream starts.
WATCH_START_KEY = "cronoq-watch-cursor"

# What watch() calls before each reconnection: the error that ended the stream (None when
# the server ended it cleanly, e.g. while draining) and the cursor it resumes from ("" if none).
ReconnectHook = Callable[[CronoqError | None, str], None]


def _metadata_value(metadata: Any, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else bytes(value).decode()
    return None


@dataclass(frozen=True)
class Submitted:
    task: Task
    deduplicated: bool  # the key named a task: nothing was created or changed
    replaced: bool = False  # the key named a PENDING or BLOCKED task: it took this submission


@dataclass(frozen=True)
class WaitResult:
    task: Task
    done: bool


@dataclass(frozen=True)
class Retried:
    task: Task
    # Its dependents that had ended because it ended, and wait for it again (BLOCKED).
    dependents_restored: int


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
        keepalive: KeepaliveConfig = KeepaliveConfig(),
    ):
        self._conn = Connection(endpoint, ServiceStubs, token=token, tls=tls, keepalive=keepalive)
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
        The task carries the current OpenTelemetry span context (trace=: a given one instead).
        """
        req = task_spec(pool, payload, **options)
        req.request_id = request_id or new_request_id()
        _tracing.set_current_trace(req)
        resp = await self._call("SubmitTask", req)
        return Submitted(resp.task, resp.deduplicated, resp.replaced)

    async def submit_batch(
        self, specs: Sequence[pb.SubmitTaskRequest], *, request_id: str | None = None
    ) -> pb.SubmitBatchResponse:
        """Admits every task or none; tasks may depend on the batch's own keys.

        request_id works as in submit, for the whole batch (the specs' own are cleared). Each
        task without a trace of its own carries the current OpenTelemetry span context.
        """
        req = pb.SubmitBatchRequest(tasks=list(specs), request_id=request_id or new_request_id())
        for spec in req.tasks:  # copies: the caller's specs are untouched
            spec.ClearField("request_id")
        _tracing.set_current_trace(*req.tasks)
        return await self._call("SubmitBatch", req)

    @overload
    async def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: Literal[False] = False,
        include_children: Literal[False] = False,
        include_dependents: Literal[False] = False,
        include_dependency_results: bool = False,
    ) -> Task: ...

    @overload
    async def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: Literal[True],
        include_children: bool = False,
        include_dependents: bool = False,
        include_dependency_results: bool = False,
    ) -> pb.GetTaskResponse: ...

    @overload
    async def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: bool = False,
        include_children: Literal[True],
        include_dependents: bool = False,
        include_dependency_results: bool = False,
    ) -> pb.GetTaskResponse: ...

    @overload
    async def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: bool = False,
        include_children: bool = False,
        include_dependents: Literal[True],
        include_dependency_results: bool = False,
    ) -> pb.GetTaskResponse: ...

    async def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: bool = False,
        include_children: bool = False,
        include_dependents: bool = False,
        include_dependency_results: bool = False,
    ) -> Task | pb.GetTaskResponse:
        """The task; with include_attempts, include_children or include_dependents, the whole
        GetTaskResponse: .task, .attempts (every attempt, oldest first, with its worker, times,
        outcome and error), .children (the tasks its handler spawned, in id order, at most 1,000,
        without payload or result: list with task_filter(parent_id=...) for them all) and
        .dependents (ids of the tasks that depend on it). include_dependency_results: the task's
        dependency_results are filled (dependencies_of decodes them)."""
        req = pb.GetTaskRequest(
            task=task_ref(ref),
            include_attempts=include_attempts,
            include_children=include_children,
            include_dependents=include_dependents,
            include_dependency_results=include_dependency_results,
        )
        resp = await self._call("GetTask", req)
        return resp if include_attempts or include_children or include_dependents else resp.task

    async def wait(self, ref: TaskRefLike, timeout: float = 30.0) -> WaitResult:
        """Blocks until the task is terminal or timeout seconds pass."""
        req = pb.WaitTaskRequest(task=task_ref(ref), timeout_ms=max(int(timeout * 1000), 1))
        resp = await self._call("WaitTask", req, timeout=timeout + self._timeout)
        return WaitResult(resp.task, resp.done)

    @overload
    async def cancel(self, ref: TaskRefLike, *, include_descendants: Literal[False] = False) -> Task: ...

    @overload
    async def cancel(self, ref: TaskRefLike, *, include_descendants: Literal[True]) -> pb.CancelTaskResponse: ...

    async def cancel(self, ref: TaskRefLike, *, include_descendants: bool = False) -> Task | pb.CancelTaskResponse:
        """Cancels the task: a PENDING or BLOCKED one ends CANCELLED, a RUNNING one is asked to
        stop. With include_descendants, also the tasks it spawned, theirs, and so on, with the
        tasks that depend on any of them; the whole CancelTaskResponse is returned: .task and
        .descendants_cancelled (how many of them this call cancelled or asked to stop)."""
        req = pb.CancelTaskRequest(task=task_ref(ref), include_descendants=include_descendants)
        resp = await self._call("CancelTask", req)
        return resp if include_descendants else resp.task

    async def retry(self, ref: TaskRefLike, *, run_at: dt.datetime | None = None, extra_attempts: int = 0) -> Retried:
        """A FAILED or CANCELLED task back to PENDING, due at run_at (default: now), keeping its
        attempts; one that used all of them gets extra_attempts more (0: 1). Another state is
        refused with FailedPrecondition."""
        req = pb.RetryTaskRequest(task=task_ref(ref), extra_attempts=extra_attempts)
        _set_time(req, "run_at", run_at)
        resp = await self._call("RetryTask", req)
        return Retried(resp.task, resp.dependents_restored)

    async def delete(self, ref: TaskRefLike) -> int:
        """Deletes an ended task with its attempts and events; returns its id."""
        return int((await self._call("DeleteTask", pb.DeleteTaskRequest(task=task_ref(ref)))).id)

    async def cancel_tasks(
        self, filter: pb.TaskFilter, *, dry_run: bool = False, timeout: float = BULK_TIMEOUT
    ) -> pb.CancelTasksResponse:
        """Cancels the unfinished tasks that match filter (see task_filter) on every shard; the
        answer counts them (matched, changed) per shard and names the shards not reached.
        dry_run: count only. Safe to repeat."""
        return await self._call("CancelTasks", pb.CancelTasksRequest(filter=filter, dry_run=dry_run), timeout)

    async def retry_tasks(
        self,
        filter: pb.TaskFilter,
        *,
        dry_run: bool = False,
        run_at: dt.datetime | None = None,
        extra_attempts: int = 0,
        timeout: float = BULK_TIMEOUT,
    ) -> pb.RetryTasksResponse:
        """Retries the FAILED and CANCELLED tasks that match filter, as retry does, on every shard."""
        req = pb.RetryTasksRequest(filter=filter, dry_run=dry_run, extra_attempts=extra_attempts)
        _set_time(req, "run_at", run_at)
        return await self._call("RetryTasks", req, timeout)

    async def delete_tasks(
        self, filter: pb.TaskFilter, *, dry_run: bool = False, timeout: float = BULK_TIMEOUT
    ) -> pb.DeleteTasksResponse:
        """Deletes the ended tasks that match filter, as delete does, on every shard."""
        return await self._call("DeleteTasks", pb.DeleteTasksRequest(filter=filter, dry_run=dry_run), timeout)

    async def list(
        self,
        pool: str = "",
        state: int = 0,
        page_size: int = 100,
        page_token: str = "",
        *,
        newest_first: bool = False,
        filter: pb.TaskFilter | None = None,
    ) -> pb.ListTasksResponse:
        """One page of tasks in id order (newest_first: descending); pass next_page_token for the next.
        filter (see task_filter; any state may be named): only the tasks that match it, as a
        bulk action with that filter would match them."""
        req = pb.ListTasksRequest(
            pool=pool,
            state=state,  # type: ignore[arg-type]
            page_size=page_size,
            page_token=page_token,
            newest_first=newest_first,
            filter=filter,
        )
        return await self._call("ListTasks", req)

    async def iter_tasks(
        self,
        pool: str = "",
        state: int = 0,
        page_size: int = 500,
        *,
        newest_first: bool = False,
        filter: pb.TaskFilter | None = None,
    ) -> AsyncIterator[Task]:
        token = ""
        while True:
            page = await self.list(pool, state, page_size, token, newest_first=newest_first, filter=filter)
            for task in page.tasks:
                yield task
            token = page.next_page_token
            if not token:
                return

    async def watch(
        self,
        pool: str | None = None,
        *,
        cursor: str | None = None,
        include_payloads: bool = False,
        resume: bool = True,
        on_reconnect: ReconnectHook | None = None,
    ) -> AsyncIterator[TaskEvent]:
        """Task events as they happen (every pool the caller may read when pool is None).

        cursor: start after that event (a TaskEvent.cursor) instead of live. With resume, a
        stream that ends or breaks (server restart or drain, leader change, UNAVAILABLE, or
        ABORTED because this watcher fell behind) is opened again, through the endpoint logic
        of every call, from the last event's cursor (a sharded deployment's names every shard;
        before the first event, the cursor a sharded server says a live stream starts at):
        the events in between are replayed, and an event seen already (its shard's seq not
        past the last one yielded) is skipped. A row of failures with no event is given up
        after the client's RetryConfig.max_elapsed;
        other errors (PERMISSION_DENIED, INVALID_ARGUMENT, OUT_OF_RANGE for a cursor the
        server no longer keeps, ...) are raised at once. Without resume the iterator ends with
        the stream and raises its error. Break out of the loop to stop watching.
        """
        last_seq: dict[str, int] = {}  # shard -> the seq of the last event yielded
        failing_since: float | None = None
        failures = 0
        while True:
            req = pb.WatchRequest(pool=pool or "", include_payloads=include_payloads, cursor=cursor or "")
            opened = time.monotonic()
            received = False
            error: CronoqError | None = None
            call = self._conn.rpc("Watch")(req, metadata=self._conn.metadata)
            try:
                if not cursor:  # a sharded server says where a live stream starts: resume from there
                    cursor = _metadata_value(await call.initial_metadata(), WATCH_START_KEY) or cursor
                async for resp in call:
                    event = resp.event
                    received, failing_since, failures = True, None, 0
                    if event.cursor:
                        cursor = event.cursor
                    if event.seq:
                        if event.seq <= last_seq.get(event.shard, 0):
                            continue  # replayed after a reconnect, and yielded before it
                        last_seq[event.shard] = event.seq
                    yield event
                trailers = await call.trailing_metadata()
            except grpc.aio.AioRpcError as err:
                error, trailers = from_grpc_error(err), err.trailing_metadata()
            finally:
                call.cancel()  # a caller that stops early closes the stream
            if not cursor:  # grpc.aio loses the initial metadata of a call that ends at once: the server repeats them
                cursor = _metadata_value(trailers, WATCH_START_KEY) or cursor
            if error is not None and (not resume or not isinstance(error, WATCH_TRANSIENT)):
                raise error
            if error is None and not resume:
                return
            if isinstance(error, Unavailable) and not received:
                tls = await self._conn.diagnose(error)
                if tls is not None:
                    raise tls from None
            now = time.monotonic()
            if now - opened >= HEALTHY_STREAM_S:
                failing_since, failures = None, 0
            if failing_since is None:
                failing_since = now
            max_elapsed = self._retry.max_elapsed
            if max_elapsed is not None and now - failing_since >= max_elapsed:
                raise error or Unavailable(f"watch: the server kept ending the stream for {max_elapsed:g}s")
            if isinstance(error, (Unavailable, Cancelled)):
                self._conn.on_unavailable(error)  # to the leader a standby names, or the next endpoint
            log.info("watch: stream ended (%s); reconnecting to %s", error or "closed by the server", self.endpoint)
            if on_reconnect is not None:
                on_reconnect(error, cursor or "")
            await asyncio.sleep(backoff_delay(self._retry, failures))
            failures += 1

    # -- workers, schedules, admin ---------------------------------------------

    async def list_workers(self, pool: str | None = None) -> worker_service_pb2.ListWorkersResponse:
        """Registered workers (of one pool, or of every pool the caller may read)."""
        return await self._call("ListWorkers", worker_service_pb2.ListWorkersRequest(pool=pool or ""))

    async def put_schedule(
        self,
        pool: str,
        name: str,
        cron: str,
        *,
        payload: Any = None,
        timezone: str | None = None,
        priority: int = 0,
        max_attempts: int = 0,
        resources: Mapping[str, int] | None = None,
        timeout_ms: int = 0,
        group_key: str | None = None,
        paused: bool = False,
        fire_all_missed: bool = False,
        trace: TraceContext | None = None,
    ) -> Schedule:
        """Creates or replaces the schedule (pool, name); returns it with its next_fire_at.

        cron: five fields, or six with seconds first; timezone: an IANA name (UTC if None).
        payload: bytes, or any JSON value, given to every task it fires; the other options
        are those of the tasks it fires (0: the pool's default). The schedule keeps the
        current OpenTelemetry span context (trace=: a given one instead), and each task it fires
        links to it.
        """
        data, content_type = encode_payload(payload)
        schedule = Schedule(
            pool=pool,
            name=name,
            cron=cron,
            timezone=timezone or "",
            payload=data,
            content_type=content_type,
            priority=priority,
            max_attempts=max_attempts,
            resources=dict(resources or {}),
            timeout_ms=timeout_ms,
            group_key=group_key or "",
            paused=paused,
            fire_all_missed=fire_all_missed,
        )
        if trace is not None:
            schedule.trace.SetInParent()
            schedule.trace.CopyFrom(trace)
        _tracing.set_current_trace(schedule)
        resp = await self._call("PutSchedule", schedule_service_pb2.PutScheduleRequest(schedule=schedule))
        return resp.schedule

    async def delete_schedule(self, pool: str, name: str) -> None:
        await self._call("DeleteSchedule", schedule_service_pb2.DeleteScheduleRequest(pool=pool, name=name))

    async def list_schedules(self, pool: str | None = None) -> schedule_service_pb2.ListSchedulesResponse:
        """Schedules of one pool, or of every pool the caller may read."""
        return await self._call("ListSchedules", schedule_service_pb2.ListSchedulesRequest(pool=pool or ""))

    async def pause_pool(self, pool: str) -> PoolPause:
        """Stops leasing the pool's tasks (stored: it holds across restarts); submissions and
        schedule fires are still taken, running tasks finish."""
        return (await self._call("PausePool", admin_service_pb2.PausePoolRequest(pool=pool))).pause

    async def resume_pool(self, pool: str) -> PoolPause:
        return (await self._call("ResumePool", admin_service_pb2.ResumePoolRequest(pool=pool))).pause

    async def snapshot(self) -> admin_service_pb2.GetSnapshotResponse:
        """Per shard: its leader and term, task counts by pool and state, resources, workers."""
        return await self._call("GetSnapshot", admin_service_pb2.GetSnapshotRequest())

    async def server_info(self) -> admin_service_pb2.GetServerInfoResponse:
        """The server this client talks to: version, shard, role, leader (a standby answers too)."""
        return await self._call("GetServerInfo", admin_service_pb2.GetServerInfoRequest())
