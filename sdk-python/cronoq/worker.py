"""The async Worker: register, lease with bounded concurrency (and replies bounded in
bytes), heartbeat, batched finish reports split by size, transport retries, and a
graceful shutdown that gives unfinished tasks back to the server.

    async def handle(task: cronoq.TaskContext) -> dict:
        return {"doubled": task.payload["n"] * 2}

    await cronoq.Worker("http://127.0.0.1:7070", "default", handle, concurrency=32).run()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ._transport import MAX_MESSAGE_BYTES, Connection, Endpoint, RetryConfig, TlsConfig, call_once
from .client import Task, decode, encode_payload
from .errors import (
    Cancelled,
    CronoqError,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    NotFound,
    PermissionDenied,
    TlsError,
    TooManyRedirects,
    Unauthenticated,
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
# Handlers that returned, told with each lease (their resource slots are free at once).
MAX_DONE = 1000
MiB = 1 << 20
# What a server that does not say otherwise (RegisterWorkerResponse fields left 0) allows.
DEFAULT_MAX_RESULT_BYTES = 4 * MiB
DEFAULT_MAX_LEASE_BYTES = 16 * MiB
# Room left under MAX_MESSAGE_BYTES (the channel's send and receive limit) for what a
# message carries besides its tasks or outcomes.
MESSAGE_MARGIN_BYTES = 1 * MiB
MAX_REQUEST_BYTES = MAX_MESSAGE_BYTES - MESSAGE_MARGIN_BYTES
# A LeaseTasks call that fails for good halves max_bytes, down to this.
MIN_LEASE_BYTES = 1 * MiB
# Bytes an outcome adds to a FinishTasksRequest besides its own: tag and length prefix.
OUTCOME_FRAMING_BYTES = 16
RELEASE_REASON = "worker shut down"
# After the shutdown grace: how long cancelled handlers get to unwind, and the whole
# time left (from the end of the grace) for them and for the last outcome reports.
UNWIND_S = 1.0
STOP_EXTRA_S = 3.0
DEREGISTER_TIMEOUT_S = 2.0


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


def _released() -> pb.TaskReleased:
    return pb.TaskReleased(reason=RELEASE_REASON)


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
        # Set from the server's RegisterWorkerResponse (defaults for an older server).
        self.max_result_bytes = DEFAULT_MAX_RESULT_BYTES
        self._max_lease_bytes = DEFAULT_MAX_LEASE_BYTES
        self.lease_bytes = DEFAULT_MAX_LEASE_BYTES  # LeaseTasksRequest.max_bytes now
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
        chain = [str(self._conn.current)]  # the servers of the redirects in a row, and where each sent it
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
                chain.append(f"shard {err.shard or '?'} at {target}")
                if redirects > MAX_REDIRECTS:
                    raise TooManyRedirects(
                        f"worker for {self.pools} was redirected more than {MAX_REDIRECTS} times in a row: "
                        f"{' -> '.join(chain)}: check the [[shards]] endpoints"
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
                    redirects, chain = 0, [str(self._conn.current)]
                unavailable += 1
                delay = min(self._retry.initial_backoff * 2 ** min(unavailable, 10), self._retry.max_backoff)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                continue
            self.worker_id = resp.worker_id
            self._heartbeat_s = max(resp.heartbeat_interval_ms / 1000, 0.1)
            # A result must also fit one FinishTasks request on its own.
            self.max_result_bytes = min(resp.max_result_bytes or DEFAULT_MAX_RESULT_BYTES, MAX_REQUEST_BYTES)
            # A reply must fit what this channel receives.
            self._max_lease_bytes = min(resp.max_lease_bytes or DEFAULT_MAX_LEASE_BYTES, MAX_REQUEST_BYTES)
            self.lease_bytes = self._max_lease_bytes
            log.info(
                "worker %s registered with shard %s at %s for %s", self.worker_id, resp.shard, self.endpoint, self.pools
            )
            return

    # -- running --------------------------------------------------------------

    def stop(self) -> None:
        """Stops leasing; run() returns once running tasks finish and are reported.

        A task still running after shutdown_grace seconds has its handler cancelled and is
        released: the server makes it PENDING again at once, without counting the attempt.
        run() returns within about shutdown_grace + STOP_EXTRA_S seconds.
        """
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
            self._stopping.set()  # also when leasing failed: unfinished tasks are released
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
        """Graceful shutdown: running tasks finish within the grace, the others are released;
        then every outcome is reported, for at most STOP_EXTRA_S more seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._shutdown_grace + STOP_EXTRA_S
        if self._running:
            log.info("worker %s: waiting for %d running task(s)", self.worker_id, len(self._running))
            tasks = [t for t, _ in self._running.values()]
            _, pending = await asyncio.wait(tasks, timeout=self._shutdown_grace)
            if pending:
                log.warning(
                    "worker %s: releasing %d task(s) still running after the %gs shutdown grace",
                    self.worker_id,
                    len(pending),
                    self._shutdown_grace,
                )
                for t in pending:
                    t.cancel()  # _execute reports them released
                _, stuck = await asyncio.wait(pending, timeout=UNWIND_S)
                for task_id, (handle, ctx) in list(self._running.items()):
                    if handle in stuck:  # the handler ignores its cancellation: release it anyway
                        log.warning("task %d: handler ignores cancellation; releasing the task", task_id)
                        ctx._lost = True  # whatever it returns later is not reported
                        self._report(pb.TaskOutcome(task_id=task_id, attempt=ctx.attempt, released=_released()))
        while (self._outcomes or self._unacked) and loop.time() < deadline:
            self._outcome_ready.set()
            await asyncio.sleep(0.01)
        if self._outcomes or self._unacked:
            log.warning(
                "worker %s: %d outcome(s) not acknowledged at shutdown; their leases will expire",
                self.worker_id,
                len(self._unacked),
            )

    async def _deregister(self) -> None:
        if self.worker_id:
            try:
                await self._conn.rpc("DeregisterWorker")(
                    pb.DeregisterWorkerRequest(worker_id=self.worker_id),
                    metadata=self._conn.metadata,
                    timeout=DEREGISTER_TIMEOUT_S,
                )
            except Exception as err:
                log.debug("deregister failed: %s", err)

    async def _lease_loop(self) -> None:
        failures = 0  # in a row, of the kind that shrinks max_bytes
        while not self._stopping.is_set():
            free = self.concurrency - len(self._running)
            if free <= 0:
                self._slot_free.clear()
                await self._slot_free.wait()
                await asyncio.sleep(0)  # handlers ending together free their slots for one lease
                continue
            req = pb.LeaseTasksRequest(
                worker_id=self.worker_id, max_tasks=free, wait_ms=self._poll_wait_ms, max_bytes=self.lease_bytes
            )
            # Handlers that returned, their outcomes on the way: their resource slots are free now.
            req.done.extend(
                pb.TaskAttempt(task_id=i, attempt=a) for i, a in itertools.islice(self._unacked.items(), MAX_DONE)
            )
            try:
                resp = await self._call("LeaseTasks", req, timeout=self._poll_wait_ms / 1000 + 30)
            except NotFound:
                log.warning("worker %s unknown to the server; registering again", self.worker_id)
                await self._register()
                continue
            except (PermissionDenied, Unauthenticated, TlsError):
                raise  # credentials or TLS refused: no retry can help, so run() fails with the reason
            except FailedPrecondition as err:
                if err.shard_endpoint:  # the pools moved to another shard
                    raise
                failures += 1
                await self._lease_refused(err, failures)
                continue
            except TRANSIENT as err:  # e.g. a server that stops mid-call: ask again
                log.warning("lease failed (%s); retrying", err)
                await self._pause_after(err)
                continue
            except Exception as err:  # e.g. RESOURCE_EXHAUSTED: a reply over the receive limit
                failures += 1
                await self._lease_refused(err, failures)
                continue
            failures = 0
            for task in resp.tasks:
                ctx = TaskContext(task)
                self._running[task.id] = (asyncio.create_task(self._execute(ctx)), ctx)

    async def _lease_refused(self, err: Exception, failures: int) -> None:
        """A LeaseTasks call failed for good: smaller replies, a backoff, and lease again."""
        self.lease_bytes = max(self.lease_bytes // 2, MIN_LEASE_BYTES)
        log.error("lease failed (%s); leasing again with max_bytes %d", err, self.lease_bytes)
        delay = min(self._retry.initial_backoff * 2 ** min(failures, 10), self._retry.max_backoff)
        await asyncio.sleep(delay * random.uniform(0.5, 1.0))

    async def _execute(self, ctx: TaskContext) -> None:
        outcome = pb.TaskOutcome(task_id=ctx.id, attempt=ctx.attempt)
        timeout_ms = ctx.task.timeout_ms
        # The server never extends the lease past the attempt's deadline: the handler is cancelled there.
        deadline = asyncio.timeout(timeout_ms / 1000 if timeout_ms > 0 else None)
        try:
            try:
                async with deadline:
                    result = await self.handler(ctx)
            except TimeoutError:
                if not deadline.expired():
                    raise
                raise TaskError(f"timed out after {timeout_ms} ms", retryable=True) from None
            data, content_type = encode_payload(result)
            if len(data) > self.max_result_bytes:
                outcome.failure.error = f"result of {len(data)} bytes exceeds max_result_bytes {self.max_result_bytes}"
                outcome.failure.retryable = False
            else:
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
            if ctx.cancel_requested.is_set():  # the server asked: the task ends CANCELLED
                outcome.cancelled.reason = "cancelled"
            elif self._stopping.is_set():  # shutdown: give it back unfinished
                outcome.released.reason = RELEASE_REASON
            else:  # the handler's own CancelledError: a failed attempt
                outcome.failure.error = "CancelledError: the handler was cancelled"
                outcome.failure.retryable = True
        except Exception as err:
            outcome.failure.error = f"{type(err).__name__}: {err}"
            outcome.failure.retryable = True
        finally:
            self._running.pop(ctx.id, None)
            self._slot_free.set()
        if ctx._lost:  # no longer ours (or released already at shutdown)
            return
        self._report(outcome)

    def _report(self, outcome: pb.TaskOutcome) -> None:
        self._unacked[outcome.task_id] = outcome.attempt
        self._outcomes.append(outcome)
        self._outcome_ready.set()

    def _next_batch(self) -> list[pb.TaskOutcome]:
        """The oldest outcomes that fit one FinishTasks request: at most MAX_FINISH_BATCH of
        them and MAX_REQUEST_BYTES serialized (one outcome always goes, alone if need be)."""
        size = len(self.worker_id.encode()) + OUTCOME_FRAMING_BYTES
        n = 0
        for o in self._outcomes:
            if n == MAX_FINISH_BATCH:
                break
            size += o.ByteSize() + OUTCOME_FRAMING_BYTES
            if n and size > MAX_REQUEST_BYTES:
                break
            n += 1
        batch, self._outcomes = self._outcomes[:n], self._outcomes[n:]
        return batch

    async def _flush_loop(self) -> None:
        """One FinishTasks call in flight; outcomes that arrive meanwhile form the next batch.

        No outcome is dropped unless the server refuses it alone: a request refused as a
        whole is sent again in halves, and transient failures are retried.
        """
        again: list[list[pb.TaskOutcome]] = []  # batches to send before new outcomes; last first
        while True:
            await self._outcome_ready.wait()
            if (
                self._finish_linger > 0
                and self._running  # none running: no outcome is coming to join this report
                and len(self._outcomes) < MAX_FINISH_BATCH
                and not self._stopping.is_set()
            ):
                await asyncio.sleep(self._finish_linger)  # let more outcomes join this report
            self._outcome_ready.clear()
            while again or self._outcomes:
                batch = again.pop() if again else self._next_batch()
                req = pb.FinishTasksRequest(worker_id=self.worker_id, outcomes=batch)
                try:
                    resp = await self._call("FinishTasks", req)
                except NotFound:
                    await self._register()
                    again.append(batch)
                    continue
                except TRANSIENT as err:
                    # Reports are fenced by attempt, so sending one again is safe; dropping it would
                    # leave the task to its lease expiry and run it twice.
                    log.warning("finish report of %d task(s) failed (%s); retrying", len(batch), err)
                    again.append(batch)
                    await self._pause_after(err)
                    continue
                except (PermissionDenied, Unauthenticated, TlsError) as err:
                    # Not the report's fault: kept and sent again (leasing stops the worker meanwhile).
                    log.error("finish report of %d task(s) refused (%s); retrying", len(batch), err)
                    again.append(batch)
                    await asyncio.sleep(self._retry.max_backoff)
                    continue
                except Exception as err:  # refused as a whole, e.g. RESOURCE_EXHAUSTED, INVALID_ARGUMENT
                    if len(batch) > 1:
                        half = len(batch) // 2
                        log.warning(
                            "finish report of %d task(s) refused (%s); sending it again in halves", len(batch), err
                        )
                        again += [batch[half:], batch[:half]]
                        continue
                    o = batch[0]
                    log.error("outcome of task %d (attempt %d) refused, dropped: %s", o.task_id, o.attempt, err)
                    resp = None
                for o in batch:
                    if self._unacked.get(o.task_id) == o.attempt:
                        del self._unacked[o.task_id]
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
