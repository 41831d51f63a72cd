"""SyncClient: the Client's calls for code that is not async."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator, Sequence
from typing import Any, Literal, overload

from .client import (
    BULK_TIMEOUT,
    Client,
    PoolPause,
    Retried,
    Schedule,
    Submitted,
    Task,
    TaskEvent,
    TaskRefLike,
    WaitResult,
)
from .v1 import admin_service_pb2, schedule_service_pb2, worker_service_pb2
from .v1 import task_service_pb2 as pb


class SyncClient:
    """Runs a Client on a private event loop; not for use inside a running loop."""

    def __init__(self, endpoint: str = "http://127.0.0.1:7070", **options: Any):
        self._loop = asyncio.new_event_loop()
        self._client = Client(endpoint, **options)

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._client.close())
            self._loop.close()

    def submit(self, pool: str, payload: Any = None, **options: Any) -> Submitted:
        return self._run(self._client.submit(pool, payload, **options))

    def submit_batch(
        self, specs: Sequence[pb.SubmitTaskRequest], *, request_id: str | None = None
    ) -> pb.SubmitBatchResponse:
        return self._run(self._client.submit_batch(specs, request_id=request_id))

    @overload
    def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: Literal[False] = False,
        include_children: Literal[False] = False,
        include_dependents: Literal[False] = False,
        include_dependency_results: bool = False,
    ) -> Task: ...

    @overload
    def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: Literal[True],
        include_children: bool = False,
        include_dependents: bool = False,
        include_dependency_results: bool = False,
    ) -> pb.GetTaskResponse: ...

    @overload
    def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: bool = False,
        include_children: Literal[True],
        include_dependents: bool = False,
        include_dependency_results: bool = False,
    ) -> pb.GetTaskResponse: ...

    @overload
    def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: bool = False,
        include_children: bool = False,
        include_dependents: Literal[True],
        include_dependency_results: bool = False,
    ) -> pb.GetTaskResponse: ...

    def get(
        self,
        ref: TaskRefLike,
        *,
        include_attempts: bool = False,
        include_children: bool = False,
        include_dependents: bool = False,
        include_dependency_results: bool = False,
    ) -> Task | pb.GetTaskResponse:
        """Client.get (the same options and answers)."""
        return self._run(
            self._client.get(  # type: ignore[call-overload]
                ref,
                include_attempts=include_attempts,
                include_children=include_children,
                include_dependents=include_dependents,
                include_dependency_results=include_dependency_results,
            )
        )

    def wait(self, ref: TaskRefLike, timeout: float = 30.0) -> WaitResult:
        return self._run(self._client.wait(ref, timeout))

    @overload
    def cancel(self, ref: TaskRefLike, *, include_descendants: Literal[False] = False) -> Task: ...

    @overload
    def cancel(self, ref: TaskRefLike, *, include_descendants: Literal[True]) -> pb.CancelTaskResponse: ...

    def cancel(self, ref: TaskRefLike, *, include_descendants: bool = False) -> Task | pb.CancelTaskResponse:
        """Client.cancel (with include_descendants: the CancelTaskResponse)."""
        return self._run(self._client.cancel(ref, include_descendants=include_descendants))  # type: ignore[call-overload]

    def retry(self, ref: TaskRefLike, *, run_at: dt.datetime | None = None, extra_attempts: int = 0) -> Retried:
        return self._run(self._client.retry(ref, run_at=run_at, extra_attempts=extra_attempts))

    def delete(self, ref: TaskRefLike) -> int:
        return self._run(self._client.delete(ref))

    def cancel_tasks(
        self, filter: pb.TaskFilter, *, dry_run: bool = False, timeout: float = BULK_TIMEOUT
    ) -> pb.CancelTasksResponse:
        return self._run(self._client.cancel_tasks(filter, dry_run=dry_run, timeout=timeout))

    def retry_tasks(self, filter: pb.TaskFilter, **options: Any) -> pb.RetryTasksResponse:
        """Client.retry_tasks (same options: dry_run, run_at, extra_attempts, timeout)."""
        return self._run(self._client.retry_tasks(filter, **options))

    def delete_tasks(
        self, filter: pb.TaskFilter, *, dry_run: bool = False, timeout: float = BULK_TIMEOUT
    ) -> pb.DeleteTasksResponse:
        return self._run(self._client.delete_tasks(filter, dry_run=dry_run, timeout=timeout))

    def list(
        self,
        pool: str = "",
        state: int = 0,
        page_size: int = 100,
        page_token: str = "",
        *,
        newest_first: bool = False,
        filter: pb.TaskFilter | None = None,
    ) -> pb.ListTasksResponse:
        """Client.list (filter: see task_filter, e.g. parent_id for the tasks one spawned)."""
        return self._run(
            self._client.list(pool, state, page_size, page_token, newest_first=newest_first, filter=filter)
        )

    def watch(self, pool: str | None = None, **options: Any) -> Iterator[TaskEvent]:
        """Client.watch as a generator (same options); close it, or break out, to stop."""
        events = self._client.watch(pool, **options)
        try:
            while True:
                try:
                    yield self._run(events.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._run(events.aclose())  # type: ignore[attr-defined]

    def list_workers(self, pool: str | None = None) -> worker_service_pb2.ListWorkersResponse:
        return self._run(self._client.list_workers(pool))

    def put_schedule(self, pool: str, name: str, cron: str, **options: Any) -> Schedule:
        return self._run(self._client.put_schedule(pool, name, cron, **options))

    def delete_schedule(self, pool: str, name: str) -> None:
        self._run(self._client.delete_schedule(pool, name))

    def list_schedules(self, pool: str | None = None) -> schedule_service_pb2.ListSchedulesResponse:
        return self._run(self._client.list_schedules(pool))

    def pause_pool(self, pool: str) -> PoolPause:
        return self._run(self._client.pause_pool(pool))

    def resume_pool(self, pool: str) -> PoolPause:
        return self._run(self._client.resume_pool(pool))

    def snapshot(self) -> admin_service_pb2.GetSnapshotResponse:
        return self._run(self._client.snapshot())

    def server_info(self) -> admin_service_pb2.GetServerInfoResponse:
        return self._run(self._client.server_info())
