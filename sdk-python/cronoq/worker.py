"""The async Worker: register, lease with bounded concurrency, heartbeat, batched
finish reports, transport retries, and a graceful shutdown.

    async def handle(task: cronoq.TaskContext) -> dict:
        return {"doubled": task.payload["n"] * 2}

    await cronoq.Worker("http://127.0.0.1:7070", "default", handle, concurrency=32).run()
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ._transport import Connection, Endpoint, RetryConfig, TlsConfig, call_once
from .client import Task, decode, encode_payload
from .errors import (
    Cancelled,
    CronoqError,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    NotFound,
    TooManyRedirects,
    Unavailable,
    Unknown,
)
from .v1 import worker_service_pb2 as pb
from .v1 import worker_service_pb2_grpc

log = logging.getLogger("cronoq.worker")

MAX_REDIRECTS = 3
# Failures of a worker's own calls that say nothing about the request: they are retried.
TRANSIENT = (Unavailable, Cancelled, DeadlineExceeded, Internal, Unknown)
MAX_FINISH_BATCH = 1000


class TaskError(Exception):
    """Raise from a handler to fail the attempt.

    retryable=False ends the task FAILED whatever attempts remain; retry_after (seconds)
    overrides the pool's backoff for the next attempt.
    """

    def __init__(self, message: str, *, retryable: bool = True, retry_after: float | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


class TaskContext:
    """What a handler gets: the task, its decoded payload, and its cancellation."""

    def __init__(self, task: Task):
        self.task = task
        self.cancel_requested = asyncio.Event()
        self._lost = False

    @property
    def id(self) -> int:
        return self.task.id

    @property
    def attempt(self) -> int:
        return self.task.attempt

    @property
    def pool(self) -> str:
        return self.task.pool

    @property
    def key(self) -> str:
        return self.task.key

    @property
    def payload(self) -> Any:
        """The JSON value for JSON payloads, else the bytes."""
        return decode(self.task.payload, self.task.content_type)


Handler = Callable[[TaskContext], Awaitable[Any]]


class Worker:
    def __init__(
        self,
        endpoint: str,
        pools: str | Sequence[str],
        handler: Handler,
        *,
        concurrency: int = 16,
        name: str | None = None,
        token: str | None = None,
        tls: TlsConfig | None = None,
        retry: RetryConfig = RetryConfig(max_elapsed=None),
        poll_wait: float = 10.0,
        insecure_redirect_http: bool = False,
        labels: dict[str, str] | None = None,
        shutdown_grace: float = 30.0,
        finish_linger: float = 0.002,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency: {concurrency} must be at least 1")
        self._conn = Connection(
            endpoint,
            worker_service_pb2_grpc.WorkerServiceStub,
            token=token,
            tls=tls,
            insecure_redirect_http=insecure_redirect_http,
        )
        self.pools = [pools] if isinstance(pools, str) else list(pools)
        self.handler = handler
        self.concurrency = concurrency
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self._retry = retry
        self._poll_wait_ms = int(poll_wait * 1000)
        self._labels = labels or {}
        self._shutdown_grace = shutdown_grace
        self._finish_linger = finish_linger
        self.worker_id = ""
        self._heartbeat_s = 10.0
        self._running: dict[int, tuple[asyncio.Task[None], TaskContext]] = {}
        self._unacked: dict[int, int] = {}  # task id -> attempt, outcome not yet acknowledged
        self._outcomes: list[pb.TaskOutcome] = []
        self._outcome_ready = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._stopping = asyncio.Event()
        self.processed = 0

    # -- connection -----------------------------------------------------------

    @property
    def endpoint(self) -> Endpoint:
        """The server this worker talks to now."""
        return self._conn.current

    async def _call(self, method: str, request: Any, timeout: float = 30.0) -> Any:
        return await self._conn.call(method, request, timeout, self._retry)

    async def _register(self) -> None:
        """Registers with the shard of its pools, following up to three redirects in a row."""
        redirects, unavailable = 0, 0
        req = pb.RegisterWorkerRequest(
            name=self.name, pools=self.pools, concurrency=self.concurrency, labels=self._labels
        )
        while True:
            try:
                resp = await call_once(
                    lambda: self._conn.rpc("RegisterWorker")(req, metadata=self._conn.metadata, timeout=30)
                )
            except FailedPrecondition as err:
                target = err.shard_endpoint
                if not target:
                    raise
                redirects += 1
                if redirects > MAX_REDIRECTS:
                    raise TooManyRedirects(
                        f"worker for {self.pools} was redirected more than {MAX_REDIRECTS} times in a row "
                        f"(last to {target}): check the [[shards]] endpoints"
                    ) from None
                log.info("shard %s serves %s: reconnecting to %s", err.shard, self.pools, target)
                self._conn.follow(target)
                continue
            except Unavailable as err:
                if self._stopping.is_set():
                    raise
                # The leader a standby names, or else the next configured endpoint (so a
                # redirect target that is down sends the worker back to its configured one).
                self._conn.on_unavailable(err)
                if self._conn.current in self._conn.configured:
                    redirects = 0
                unavailable += 1
                delay = min(self._retry.initial_backoff * 2 ** min(unavailable, 10), self._retry.max_backoff)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                continue
            self.worker_id = resp.worker_id
            self._heartbeat_s = max(resp.heartbeat_interval_ms / 1000, 0.1)
            log.info(
                "worker %s registered with shard %s at %s for %s", self.worker_id, resp.shard, self.endpoint, self.pools
            )
            return

    # -- running --------------------------------------------------------------

    def stop(self) -> None:
        """Stops leasing; run() returns once running tasks finish and are reported."""
        self._stopping.set()
        self._slot_free.set()

    async def run(self) -> None:
        await self._register()
        flusher = asyncio.create_task(self._flush_loop())
        heartbeats = asyncio.create_task(self._heartbeat_loop())
        leasing = asyncio.create_task(self._lease_loop())
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({leasing, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if leasing.done() and leasing.exception():
                raise leasing.exception()  # type: ignore[misc]
        finally:
            leasing.cancel()
            stopping.cancel()
            await asyncio.gather(leasing, return_exceptions=True)
            await self._finish_running()
            heartbeats.cancel()
            await asyncio.gather(heartbeats, return_exceptions=True)
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
            await self._deregister()
            await self._conn.close()

    async def _finish_running(self) -> None:
        """Graceful shutdown: running tasks finish (within the grace) and are reported."""
        if self._running:
            log.info("worker %s: waiting for %d running task(s)", self.worker_id, len(self._running))
            tasks = [t for t, _ in self._running.values()]
            _, pending = await asyncio.wait(tasks, timeout=self._shutdown_grace)
            for t in pending:
                t.cancel()
        deadline = asyncio.get_running_loop().time() + self._shutdown_grace
        while (self._outcomes or self._unacked) and asyncio.get_running_loop().time() < deadline:
            self._outcome_ready.set()
            await asyncio.sleep(0.01)

    async def _deregister(self) -> None:
        if self.worker_id:
            try:
                await self._conn.rpc("DeregisterWorker")(
                    pb.DeregisterWorkerRequest(worker_id=self.worker_id), metadata=self._conn.metadata, timeout=5
                )
            except Exception as err:
                log.debug("deregister failed: %s", err)

    async def _lease_loop(self) -> None:
        while not self._stopping.is_set():
            free = self.concurrency - len(self._running)
            if free <= 0:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            req = pb.LeaseTasksRequest(worker_id=self.worker_id, max_tasks=free, wait_ms=self._poll_wait_ms)
            try:
                resp = await self._call("LeaseTasks", req, timeout=self._poll_wait_ms / 1000 + 30)
            except NotFound:
                log.warning("worker %s unknown to the server; registering again", self.worker_id)
                await self._register()
                continue
            except TRANSIENT as err:  # e.g. a server that stops mid-call: ask again
                log.warning("lease failed (%s); retrying", err)
                await self._pause_after(err)
                continue
            for task in resp.tasks:
                ctx = TaskContext(task)
                self._running[task.id] = (asyncio.create_task(self._execute(ctx)), ctx)

    async def _execute(self, ctx: TaskContext) -> None:
        outcome = pb.TaskOutcome(task_id=ctx.id, attempt=ctx.attempt)
        try:
            result = await self.handler(ctx)
            data, content_type = encode_payload(result)
            outcome.success.result = data
            outcome.success.content_type = content_type
        except TaskError as err:
            outcome.failure.error = str(err)
            outcome.failure.retryable = err.retryable
            if err.retry_after is not None:
                outcome.failure.retry_after_ms = max(int(err.retry_after * 1000), 1)
        except asyncio.CancelledError:
            if ctx._lost:
                return
            outcome.cancelled.reason = "cancelled" if ctx.cancel_requested.is_set() else "worker shut down"
        except Exception as err:
            outcome.failure.error = f"{type(err).__name__}: {err}"
            outcome.failure.retryable = True
        finally:
            self._running.pop(ctx.id, None)
            self._slot_free.set()
        self._unacked[ctx.id] = ctx.attempt
        self._outcomes.append(outcome)
        self._outcome_ready.set()

    async def _flush_loop(self) -> None:
        """One FinishTasks call in flight; outcomes that arrive meanwhile form the next batch."""
        while True:
            await self._outcome_ready.wait()
            if self._finish_linger > 0 and len(self._outcomes) < MAX_FINISH_BATCH and not self._stopping.is_set():
                await asyncio.sleep(self._finish_linger)  # let more outcomes join this report
            self._outcome_ready.clear()
            while self._outcomes:
                batch, self._outcomes = self._outcomes[:MAX_FINISH_BATCH], self._outcomes[MAX_FINISH_BATCH:]
                req = pb.FinishTasksRequest(worker_id=self.worker_id, outcomes=batch)
                try:
                    resp = await self._call("FinishTasks", req)
                except NotFound:
                    await self._register()
                    self._outcomes[:0] = batch
                    continue
                except TRANSIENT as err:
                    # Reports are fenced by attempt, so sending one again is safe; dropping it would
                    # leave the task to its lease expiry and run it twice.
                    log.warning("finish report of %d task(s) failed (%s); retrying", len(batch), err)
                    self._outcomes[:0] = batch
                    await self._pause_after(err)
                    continue
                except CronoqError as err:
                    log.error("finish report of %d task(s) refused: %s", len(batch), err)
                    resp = None
                for o in batch:
                    self._unacked.pop(o.task_id, None)
                self.processed += len(batch)
                for r in resp.results if resp else ():
                    if not r.accepted:
                        log.warning("outcome of task %d refused: %s %s", r.task_id, r.code, r.message)

    async def _pause_after(self, err: CronoqError) -> None:
        """Backs off after a transient failure, moving to another server when one is named or known."""
        if isinstance(err, Unavailable):
            self._conn.on_unavailable(err)
        await asyncio.sleep(self._retry.initial_backoff * random.uniform(1.0, 4.0))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            attempts = [pb.TaskAttempt(task_id=i, attempt=c.attempt) for i, (_, c) in self._running.items()]
            attempts += [pb.TaskAttempt(task_id=i, attempt=a) for i, a in self._unacked.items()]
            try:
                resp = await self._call("Heartbeat", pb.HeartbeatRequest(worker_id=self.worker_id, tasks=attempts))
            except NotFound:
                await self._register()
                continue
            except CronoqError as err:
                log.warning("heartbeat failed: %s", err)
                continue
            for task_id in resp.cancelled_task_ids:
                if task_id in self._running:
                    handle, ctx = self._running[task_id]
                    ctx.cancel_requested.set()
                    handle.cancel()
            for task_id in resp.lost_task_ids:
                if task_id in self._running:
                    handle, ctx = self._running[task_id]
                    ctx._lost = True
                    handle.cancel()
                    log.warning("task %d lost its lease; its outcome will not be reported", task_id)
