"""The async Worker: register, then one Work stream to the server: credits for its free
slots (so it never holds more tasks than its concurrency, plus its prefetch), tasks down in
answers bounded in bytes, outcomes batched and split by size, heartbeats; the stream opened again after a
failure; what handlers report (progress, checkpoints) carried by heartbeats; and a graceful
shutdown that gives unfinished tasks back to the server.

    async def handle(task: cronoq.TaskContext) -> dict:
        return {"doubled": task.payload["n"] * 2}

    await cronoq.Worker("http://127.0.0.1:7070", "default", handle, concurrency=32).run()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import socket
import threading
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from decimal import Decimal
from typing import Any

import grpc

from . import _tracing
from ._text import control_character
from ._transport import (
    HEALTHY_STREAM_S,
    MAX_MESSAGE_BYTES,
    Backoff,
    Connection,
    Endpoint,
    KeepaliveConfig,
    RetryConfig,
    TlsConfig,
    call_once,
)
from .client import DependencyResult, Task, TaskRefLike, decode, dependencies_of, encode_payload, task_spec
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
from .v1 import task_pb2, worker_service_pb2_grpc
from .v1 import worker_service_pb2 as pb
from .v1.task_service_pb2 import SubmitTaskRequest

log = logging.getLogger("cronoq.worker")

MAX_REDIRECTS = 3
# Failures of a worker's own calls that say nothing about the request: they are retried.
TRANSIENT = (Unavailable, Cancelled, DeadlineExceeded, Internal, Unknown)
MAX_FINISH_BATCH = 1000
# The deadline of a task without a timeout.
_NO_DEADLINE = contextlib.nullcontext()
# The most tasks a worker holds (concurrency + prefetch): the credits a Work stream may carry.
MAX_HELD = 100_000
# A worker's default prefetch, in tasks a slot (at concurrency 64 on PostgreSQL, no-op tasks:
# prefetch 64 drains at 0.8x prefetch 256, and 1,024 no faster than 256).
PREFETCH_PER_SLOT = 4


def default_prefetch(concurrency: int) -> int:
    """A worker's prefetch when none is given: PREFETCH_PER_SLOT tasks a slot (fewer when
    both would pass MAX_HELD). The server sends it beyond its free slots only what it starts
    within about a step (WorkRequest.slots), so a worker with slow handlers holds nothing."""
    return min(PREFETCH_PER_SLOT * concurrency, MAX_HELD - concurrency)


MiB = 1 << 20
# What a server that does not say otherwise (RegisterWorkerResponse fields left 0) allows.
DEFAULT_MAX_RESULT_BYTES = 4 * MiB
DEFAULT_MAX_LEASE_BYTES = 16 * MiB
DEFAULT_MAX_CHECKPOINT_BYTES = 256 << 10
# A progress message's bound, in UTF-8 bytes; and the longest snooze (TaskSnoozed.snooze_ms is a uint32).
MAX_PROGRESS_MESSAGE_BYTES = 1024
MAX_SNOOZE_MS = 0xFFFF_FFFF
# Room left under MAX_MESSAGE_BYTES (the channel's send and receive limit) for what a
# message carries besides its tasks or outcomes.
MESSAGE_MARGIN_BYTES = 1 * MiB
MAX_REQUEST_BYTES = MAX_MESSAGE_BYTES - MESSAGE_MARGIN_BYTES
# A LeaseTasks call that fails for good halves max_bytes, down to this.
MIN_LEASE_BYTES = 1 * MiB
# Bytes an outcome or a report adds to a message besides its own: tag and length prefix.
OUTCOME_FRAMING_BYTES = 16
RELEASE_REASON = "worker shut down"
# After the shutdown grace: how long cancelled handlers get to unwind, and the whole
# time left (from the end of the grace) for them and for the last outcome reports.
UNWIND_S = 1.0
STOP_EXTRA_S = 3.0
DEREGISTER_TIMEOUT_S = 2.0


def task_fields(task_id: int, attempt: int = 0, pool: str = "") -> dict[str, Any]:
    """A log record's structured fields for one task (the names the server's JSON logs use):
    task_id (a decimal string), and attempt and pool when known."""
    fields: dict[str, Any] = {"task_id": str(task_id)}
    if attempt:
        fields["attempt"] = attempt
    if pool:
        fields["pool"] = pool
    return fields


class WorkerLog(logging.LoggerAdapter[logging.Logger]):
    """The cronoq.worker logger as one worker uses it: each record carries the structured field
    worker_id (once registered) and those a call gives in `extra` (task_fields)."""

    def __init__(self, worker: Worker):
        super().__init__(log)
        self.worker = worker

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        fields = {"worker_id": self.worker.worker_id} if self.worker.worker_id else {}
        kwargs["extra"] = {**fields, **(kwargs.get("extra") or {})}
        return msg, kwargs


class TaskError(Exception):
    """Raise from a handler to fail the attempt.

    retryable=False ends the task FAILED whatever attempts remain; retry_after (seconds)
    overrides the pool's backoff for the next attempt.
    """

    def __init__(self, message: str, *, retryable: bool = True, retry_after: float | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


class Snooze(Exception):
    """Raise from a handler to say "not now, try again in `seconds`": the task is PENDING
    again, due then, and the attempt does not count (Task.snoozes counts snoozes).

    seconds is rounded down to whole ms (from the decimal the float prints as: 4.35 is
    4350 ms); 0 makes it due at once. ValueError: seconds negative, not finite, or over
    4294967.295 (TaskSnoozed.snooze_ms is a uint32).
    """

    def __init__(self, seconds: float, reason: str = ""):
        finite = math.isfinite(seconds) and seconds >= 0
        ms = int(Decimal(repr(float(seconds))) * 1000) if finite else -1
        if not 0 <= ms <= MAX_SNOOZE_MS:
            raise ValueError(f"snooze: {seconds} s, not from 0 to {MAX_SNOOZE_MS / 1000} s")
        super().__init__(f"snoozed for {ms} ms" + (f": {reason}" if reason else ""))
        self.seconds = seconds
        self.snooze_ms = ms
        self.reason = reason


class TaskContext:
    """What a handler gets: the task, its decoded payload, what its dependencies ended with, its
    cancellation, the means to report its progress and save a checkpoint, and spawn: tasks
    submitted with its success (none when it fails, snoozes or is cancelled).

    Reports are kept until the worker's next heartbeat carries them: the last progress and the
    last checkpoint, each pending until the heartbeat that carried it is answered (a stream that
    breaks first: the next stream's heartbeat carries it again); what is still pending as the
    handler ends goes with its outcome. The report methods may be called from any thread (e.g.
    a function run with asyncio.to_thread).
    """

    def __init__(self, task: Task, max_checkpoint_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES):
        self.task = task
        self.cancel_requested = asyncio.Event()
        self._lost = False
        self._released: pb.TaskOutcome | None = None  # released while its handler still ran (at a stop)
        self._max_checkpoint_bytes = max_checkpoint_bytes
        self._checkpoint = task.checkpoint  # as leased, then as saved
        # Pending reports, each with the version it was made at (reports made so far: _version).
        self._lock = threading.Lock()
        self._version = 0
        self._progress: tuple[int, task_pb2.TaskProgress] | None = None
        self._saved: tuple[int, bytes] | None = None
        self._spawned: list[SubmitTaskRequest] = []  # sent with the success outcome only

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
    def _fields(self) -> dict[str, Any]:
        return task_fields(self.id, self.attempt, self.pool)

    @property
    def payload(self) -> Any:
        """The JSON value for JSON payloads, else the bytes."""
        return decode(self.task.payload, self.task.content_type)

    @property
    def snoozes(self) -> int:
        """How many times handlers snoozed the task (snoozes are not attempts)."""
        return self.task.snoozes

    @functools.cached_property
    def dependencies(self) -> list[DependencyResult]:
        """How each task it depends on ended, in depends_on order: id, key, state, value (its
        result: the JSON value of a JSON result, else bytes; None when it has none) and error.
        A task that runs when they ended (run_when "ended") sees FAILED and CANCELLED ones too."""
        return dependencies_of(self.task)

    @property
    def dependency_results(self) -> dict[int, Any]:
        """Each dependency's result value by its id."""
        return {d.id: d.value for d in self.dependencies}

    def dependency(self, key_or_id: TaskRefLike) -> Any:
        """The result value of the dependency with this key (str) or id (int). KeyError: the task
        does not depend on it (or it was deleted)."""
        field = "key" if isinstance(key_or_id, str) else "id"
        for d in self.dependencies:
            if key_or_id != "" and getattr(d, field) == key_or_id:
                return d.value
        raise KeyError(f"{key_or_id!r} is not a dependency of task {self.id}")

    def spawn(
        self,
        pool: str,
        payload: Any = None,
        *,
        key: str | None = None,
        depends_on: Sequence[TaskRefLike] = (),
        run_when: str | int | None = None,
        priority: int = 0,
        content_type: str | None = None,
    ) -> None:
        """Submits a task with this handler's success: the server creates it as the task ends
        SUCCEEDED, in the same transaction, with parent_id this task's id; nothing is created
        when the handler fails, snoozes or is cancelled, nor when the success is refused.
        payload: bytes, or any JSON value (content_type: another type for bytes). depends_on:
        keys (str) of tasks spawned with it, and ids (int), e.g. this task's own (ctx.id).
        run_when: as submit's. The server fails the attempt, not retryable, when it cannot
        create them (a pool of another shard, a permission, more than its max_batch_size)."""
        req = task_spec(pool, payload, key=key, priority=priority, depends_on=depends_on, run_when=run_when)
        if content_type is not None:
            req.content_type = content_type
        _tracing.set_current_trace(req)  # the handler's span: the children continue its trace
        with self._lock:
            self._spawned.append(req)

    @property
    def checkpoint(self) -> bytes | None:
        """The task's checkpoint: the last one saved, by this handler or an earlier attempt's
        (the next attempt gets it); None when there is none."""
        return self._checkpoint or None

    def report_progress(self, value: float, message: str = "") -> None:
        """Reports the handler's progress: any finite number (commonly a fraction from 0 to 1)
        and a message. ValueError, and nothing recorded: a value that is not finite, a message
        over 1,024 bytes (UTF-8) or with control characters, line separators (U+2028, U+2029) or
        bidi controls (the server refuses those)."""
        progress = task_pb2.TaskProgress(value=value, message=message)
        if not math.isfinite(progress.value):
            raise ValueError(f"progress value: {value}, not a finite number")
        size = len(progress.message.encode())
        if size > MAX_PROGRESS_MESSAGE_BYTES:
            raise ValueError(f"progress message: {size} bytes, more than {MAX_PROGRESS_MESSAGE_BYTES}")
        bad = control_character(progress.message)
        if bad is not None:
            raise ValueError(f"progress message: control character {bad!r}")
        with self._lock:
            self._version += 1
            self._progress = (self._version, progress)

    def save_checkpoint(self, data: bytes) -> None:
        """Saves the task's checkpoint (empty: none), which the next attempt's handler gets.
        ValueError, and nothing recorded: more than the server's max_checkpoint_bytes (256 KiB)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"checkpoint: bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) > self._max_checkpoint_bytes:
            raise ValueError(
                f"checkpoint: {len(data)} bytes, more than max_checkpoint_bytes {self._max_checkpoint_bytes}"
            )
        with self._lock:
            self._version += 1
            self._checkpoint = data
            self._saved = (self._version, data)

    def _pending(self) -> tuple[pb.TaskReport | None, int]:
        """What is pending, as a report (None: nothing), and the version it goes up to."""
        with self._lock:
            if self._progress is None and self._saved is None:
                return None, self._version
            report = pb.TaskReport(task_id=self.id, attempt=self.attempt)
            if self._progress is not None:
                report.progress.CopyFrom(self._progress[1])
            if self._saved is not None:
                report.checkpoint = self._saved[1]
            return report, self._version

    def _answered(self, version: int) -> None:
        """A heartbeat that carried the reports up to version was answered: they are no longer
        pending; one made since (which replaced it) is."""
        with self._lock:
            if self._progress is not None and self._progress[0] <= version:
                self._progress = None
            if self._saved is not None and self._saved[0] <= version:
                self._saved = None

    def _end(self, outcome: pb.TaskOutcome) -> None:
        """The handler ended: what is still pending goes with its outcome, and is dropped."""
        report, version = self._pending()
        if report is not None:
            outcome.report.CopyFrom(report)
        self._answered(version)


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
        prefetch: int | None = None,
        name: str | None = None,
        token: str | None = None,
        tls: TlsConfig | None = None,
        retry: RetryConfig = RetryConfig(max_elapsed=None),
        insecure_redirect_http: bool = False,
        labels: dict[str, str] | None = None,
        shutdown_grace: float = 30.0,
        finish_linger: float = 0.002,
        keepalive: KeepaliveConfig = KeepaliveConfig(),
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency: {concurrency} must be at least 1")
        if prefetch is None:
            prefetch = default_prefetch(concurrency)
        if prefetch < 0 or concurrency + prefetch > MAX_HELD:
            raise ValueError(f"prefetch: {prefetch} must be at least 0, and concurrency + prefetch at most {MAX_HELD}")
        self._conn = Connection(
            endpoint,
            worker_service_pb2_grpc.WorkerServiceStub,
            token=token,
            tls=tls,
            insecure_redirect_http=insecure_redirect_http,
            keepalive=keepalive,
        )
        self.pools = [pools] if isinstance(pools, str) else list(pools)
        self.handler = handler
        self.concurrency = concurrency
        self.prefetch = prefetch
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self._retry = retry
        self._labels = labels or {}
        self._shutdown_grace = shutdown_grace
        self._finish_linger = finish_linger
        self.worker_id = ""
        self._log = WorkerLog(self)
        self._heartbeat_s = 10.0
        # Set from the server's RegisterWorkerResponse (defaults for an older server).
        self.max_result_bytes = DEFAULT_MAX_RESULT_BYTES
        self.max_checkpoint_bytes = DEFAULT_MAX_CHECKPOINT_BYTES
        self._max_lease_bytes = DEFAULT_MAX_LEASE_BYTES
        self.lease_bytes = DEFAULT_MAX_LEASE_BYTES  # LeaseTasksRequest.max_bytes now
        self._running: dict[int, tuple[asyncio.Task[None], TaskContext]] = {}
        # Prefetched: leased to this worker, waiting for a slot, with the loop time each came.
        self._held: OrderedDict[int, tuple[TaskContext, float]] = OrderedDict()
        self._unacked: dict[int, pb.TaskOutcome] = {}  # by task id: reported, not yet answered
        self._unacked_pools: dict[int, str] = {}  # their pools (for the logs)
        self._outcomes: list[pb.TaskOutcome] = []  # not yet sent on the current stream
        # The heartbeats sent on the current stream and not yet answered, oldest first: the
        # handlers whose reports each carried, with the version carried.
        self._beats: deque[list[tuple[TaskContext, int]]] = deque()
        self._freed = 0  # slots freed and not yet given to the server as credits
        self._closed = False  # the current stream's side is closed: nothing more can be reported
        self._stream_answered = False  # the current stream delivered a message: it is healthy
        self._beat_due = False
        self._wake = asyncio.Event()  # the sender has something to send
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
        redirects = 0
        chain = [str(self._conn.current)]  # the servers of the redirects in a row, and where each sent it
        req = pb.RegisterWorkerRequest(
            name=self.name, pools=self.pools, concurrency=self.concurrency, labels=self._labels
        )
        backoff = Backoff(self._retry, f"worker registration for {self.pools}", self._log)
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
                self._log.info("shard %s serves %s: reconnecting to %s", err.shard, self.pools, target)
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
                await asyncio.sleep(backoff.failed(err))
                continue
            backoff.succeeded()
            self.worker_id = resp.worker_id
            self._heartbeat_s = max(resp.heartbeat_interval_ms / 1000, 0.1)
            # A result, or a checkpoint, must also fit one message on its own.
            self.max_result_bytes = min(resp.max_result_bytes or DEFAULT_MAX_RESULT_BYTES, MAX_REQUEST_BYTES)
            self.max_checkpoint_bytes = min(
                resp.max_checkpoint_bytes or DEFAULT_MAX_CHECKPOINT_BYTES, MAX_REQUEST_BYTES
            )
            # A reply must fit what this channel receives.
            self._max_lease_bytes = min(resp.max_lease_bytes or DEFAULT_MAX_LEASE_BYTES, MAX_REQUEST_BYTES)
            self.lease_bytes = self._max_lease_bytes
            self._log.info(
                "worker %s registered with shard %s at %s for %s", self.worker_id, resp.shard, self.endpoint, self.pools
            )
            return

    # -- running --------------------------------------------------------------

    def stop(self) -> None:
        """Stops taking tasks; run() returns once running tasks finish and are reported.

        A task still running after shutdown_grace seconds has its handler cancelled and is
        released: the server makes it PENDING again at once, without counting the attempt.
        run() returns within about shutdown_grace + STOP_EXTRA_S seconds.
        """
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        await self._register()
        heartbeats = asyncio.create_task(self._heartbeat_loop())
        working = asyncio.create_task(self._work_loop())
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if working.done() and working.exception():
                raise working.exception()  # type: ignore[misc]
        finally:
            self._stopping.set()  # also when the stream failed for good: unfinished tasks are released
            stopping.cancel()
            await self._finish_running(working)
            heartbeats.cancel()
            await asyncio.gather(heartbeats, return_exceptions=True)
            await self._deregister()
            await self._conn.close()

    async def _finish_running(self, working: asyncio.Task[None]) -> None:
        """Graceful shutdown: running tasks finish within the grace, the others are released;
        then every outcome is reported and the stream closed, for at most STOP_EXTRA_S more
        seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._shutdown_grace + STOP_EXTRA_S
        if self._held:
            self._log.info("worker %s: releasing %d prefetched task(s)", self.worker_id, len(self._held))
        while self._held:
            task_id, (ctx, _) = self._held.popitem(last=False)
            self._report(pb.TaskOutcome(task_id=task_id, attempt=ctx.attempt, released=_released()), ctx.pool)
        if self._running:
            self._log.info("worker %s: waiting for %d running task(s)", self.worker_id, len(self._running))
            tasks = [t for t, _ in self._running.values()]
            _, pending = await asyncio.wait(tasks, timeout=self._shutdown_grace)
            if pending:
                self._log.warning(
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
                        self._log.warning(
                            "task %d: handler ignores cancellation; releasing the task", task_id, extra=ctx._fields
                        )
                        ctx._lost = True  # whatever it returns later is not reported
                        self._running.pop(task_id, None)
                        outcome = pb.TaskOutcome(task_id=task_id, attempt=ctx.attempt, released=_released())
                        ctx._released = outcome  # its span's outcome, when the handler returns
                        ctx._end(outcome)
                        self._report(outcome, ctx.pool)
        self._wake.set()  # the stream closes its side once every outcome is answered
        if not working.done():
            await asyncio.wait({working}, timeout=max(deadline - loop.time(), 0))
        working.cancel()
        await asyncio.gather(working, return_exceptions=True)
        if self._unacked:
            self._log.warning(
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
                self._log.debug("deregister failed: %s", err)

    @property
    def _finished(self) -> bool:
        """Stopping, and nothing left to run or to report."""
        return self._stopping.is_set() and not self._running and not self._held and not self._unacked

    async def _work_loop(self) -> None:
        """Work streams one after the other until the worker stops: a stream that fails is
        opened again (on the server an UNAVAILABLE names) after a backoff that grows with the
        failures in a row and starts over after a healthy stream (one that delivered a message
        or stayed open HEALTHY_STREAM_S); outcomes it did not answer are sent again on the next
        (fenced by attempt, so that is safe)."""
        backoff = Backoff(self._retry, f"worker {self.worker_id}: work stream", self._log)
        loop = asyncio.get_running_loop()
        while not self._finished:
            opened, self._stream_answered = loop.time(), False
            error: CronoqError | None = None
            try:
                await self._work_stream()
            except (PermissionDenied, Unauthenticated, TlsError):
                raise  # credentials or TLS refused: no retry can help, so run() fails with the reason
            except FailedPrecondition as err:
                if err.shard_endpoint:  # the pools moved shard
                    raise
                error = err
            except CronoqError as err:
                error = err
            if self._stream_answered or loop.time() - opened >= HEALTHY_STREAM_S:
                backoff.succeeded()
            if self._finished:
                return
            if error is None:  # the server ended it cleanly: opened again, but not in a loop
                error = Unavailable("the server ended the stream")
            elif isinstance(error, Unavailable):
                failure = await self._conn.diagnose(error)
                if failure is not None:
                    raise failure from None
                self._conn.on_unavailable(error)  # to the leader a standby names, or the next endpoint
            elif not isinstance(error, (NotFound, *TRANSIENT)):  # e.g. RESOURCE_EXHAUSTED: an answer over the limit
                self.lease_bytes = max(self.lease_bytes // 2, MIN_LEASE_BYTES)
                self._log.error("work stream failed (%s); opening it again with max_bytes %d", error, self.lease_bytes)
            await asyncio.sleep(backoff.failed(error))
            if isinstance(error, NotFound):
                self._log.warning("worker %s unknown to the server; registering again", self.worker_id)
                await self._register()

    async def _work_stream(self) -> None:
        """One Work stream: its first message gives the free slots; the sender sends outcomes,
        freed slots and heartbeats; tasks and answers are read here until the server ends it."""
        call = self._conn.rpc("Work")(metadata=self._conn.metadata)
        self._outcomes = list(self._unacked.values())  # what an earlier stream did not answer
        self._beats.clear()  # reports an earlier stream did not answer are still pending: sent again
        self._freed = 0
        self._closed = False
        held = len(self._running) + len(self._held)
        free = 0 if self._stopping.is_set() else self.concurrency + self.prefetch - held
        first = pb.WorkRequest(
            worker_id=self.worker_id, credits=free, max_bytes=self.lease_bytes, slots=self.concurrency
        )
        if self._outcomes:
            self._wake.set()  # sent right after the first message
        sender = asyncio.create_task(self._send_loop(call, first))
        try:
            while True:
                answer = await call_once(call.read)
                if answer is grpc.aio.EOF:  # type: ignore[attr-defined]
                    break
                if answer is None:  # grpc could not deserialize it (logged by grpc)
                    raise CronoqError("an answer on the Work stream could not be read")
                self._stream_answered = True
                self._answered(answer)
            if sender.done() and sender.exception():
                raise sender.exception()  # type: ignore[misc]
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            call.cancel()

    async def _send_loop(self, call: Any, first: pb.WorkRequest) -> None:
        """Sends the stream's messages: outcomes (lingering a moment while handlers run, so
        more join), the slots handlers freed, heartbeats with the handlers' reports; closes its
        side once stopping and every outcome is answered."""
        message: pb.WorkRequest | None = first
        while True:
            if message is not None:
                try:
                    await call.write(message)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    return  # the stream ended: the reader sees why
            if self._finished:
                # Closing: every outcome is answered; a task sent from now on is dropped, and
                # the server, told so, releases it as the stream ends.
                self._closed = True
                try:
                    await call.write(pb.WorkRequest(closing=True))
                    await call.done_writing()
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    pass  # the stream ended: the reader sees why
                return
            await self._wake.wait()
            if (
                self._finish_linger > 0
                and self._outcomes
                and self._running  # none running: no outcome is coming to join this report
                and len(self._outcomes) < MAX_FINISH_BATCH
                and not self._stopping.is_set()
            ):
                await asyncio.sleep(self._finish_linger)
            self._wake.clear()
            message = pb.WorkRequest(outcomes=self._next_batch())
            if not self._stopping.is_set():
                message.credits, self._freed = self._freed, 0
            if self._beat_due:
                self._beat_due = False
                attempts = [pb.TaskAttempt(task_id=i, attempt=c.attempt) for i, (_, c) in self._running.items()]
                attempts += [pb.TaskAttempt(task_id=i, attempt=c.attempt) for i, (c, _) in self._held.items()]
                attempts += [pb.TaskAttempt(task_id=i, attempt=o.attempt) for i, o in self._unacked.items()]
                message.heartbeat.tasks.extend(attempts)
                self._beats.append(self._carry_reports(message))
            if self._outcomes:
                self._wake.set()  # the rest in the next message
            if not (message.outcomes or message.credits or message.HasField("heartbeat")):
                message = None

    def _carry_reports(self, message: pb.WorkRequest) -> list[tuple[TaskContext, int]]:
        """Puts the pending report of each running handler in the message's heartbeat, as many
        as fit under MAX_REQUEST_BYTES (the others wait for the next heartbeat); returns what
        it carried."""
        carried: list[tuple[TaskContext, int]] = []
        room: int | None = None  # what the message has room for, once a report is pending
        for _, ctx in self._running.values():
            report, version = ctx._pending()
            if report is None:
                continue
            if room is None:
                room = MAX_REQUEST_BYTES - message.ByteSize()
            size = report.ByteSize() + OUTCOME_FRAMING_BYTES
            if size > room:
                continue
            room -= size
            message.heartbeat.reports.append(report)
            carried.append((ctx, version))
        return carried

    def _answered(self, answer: pb.WorkResponse) -> None:
        """What the server sent: tasks to run, the results of outcomes, a heartbeat's answer."""
        for r in answer.results:
            outcome = self._unacked.pop(r.task_id, None)
            pool = self._unacked_pools.pop(r.task_id, "")
            if outcome is not None:
                self.processed += 1
            if not r.accepted:
                fields = task_fields(r.task_id, outcome.attempt if outcome is not None else 0, pool)
                self._log.warning("outcome of task %d refused: %s %s", r.task_id, r.code, r.message, extra=fields)
        now = asyncio.get_running_loop().time() if answer.tasks else 0.0
        for task in answer.tasks:
            ctx = TaskContext(task, self.max_checkpoint_bytes)
            if self._closed:  # sent as the stream closed: the server releases it, as nothing can be sent
                self._log.debug(
                    "task %d arrived after the work stream closed; the server releases it", task.id, extra=ctx._fields
                )
                continue
            if self._stopping.is_set():  # sent for slots given before stop(): give it back
                self._freed += 1
                self._report(pb.TaskOutcome(task_id=task.id, attempt=task.attempt, released=_released()), task.pool)
                continue
            if len(self._running) < self.concurrency:
                self._start(ctx, now)
            else:  # prefetched: it starts as a handler ends
                self._held[task.id] = (ctx, now)
        if answer.HasField("heartbeat"):
            self._heartbeat_answered(answer.heartbeat)
        if self._finished:
            self._wake.set()

    def _start(self, ctx: TaskContext, received: float) -> None:
        self._running[ctx.id] = (asyncio.create_task(self._execute(ctx, received)), ctx)

    def _start_held(self) -> None:
        """A slot is free: the oldest prefetched task starts in it (none once stopping: they
        are released)."""
        if self._held and not self._stopping.is_set() and len(self._running) < self.concurrency:
            _, (ctx, received) = self._held.popitem(last=False)
            self._start(ctx, received)

    async def _execute(self, ctx: TaskContext, received: float) -> None:
        """Runs the task's handler in the task's span (see _tracing) and reports its outcome."""
        span = _tracing.start_task_span(ctx.task)
        reported: pb.TaskOutcome | None = None
        try:
            outcome = await self._outcome_of(ctx, received, span)
            if outcome is not None and not ctx._lost:  # lost: no longer ours (or released already at shutdown)
                ctx._end(outcome)
                self._report(outcome, ctx.pool)
                reported = outcome
        finally:
            _tracing.end_task_span(span, reported or ctx._released)

    async def _outcome_of(self, ctx: TaskContext, received: float, span: Any) -> pb.TaskOutcome | None:
        """Runs the handler, with span current, and returns its outcome (None: the lease was lost)."""
        outcome = pb.TaskOutcome(task_id=ctx.id, attempt=ctx.attempt)
        timeout_ms = ctx.task.timeout_ms
        # The server never extends the lease past the attempt's deadline, which counts from the
        # lease: the handler is cancelled there (a prefetched task's wait counts too). None
        # without a timeout: no Timeout a task (it looks up the current task on entry).
        deadline = None
        try:
            try:
                if timeout_ms > 0:
                    left = timeout_ms / 1000 - (asyncio.get_running_loop().time() - received)
                    if left <= 0:  # prefetched, and its time ran out before a slot freed
                        raise TaskError(f"timed out after {timeout_ms} ms, before it could start", retryable=True)
                    deadline = asyncio.timeout(left)
                async with deadline or _NO_DEADLINE:
                    with _tracing.active(span):
                        result = await self.handler(ctx)
            except TimeoutError:
                if deadline is None or not deadline.expired():
                    raise
                raise TaskError(f"timed out after {timeout_ms} ms", retryable=True) from None
            data, content_type = encode_payload(result)
            if len(data) > self.max_result_bytes:
                outcome.failure.error = f"result of {len(data)} bytes exceeds max_result_bytes {self.max_result_bytes}"
                outcome.failure.retryable = False
            else:
                outcome.success.result = data
                outcome.success.content_type = content_type
                with ctx._lock:
                    outcome.success.spawn.extend(ctx._spawned)
        except Snooze as snooze:
            outcome.snoozed.CopyFrom(pb.TaskSnoozed(snooze_ms=snooze.snooze_ms, reason=snooze.reason))
        except TaskError as err:
            outcome.failure.error = str(err)
            outcome.failure.retryable = err.retryable
            if err.retry_after is not None:
                outcome.failure.retry_after_ms = max(int(err.retry_after * 1000), 1)
        except asyncio.CancelledError:
            if ctx._lost:
                return None
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
            if self._running.pop(ctx.id, None) is not None:
                self._freed += 1
                self._wake.set()
                self._start_held()
        return outcome

    def _report(self, outcome: pb.TaskOutcome, pool: str) -> None:
        self._unacked[outcome.task_id] = outcome
        self._unacked_pools[outcome.task_id] = pool
        self._outcomes.append(outcome)
        self._wake.set()

    def _next_batch(self) -> list[pb.TaskOutcome]:
        """The oldest outcomes that fit one message: at most MAX_FINISH_BATCH of them and
        MAX_REQUEST_BYTES serialized (one outcome always goes, alone if need be)."""
        size = OUTCOME_FRAMING_BYTES
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

    async def _heartbeat_loop(self) -> None:
        """Asks the stream's sender for a heartbeat of the attempts held, every interval."""
        while True:
            await asyncio.sleep(self._heartbeat_s)
            self._beat_due = True
            self._wake.set()

    def _heartbeat_answered(self, resp: pb.HeartbeatResponse) -> None:
        # Taken as the answer to the oldest heartbeat not yet answered, whose reports are then no
        # longer pending: the server may answer several in one, or a later one first, and each
        # later one carried the same reports or newer.
        if self._beats:
            for ctx, version in self._beats.popleft():
                ctx._answered(version)
        for task_id in resp.cancelled_task_ids:
            if task_id in self._held:  # never started: it ends CANCELLED without its handler
                ctx, _ = self._held.pop(task_id)
                self._freed += 1
                cancelled = pb.TaskCancelled(reason="cancelled")
                self._report(pb.TaskOutcome(task_id=task_id, attempt=ctx.attempt, cancelled=cancelled), ctx.pool)
            if task_id in self._running:
                handle, ctx = self._running[task_id]
                ctx.cancel_requested.set()
                handle.cancel()
        for task_id in resp.lost_task_ids:
            held = self._held.pop(task_id, None)
            if held is not None:
                self._freed += 1
                self._wake.set()
                self._log.warning("task %d lost its lease before it started", task_id, extra=held[0]._fields)
            if task_id in self._running:
                handle, ctx = self._running[task_id]
                ctx._lost = True
                handle.cancel()
                self._log.warning(
                    "task %d lost its lease; its outcome will not be reported", task_id, extra=ctx._fields
                )
