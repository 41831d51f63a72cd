"""The Worker against a fake WorkerService speaking the Work stream: credits that bound the
tasks sent, answers bounded in bytes, outcomes batched by size and sent again after a stream
fails, heartbeats on the stream, oversized results, a shutdown that releases unfinished
tasks within a bounded time, and what handlers report: snoozes, progress and checkpoints."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

import cronoq
from cronoq import worker as worker_mod
from cronoq._transport import Backoff, backoff_delay
from cronoq.v1 import task_pb2, worker_service_pb2_grpc
from cronoq.v1 import worker_service_pb2 as pb

MiB = 1 << 20
FAST = cronoq.RetryConfig(initial_backoff=0.001, max_backoff=0.01, max_elapsed=None)
POLL_S = 0.005  # how often an idle fake stream looks at its script again
UNREADABLE = object()  # in a script: an answer grpc cannot deserialize (read() returns None)
HALF_CLOSE = object()  # in a stream's inbox: the worker called done_writing()


def rpc_error(code: grpc.StatusCode, details: str = "", trailing: Any = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


def task(task_id: int, payload: Any = None, attempt: int = 1, **fields: Any) -> task_pb2.Task:
    data = json.dumps(payload).encode() if payload is not None else b""
    return task_pb2.Task(
        id=task_id,
        pool="default",
        attempt=attempt,
        payload=data,
        content_type="application/json" if data else "",
        **fields,
    )


class FakeStream:
    """One Work call: what the worker writes is recorded and answered by `_serve`, which also
    sends the script's tasks within the credits; read() returns the answers in order, then
    the stream's end (a scripted error, or EOF once the worker half-closed)."""

    def __init__(self, service: FakeWorkerService, metadata: Any):
        self.service = service
        self.metadata = metadata
        self.requests: list[pb.WorkRequest] = []
        self.credits = 0  # given by the worker and not yet used by a task
        self.sent: list[int] = []  # ids of the tasks sent on this stream
        self.cancelled = False
        self.ended: Any = None  # the error or EOF that ended the stream
        self.withheld = 0  # heartbeats received and not answered (service.hold_heartbeats)
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._answers: asyncio.Queue[Any] = asyncio.Queue()
        self._serving = asyncio.create_task(self._serve())

    @property
    def first(self) -> pb.WorkRequest:
        return self.requests[0]

    async def write(self, request: pb.WorkRequest) -> None:
        if isinstance(self.ended, grpc.aio.AioRpcError):
            raise self.ended
        if self.ended is not None or self.cancelled:
            raise asyncio.InvalidStateError("the stream has ended")
        self._inbox.put_nowait(request)

    async def done_writing(self) -> None:
        self._inbox.put_nowait(HALF_CLOSE)

    async def read(self) -> Any:
        answer = await self._answers.get()
        if isinstance(answer, BaseException):
            self._answers.put_nowait(answer)  # a later read raises it again, as grpc does
            raise answer
        if answer is grpc.aio.EOF:
            self._answers.put_nowait(answer)
        return answer

    def cancel(self) -> bool:
        self.cancelled = True
        self._serving.cancel()
        return True

    def answer_withheld(self) -> None:
        """Answers the oldest heartbeat withheld."""
        assert self.withheld, "no heartbeat withheld"
        self.withheld -= 1
        self._answers.put_nowait(pb.WorkResponse(heartbeat=pb.HeartbeatResponse()))

    def _end(self, end: Any) -> None:
        self.ended = end
        self._answers.put_nowait(end)

    def _send(self, answer: pb.WorkResponse, tasks: list[task_pb2.Task]) -> None:
        # The protocol's central promise: never more tasks than the worker gave credits for.
        assert len(tasks) <= self.credits, f"{len(tasks)} tasks for {self.credits} credits"
        self.credits -= len(tasks)
        self.sent += [t.id for t in tasks]
        self.service.sent += [t.id for t in tasks]
        answer.tasks.extend(tasks)

    async def _serve(self) -> None:
        try:
            while True:
                try:
                    request = await asyncio.wait_for(self._inbox.get(), POLL_S)
                except TimeoutError:
                    request = None
                if request is HALF_CLOSE:
                    self._end(grpc.aio.EOF)
                    return
                answer = pb.WorkResponse()
                if request is not None:
                    try:
                        await self._received(request, answer)
                    except grpc.aio.AioRpcError as err:  # a stream that fails before answering
                        self._end(err)
                        return
                if self.requests and self.service.script:  # nothing is sent before the first message
                    step = self.service.script[0]
                    if isinstance(step, BaseException):
                        self.service.script.pop(0)
                        self._end(step)
                        return
                    if step is UNREADABLE:
                        self.service.script.pop(0)
                        self._answers.put_nowait(None)
                        continue
                    n = min(self.credits, len(step))
                    self._send(answer, step[:n])
                    self.service.script[0] = step[n:]
                    if not self.service.script[0]:
                        self.service.script.pop(0)
                if answer.tasks or answer.results or answer.HasField("heartbeat"):
                    self._answers.put_nowait(answer)
        except Exception as err:  # a broken fake (e.g. a failed assert): run() fails with it
            self.service.errors.append(err)
            self._end(err)

    async def _received(self, request: pb.WorkRequest, answer: pb.WorkResponse) -> None:
        if not self.requests:
            assert request.worker_id == self.service.register_resp.worker_id, "the first message names the worker"
        self.requests.append(request)
        self.service.requests.append(request)
        self.credits += request.credits
        if request.outcomes:
            kinds = [(o.task_id, o.WhichOneof("outcome")) for o in request.outcomes]
            self.service.reports.append((request.ByteSize(), kinds))
            answer.results.extend(await self.service.finish(request))
        if request.HasField("heartbeat"):
            self.service.heartbeats.append([(t.task_id, t.attempt) for t in request.heartbeat.tasks])
            if self.service.hold_heartbeats:
                self.withheld += 1
                return
            cancels, self.service.heartbeat_cancels = self.service.heartbeat_cancels, []
            losts, self.service.heartbeat_losts = self.service.heartbeat_losts, []
            answer.heartbeat.SetInParent()
            answer.heartbeat.cancelled_task_ids.extend(cancels)
            answer.heartbeat.lost_task_ids.extend(losts)


class FakeWorkerService:
    """A scripted WorkerService. `script` holds what its Work streams send, in order: task
    lists (sent as the worker's credits allow, the rest of a list when more arrive), errors
    that end the current stream, or UNREADABLE. `finish` answers the outcomes of each message
    (default: accept them all); raising an AioRpcError ends the stream without answering."""

    def __init__(self, register: pb.RegisterWorkerResponse | None = None):
        self.register_resp = register or pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=60_000)
        self.script: list[Any] = []  # task lists, errors, UNREADABLE
        self.streams: list[FakeStream] = []
        self.requests: list[pb.WorkRequest] = []  # every message of every stream
        self.sent: list[int] = []  # ids of the tasks sent, on every stream
        self.finish: Callable[[pb.WorkRequest], Awaitable[list[pb.FinishTaskResult]]] = self.accept
        self.reports: list[tuple[int, list[tuple[int, str]]]] = []  # (ByteSize, [(task id, kind)]) per message
        self.accepted: Counter[int] = Counter()
        self.outcomes: dict[int, pb.TaskOutcome] = {}  # accepted, by task id
        self.heartbeats: list[list[tuple[int, int]]] = []  # the (task id, attempt) pairs of each
        self.heartbeat_cancels: list[int] = []  # for the next heartbeat answer
        self.heartbeat_losts: list[int] = []
        self.hold_heartbeats = False  # heartbeats are not answered (FakeStream.answer_withheld)
        self.registrations = 0
        self.deregistered = False
        self.errors: list[BaseException] = []  # the fake's own failures

    def fail_reports(self, *errors: BaseException) -> None:
        """The first reports end the stream with these errors, unanswered; the rest are accepted."""
        failures = list(errors)

        async def finish(req: pb.WorkRequest) -> list[pb.FinishTaskResult]:
            if failures:
                raise failures.pop(0)
            return await self.accept(req)

        self.finish = finish

    async def accept(self, req: pb.WorkRequest) -> list[pb.FinishTaskResult]:
        for o in req.outcomes:
            self.accepted[o.task_id] += 1
            self.outcomes[o.task_id] = o
        return [pb.FinishTaskResult(task_id=o.task_id, accepted=True) for o in req.outcomes]

    async def RegisterWorker(self, req: Any, metadata: Any = None, timeout: Any = None) -> Any:
        self.registrations += 1
        return self.register_resp

    def Work(self, metadata: Any = None, timeout: Any = None) -> FakeStream:
        stream = FakeStream(self, metadata)
        self.streams.append(stream)
        return stream

    async def DeregisterWorker(self, req: Any, metadata: Any = None, timeout: Any = None) -> Any:
        self.deregistered = True
        return pb.DeregisterWorkerResponse()


def make_worker(fake: FakeWorkerService, handler: Any, **options: Any) -> cronoq.Worker:
    options.setdefault("concurrency", 8)
    options.setdefault("prefetch", 0)  # the fake sends every credit: no task held unless a test asks
    options.setdefault("retry", FAST)
    worker = cronoq.Worker("http://127.0.0.1:1", "default", handler, **options)
    worker._conn._stub = fake  # no channel: every call goes to the fake
    return worker


async def until(
    check: Callable[[], Any], timeout: float = 10.0, what: str = "condition", running: asyncio.Task[None] | None = None
) -> None:
    """Waits for check(); fails at once if run() (`running`) ended meanwhile."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if running is not None and running.done():
            raise AssertionError(f"run() ended before {what}: {running.exception()!r}")
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.005)


async def stop(worker: cronoq.Worker, running: asyncio.Task[None], timeout: float = 10.0) -> float:
    """Stops the worker; how long run() took to return."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    worker.stop()
    await asyncio.wait_for(running, timeout)
    return loop.time() - started


async def echo(ctx: cronoq.TaskContext) -> Any:
    return {"id": ctx.id}


def held_until(last: int) -> Callable[[cronoq.TaskContext], Awaitable[Any]]:
    """A handler whose tasks all return once task `last` has started: their outcomes go together."""
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        if ctx.id == last:
            release.set()
        await release.wait()
        return {"id": ctx.id}

    return handle


# -- limits from registration -------------------------------------------------------


@pytest.mark.parametrize(
    ("max_result", "max_lease", "want_result", "want_lease"),
    [
        (0, 0, 4 * MiB, 16 * MiB),  # an older server: defaults
        (1000, 8 * MiB, 1000, 8 * MiB),
        (100 * MiB, 1 << 30, 63 * MiB, 63 * MiB),  # capped by the 64 MiB channel limit less 1 MiB
    ],
)
async def test_registration_sets_the_byte_limits(max_result: int, max_lease: int, want_result: int, want_lease: int):
    fake = FakeWorkerService(
        pb.RegisterWorkerResponse(
            worker_id="w1", heartbeat_interval_ms=60_000, max_result_bytes=max_result, max_lease_bytes=max_lease
        )
    )
    worker = make_worker(fake, echo)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.requests, what="a stream", running=running)
    await stop(worker, running)
    assert worker.max_result_bytes == want_result
    assert fake.streams[0].first.max_bytes == want_lease


# -- credits ------------------------------------------------------------------------


async def test_credits_bound_the_tasks_running_and_each_finished_task_gives_its_slot_back():
    fake = FakeWorkerService()
    fake.script = [[task(i, {"sleep": 0.001 * (i % 4)}) for i in range(1, 21)]]
    busy, most = 0, 0

    async def handle(ctx: cronoq.TaskContext) -> Any:
        nonlocal busy, most
        busy += 1
        most = max(most, busy, len(worker._running))
        await asyncio.sleep(ctx.payload["sleep"])
        busy -= 1
        return {"id": ctx.id}

    worker = make_worker(fake, handle, concurrency=3)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 20, what="twenty outcomes", running=running)
    await until(lambda: sum(r.credits for r in fake.requests) >= 3 + 20, what="every slot given back")
    await stop(worker, running)
    assert sum(r.credits for r in fake.requests) == 3 + 20
    assert [s.first.credits for s in fake.streams] == [3]
    assert most == 3
    assert fake.sent == list(range(1, 21))
    # Credits come back only for tasks that ended: never more than the free slots.
    given = ended = 0
    for r in fake.requests:
        given += r.credits
        ended += len(r.outcomes)
        assert given <= 3 + ended
    assert set(fake.accepted.values()) == {1}


async def test_by_default_a_worker_prefetches_four_tasks_a_slot_and_gives_its_slots_first():
    fake = FakeWorkerService()
    fake.script = [[task(1)], rpc_error(grpc.StatusCode.UNAVAILABLE, "server restarting")]

    async def handle(ctx: cronoq.TaskContext) -> Any:
        return None

    worker = make_worker(fake, handle, concurrency=3, prefetch=None)
    assert worker.prefetch == 12
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.streams) >= 2, what="a second stream", running=running)
    await stop(worker, running)
    assert [(s.first.credits, s.first.slots) for s in fake.streams[:2]] == [(15, 3), (15, 3)]
    assert not any(r.slots for r in fake.requests if all(r is not s.first for s in fake.streams))
    assert worker_mod.default_prefetch(16) == 64
    assert worker_mod.default_prefetch(99_000) == 1_000


async def test_a_new_stream_gives_the_slots_free_then_as_credits():
    fake = FakeWorkerService()
    fake.script = [[task(1)], rpc_error(grpc.StatusCode.UNAVAILABLE, "server restarting")]
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        await release.wait()

    worker = make_worker(fake, handle, concurrency=4)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.streams) == 2 and fake.streams[1].requests, what="a second stream", running=running)
    assert [s.first.credits for s in fake.streams] == [4, 3]  # task 1 still holds a slot
    release.set()
    await until(lambda: fake.accepted[1] == 1, what="the task to finish", running=running)
    await until(lambda: sum(r.credits for r in fake.streams[1].requests) >= 4, what="its slot given back")
    await stop(worker, running)
    assert sum(r.credits for r in fake.streams[1].requests) == 4


# -- stream failures ----------------------------------------------------------------


async def test_refused_streams_halve_max_bytes_and_the_worker_keeps_working(caplog):
    caplog.set_level(logging.ERROR, "cronoq.worker")
    fake = FakeWorkerService()
    fake.script = [
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (70000000 vs. 67108864)"),
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max"),
        rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "max_bytes: odd"),
        rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "no shard named"),  # no endpoint: not a redirect
        rpc_error(grpc.StatusCode.DATA_LOSS, "an answer cut short"),
        [task(1, {"n": 1})],
    ]
    worker = make_worker(fake, echo)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.accepted[1] == 1, what="the task sent after the failures to finish", running=running)
    await stop(worker, running)
    assert [s.first.max_bytes for s in fake.streams] == [16 * MiB, 8 * MiB, 4 * MiB, 2 * MiB, 1 * MiB, 1 * MiB]
    assert fake.outcomes[1].success.result == b'{"id":1}'
    assert sum("work stream failed" in r.getMessage() for r in caplog.records) == 5


async def test_an_answer_that_cannot_be_read_halves_max_bytes_and_the_worker_keeps_working():
    fake = FakeWorkerService()
    fake.script = [UNREADABLE, [task(1)]]
    worker = make_worker(fake, echo)
    running = asyncio.create_task(worker.run())
    try:
        await until(lambda: fake.accepted[1] == 1, what="the task to finish", running=running)
    finally:
        await stop(worker, running)
    assert [s.first.max_bytes for s in fake.streams] == [16 * MiB, 8 * MiB]


@pytest.mark.parametrize("code", [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED])
async def test_refused_credentials_end_run_with_the_reason(code):
    fake = FakeWorkerService()
    fake.script = [rpc_error(code, "token revoked")]
    worker = make_worker(fake, echo)
    with pytest.raises(cronoq.CronoqError, match="token revoked"):
        await asyncio.wait_for(worker.run(), 10)
    assert len(fake.streams) == 1 and fake.streams[0].cancelled
    assert fake.deregistered


async def test_transient_stream_failures_keep_max_bytes():
    fake = FakeWorkerService()
    fake.script = [
        rpc_error(grpc.StatusCode.UNAVAILABLE),
        rpc_error(grpc.StatusCode.CANCELLED),
        rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED),
        rpc_error(grpc.StatusCode.INTERNAL),
        rpc_error(grpc.StatusCode.UNKNOWN),
        [task(1)],
    ]
    worker = make_worker(fake, echo)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.accepted[1] == 1, what="the task to finish", running=running)
    await stop(worker, running)
    assert [s.first.max_bytes for s in fake.streams] == [16 * MiB] * 6


async def test_a_worker_the_server_forgot_registers_again_and_opens_a_new_stream():
    fake = FakeWorkerService()
    fake.script = [rpc_error(grpc.StatusCode.NOT_FOUND, "worker w1 unknown"), [task(1)]]
    worker = make_worker(fake, echo)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.accepted[1] == 1, what="the task to finish", running=running)
    await stop(worker, running)
    assert fake.registrations == 2
    assert len(fake.streams) == 2


async def test_a_shard_redirect_on_the_stream_still_ends_run():
    fake = FakeWorkerService()
    redirect = (("cronoq-shard", "west"), ("cronoq-shard-endpoint", "http://127.0.0.1:2"))
    fake.script = [rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "pool moved", redirect)]
    worker = make_worker(fake, echo)
    with pytest.raises(cronoq.errors.FailedPrecondition, match="pool moved"):
        await asyncio.wait_for(worker.run(), 10)


# -- backoff ------------------------------------------------------------------------


def opening_times(fake: FakeWorkerService) -> list[float]:
    """Records when each Work stream is opened (the loop's clock)."""
    opened: list[float] = []
    work = fake.Work

    def timed(metadata: Any = None, timeout: Any = None) -> FakeStream:
        opened.append(asyncio.get_running_loop().time())
        return work(metadata, timeout)

    fake.Work = timed  # type: ignore[method-assign]
    return opened


async def test_a_stream_answered_unavailable_every_time_is_opened_again_with_backoff_and_one_warning(caplog):
    # Timing-sensitive (generous margins): 10 ms doubling to 400 ms, equal jitter: the delays
    # are at least 5, 10, 20, 40, 80, 160, 200, 200 ms: at most 10 streams in 1 s.
    caplog.set_level(logging.DEBUG, "cronoq.worker")
    fake = FakeWorkerService()
    fake.script = [rpc_error(grpc.StatusCode.UNAVAILABLE, "going away")] * 1000
    retry = cronoq.RetryConfig(initial_backoff=0.01, max_backoff=0.4, max_elapsed=None)
    worker = make_worker(fake, echo, retry=retry)
    running = asyncio.create_task(worker.run())
    await asyncio.sleep(1.0)
    assert not running.done(), running
    opened = len(fake.streams)
    await stop(worker, running)
    assert 4 <= opened <= 10, f"{opened} streams in 1 s"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "work stream failed" in warnings[0] and "going away" in warnings[0], warnings


async def test_a_healthy_stream_starts_the_backoff_over():
    # Timing-sensitive: without the reset the 8th stream waits at least 320 ms; with it, 5-10 ms.
    fake = FakeWorkerService()
    unavailable = rpc_error(grpc.StatusCode.UNAVAILABLE, "going away")
    fake.script = [unavailable] * 6 + [[task(1)], unavailable]  # the 7th delivers a task: healthy
    opened = opening_times(fake)
    ended: list[float] = []
    retry = cronoq.RetryConfig(initial_backoff=0.01, max_backoff=5.0, max_elapsed=None)
    worker = make_worker(fake, echo, retry=retry)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.streams) >= 7 and fake.streams[6].ended is not None, running=running)
    ended.append(asyncio.get_running_loop().time())
    await until(lambda: fake.accepted[1] == 1, what="the task's outcome on the 8th stream", running=running)
    await stop(worker, running)
    assert opened[6] - opened[5] >= 0.16  # the 7th waited for its place in the row: 320 ms, equal jitter
    assert opened[7] - ended[0] < 0.2, opened


def test_backoff_doubles_to_the_cap_with_equal_jitter():
    retry = cronoq.RetryConfig(initial_backoff=0.1, max_backoff=2.0)
    for failures, step in [(0, 0.1), (1, 0.2), (3, 0.8), (4, 1.6), (5, 2.0), (40, 2.0)]:
        delays = [backoff_delay(retry, failures) for _ in range(200)]
        assert all(step / 2 <= d <= step for d in delays), (failures, min(delays), max(delays))
        assert max(delays) - min(delays) > step / 4  # jittered, at the cap too


def test_backoff_logs_a_row_of_failures_once(caplog):
    caplog.set_level(logging.DEBUG, "cronoq")
    backoff = Backoff(cronoq.RetryConfig(initial_backoff=0.1, max_backoff=2.0), "work stream")
    delays = [backoff.failed(RuntimeError("down")) for _ in range(6)]
    assert delays[-1] >= 1.0 and backoff.failures == 6
    backoff.succeeded()
    assert backoff.failures == 0 and backoff.failed(RuntimeError("down")) <= 0.1
    levels = [(r.levelno, r.getMessage().split(" (")[0]) for r in caplog.records if r.levelno > logging.DEBUG]
    assert levels == [
        (logging.WARNING, "work stream failed"),
        (logging.INFO, "work stream works again after 6 failed attempt(s)"),
        (logging.WARNING, "work stream failed"),
    ]


# -- shard redirects ----------------------------------------------------------------


class Redirecting(worker_service_pb2_grpc.WorkerServiceServicer):
    """A server whose RegisterWorker sends every worker to the shard endpoint `to`."""

    def __init__(self, to: str):
        self.to = to
        self.calls = 0

    async def RegisterWorker(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        trailers = (("cronoq-shard", "gpu"), ("cronoq-shard-endpoint", self.to))
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, "pool default is on shard gpu", trailing_metadata=trailers
        )


async def test_a_worker_follows_three_redirects_in_a_row_and_refuses_the_fourth():
    # e <- d <- c <- b <- a: a worker given a is sent to b, c, d, and refused at d.
    servers, chain, url = [], [], "http://127.0.0.1:1"  # e: never reached
    try:
        for _ in range(4):
            servicer = Redirecting(url)
            server = grpc.aio.server()
            worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
            url = f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
            chain.insert(0, servicer)
        worker = cronoq.Worker(url, "default", echo, retry=FAST)
        with pytest.raises(cronoq.errors.TooManyRedirects, match="more than 3 times in a row"):
            await asyncio.wait_for(worker.run(), 5)  # without the limit: back to a (e is down), forever
        assert [s.calls for s in chain] == [1, 1, 1, 1]
    finally:
        for server in servers:
            await server.stop(None)


# -- results and outcomes -----------------------------------------------------------


async def test_a_result_over_max_result_bytes_is_a_final_failure():
    fake = FakeWorkerService(
        pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=60_000, max_result_bytes=1000)
    )
    fake.script = [[task(1, {"size": 1000}), task(2, {"size": 1001}), task(3, {"json": 995})]]

    async def handle(ctx: cronoq.TaskContext) -> Any:
        if "json" in ctx.payload:
            return {"s": "x" * ctx.payload["json"]}  # 1003 bytes once encoded
        return b"x" * ctx.payload["size"]

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.outcomes) == 3, what="three outcomes", running=running)
    await stop(worker, running)
    assert fake.outcomes[1].success.result == b"x" * 1000
    for task_id, size in ((2, 1001), (3, 1003)):
        failure = fake.outcomes[task_id].failure
        assert failure.error == f"result of {size} bytes exceeds max_result_bytes 1000"
        assert failure.retryable is False


def outcome(task_id: int, result_bytes: int = 0) -> pb.TaskOutcome:
    return pb.TaskOutcome(task_id=task_id, attempt=1, success=pb.TaskSuccess(result=b"r" * result_bytes))


def test_outcome_batches_stay_under_the_send_limit_and_the_count_cap():
    worker = make_worker(FakeWorkerService(), echo)
    worker._outcomes = [outcome(i, 4_000_000) for i in range(40)]  # 160 MB in all
    sizes = []
    while worker._outcomes:
        batch = worker._next_batch()
        # The largest message: outcomes with credits and a heartbeat of a full worker.
        heartbeat = pb.WorkHeartbeat(tasks=[pb.TaskAttempt(task_id=1 << 60, attempt=1 << 30)] * 1000)
        size = pb.WorkRequest(credits=1 << 31, outcomes=batch, heartbeat=heartbeat).ByteSize()
        assert batch and size <= 64 * MiB - 1 * MiB
        sizes.append(len(batch))
    assert sizes == [16, 16, 8]

    worker._outcomes = [outcome(i) for i in range(2500)]
    assert [len(worker._next_batch()) for _ in range(3)] == [1000, 1000, 500]

    worker._outcomes = [outcome(1, 70 * MiB), outcome(2)]  # one outcome always goes, alone
    assert [[o.task_id for o in worker._next_batch()] for _ in range(2)] == [[1], [2]]


async def test_big_results_are_reported_in_several_messages():
    fake = FakeWorkerService()
    fake.script = [[task(i) for i in range(1, 21)]]
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> bytes:
        if ctx.id == 20:
            release.set()
        await release.wait()  # all twenty outcomes queue up together
        return bytes(4_000_000)

    worker = make_worker(fake, handle, concurrency=20)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 20, what="twenty outcomes", running=running)
    await stop(worker, running)
    assert set(fake.accepted.values()) == {1}
    assert len(fake.reports) >= 2
    assert all(size <= 63 * MiB for size, _ in fake.reports)


async def test_an_outcome_refused_in_the_results_is_dropped_with_a_warning_and_the_others_are_applied(caplog):
    caplog.set_level(logging.WARNING, "cronoq.worker")
    fake = FakeWorkerService()
    fake.script = [[task(i) for i in range(1, 9)]]
    poison = 5

    async def finish(req: pb.WorkRequest) -> list[pb.FinishTaskResult]:
        good = pb.WorkRequest(outcomes=[o for o in req.outcomes if o.task_id != poison])
        await fake.accept(good)
        return [
            pb.FinishTaskResult(task_id=o.task_id, accepted=True)
            if o.task_id != poison
            else pb.FinishTaskResult(task_id=poison, code="INVALID_ARGUMENT", message=f"task {poison} is malformed")
            for o in req.outcomes
        ]

    fake.finish = finish
    worker = make_worker(fake, held_until(8))
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 7 and not worker._unacked, what="every outcome answered", running=running)
    await stop(worker, running)
    assert fake.accepted == Counter({i: 1 for i in range(1, 9) if i != poison})
    assert sorted(fake.reports[0][1]) == [(i, "success") for i in range(1, 9)]  # one message
    assert len(fake.reports) == 1  # the refused outcome is not sent again
    assert len(fake.streams) == 1  # and the stream goes on
    assert worker.processed == 8
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and f"task {poison} " in refused[0] and "malformed" in refused[0]


async def test_outcomes_unanswered_when_a_stream_fails_are_sent_again_on_the_next_and_not_run_again():
    fake = FakeWorkerService()
    fake.script = [[task(i) for i in range(1, 5)]]
    failed = False

    async def finish(req: pb.WorkRequest) -> list[pb.FinishTaskResult]:
        nonlocal failed
        if not failed and any(o.task_id in (3, 4) for o in req.outcomes):
            failed = True  # received, not answered
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset")
        return await fake.accept(req)

    fake.finish = finish
    release = asyncio.Event()
    runs: Counter[int] = Counter()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        runs[ctx.id] += 1
        if ctx.id in (3, 4):
            await release.wait()
        return {"id": ctx.id}

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 2, what="tasks 1 and 2 answered", running=running)
    release.set()
    await until(lambda: len(fake.accepted) == 4, what="tasks 3 and 4 answered", running=running)
    await stop(worker, running)
    assert len(fake.streams) == 2
    sent_again = [o.task_id for r in fake.streams[1].requests for o in r.outcomes]
    assert sorted(sent_again) == [3, 4]  # exactly those unanswered
    assert runs == Counter({1: 1, 2: 1, 3: 1, 4: 1})
    assert fake.sent == [1, 2, 3, 4]
    assert set(fake.accepted.values()) == {1}


async def test_outcomes_unanswered_when_a_stream_fails_are_sent_again_at_once():
    fake = FakeWorkerService()  # heartbeats every 60 s: none comes to wake the sender
    fake.script = [[task(1)]]
    fake.fail_reports(rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset"))
    worker = make_worker(fake, echo)
    running = asyncio.create_task(worker.run())
    try:
        await until(lambda: fake.accepted[1] == 1, timeout=1.0, what="the outcome sent again", running=running)
    finally:
        await stop(worker, running)


async def test_transient_stream_failures_resend_the_same_outcomes():
    fake = FakeWorkerService()
    fake.script = [[task(i) for i in range(1, 4)]]
    fake.fail_reports(rpc_error(grpc.StatusCode.UNAVAILABLE), rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED))
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        if ctx.id == 3:
            release.set()
        await release.wait()

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 3, what="three accepted outcomes", running=running)
    await stop(worker, running)
    assert [sorted(ids) for _, ids in fake.reports] == [[(i, "success") for i in range(1, 4)]] * 3
    assert set(fake.accepted.values()) == {1}
    assert [s.first.max_bytes for s in fake.streams] == [16 * MiB] * 3


async def test_a_stream_refused_after_outcomes_were_sent_sends_them_again_on_the_next():
    fake = FakeWorkerService()
    fake.script = [[task(i) for i in range(1, 9)]]
    fake.fail_reports(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max"))
    worker = make_worker(fake, held_until(8))
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 8, what="eight accepted outcomes", running=running)
    await stop(worker, running)
    assert set(fake.accepted.values()) == {1}
    assert [len(ids) for _, ids in fake.reports] == [8, 8]
    assert [s.first.max_bytes for s in fake.streams] == [16 * MiB, 8 * MiB]


# -- heartbeats ---------------------------------------------------------------------


async def test_heartbeats_ride_on_the_stream_and_the_answer_cancels_or_drops_tasks():
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=100))
    fake.script = [[task(1, attempt=2), task(2, attempt=3)]]
    interrupted: list[int] = []

    async def handle(ctx: cronoq.TaskContext) -> Any:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            interrupted.append(ctx.id)
            raise

    worker = make_worker(fake, handle, concurrency=2)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.heartbeats, what="a heartbeat", running=running)
    assert sorted(fake.heartbeats[0]) == [(1, 2), (2, 3)]
    fake.heartbeat_cancels, fake.heartbeat_losts = [1], [2]
    await until(lambda: 1 in fake.outcomes, what="the cancelled task's outcome", running=running)
    await until(lambda: sum(r.credits for r in fake.requests) == 4, what="both slots given back", running=running)
    await stop(worker, running)
    assert sorted(interrupted) == [1, 2]
    assert fake.outcomes[1].WhichOneof("outcome") == "cancelled"
    assert fake.outcomes[1].cancelled.reason == "cancelled"
    assert [ids for _, ids in fake.reports] == [[(1, "cancelled")]]  # the lost task is dropped silently
    assert len(fake.streams) == 1


async def test_heartbeats_carry_the_attempts_whose_outcomes_are_unanswered(monkeypatch):
    monkeypatch.setattr(worker_mod, "STOP_EXTRA_S", 0.3)
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=100))
    fake.script = [[task(1, attempt=4)]]

    async def unanswered(req: pb.WorkRequest) -> list[pb.FinishTaskResult]:
        return []  # a server still applying them

    fake.finish = unanswered
    worker = make_worker(fake, echo, shutdown_grace=0.2)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.reports, what="the outcome", running=running)
    seen = len(fake.heartbeats)
    await until(lambda: len(fake.heartbeats) > seen, what="a heartbeat after the outcome", running=running)
    assert fake.heartbeats[-1] == [(1, 4)]
    took = await stop(worker, running)
    assert 0.2 + 0.3 <= took < 0.2 + 0.3 + 0.5  # the unanswered outcome holds shutdown to its bound
    assert list(worker._unacked) == [1]


# -- shutdown -----------------------------------------------------------------------


async def test_stop_releases_a_task_still_running_after_the_grace():
    fake = FakeWorkerService()
    fake.script = [[task(1, {"sleep": 3600}), task(2, {"sleep": 0.05})]]
    started: list[int] = []

    async def handle(ctx: cronoq.TaskContext) -> Any:
        started.append(ctx.id)
        await asyncio.sleep(ctx.payload["sleep"])
        return "done"

    worker = make_worker(fake, handle, shutdown_grace=0.3)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(started) == 2, what="both tasks to start", running=running)
    took = await stop(worker, running)
    assert 0.3 <= took < 0.3 + 1.0
    assert fake.outcomes[1].WhichOneof("outcome") == "released"
    assert fake.outcomes[1].released.reason == "worker shut down"
    assert fake.outcomes[1].attempt == 1
    assert fake.outcomes[2].success.result == b'"done"'  # finished within the grace
    assert fake.streams[-1].ended is grpc.aio.EOF  # the worker half-closed once every outcome was answered
    assert fake.deregistered


async def test_a_task_that_arrives_after_stop_is_released_not_run():
    fake = FakeWorkerService()
    fake.script = [[task(1)]]
    release = asyncio.Event()
    started: list[int] = []

    async def handle(ctx: cronoq.TaskContext) -> Any:
        started.append(ctx.id)
        await release.wait()
        return "done"

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: started, what="task 1 to start", running=running)
    worker.stop()
    fake.script.append([task(2, attempt=5)])  # within the credits given before stop()
    await until(lambda: 2 in fake.outcomes, what="task 2 given back", running=running)
    release.set()
    await asyncio.wait_for(running, 10)
    assert started == [1]
    assert fake.outcomes[2].WhichOneof("outcome") == "released"
    assert fake.outcomes[2].attempt == 5
    assert fake.outcomes[1].success.result == b'"done"'
    assert all(r.credits == 0 for r in fake.requests[1:])  # no credits once stopping


async def test_a_task_the_server_cancelled_is_still_reported_cancelled_at_shutdown():
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=100))
    fake.script = [[task(1)]]
    cancels = 0

    async def handle(ctx: cronoq.TaskContext) -> Any:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:  # cleans up on the server's cancel, gives up at shutdown
                    raise

    worker = make_worker(fake, handle, shutdown_grace=0.2)
    running = asyncio.create_task(worker.run())
    await until(lambda: worker._running, what="the task to start", running=running)
    fake.heartbeat_cancels = [1]
    await until(lambda: cancels == 1, what="the server's cancel", running=running)
    await stop(worker, running)
    assert fake.outcomes[1].WhichOneof("outcome") == "cancelled"
    assert fake.outcomes[1].cancelled.reason == "cancelled"


async def test_stop_is_bounded_with_a_handler_that_ignores_cancellation_and_a_server_that_hangs(monkeypatch):
    monkeypatch.setattr(worker_mod, "UNWIND_S", 0.1)
    monkeypatch.setattr(worker_mod, "STOP_EXTRA_S", 0.6)
    fake = FakeWorkerService()
    fake.script = [[task(1)]]
    reported = asyncio.Event()

    async def hang(req: pb.WorkRequest) -> list[pb.FinishTaskResult]:
        reported.set()
        await asyncio.sleep(3600)  # a server that never answers
        raise AssertionError("unreachable")

    fake.finish = hang

    stubborn_on = True
    handles: list[asyncio.Task[Any]] = []

    async def stubborn(ctx: cronoq.TaskContext) -> Any:
        handles.append(asyncio.current_task())
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not stubborn_on:
                    raise

    worker = make_worker(fake, stubborn, shutdown_grace=0.3)
    running = asyncio.create_task(worker.run())
    await until(lambda: worker._running, what="the task to start", running=running)
    took = await stop(worker, running)
    assert took < 0.3 + 0.6 + 0.5
    assert reported.is_set()
    assert fake.reports == [(fake.reports[0][0], [(1, "released")])]
    assert fake.streams[-1].cancelled  # the stream was given up
    assert not worker._running and not handles[0].done()  # released, yet its handler still runs
    stubborn_on = False  # end it
    handles[0].cancel()
    await asyncio.gather(handles[0], return_exceptions=True)
    assert worker._outcomes == [] and list(worker._unacked) == [1]  # and its late end is not reported


async def test_a_handlers_own_cancelled_error_is_a_retryable_failure():
    fake = FakeWorkerService()
    fake.script = [[task(1)]]

    async def handle(ctx: cronoq.TaskContext) -> Any:
        raise asyncio.CancelledError

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.outcomes, what="an outcome", running=running)
    await stop(worker, running)
    assert fake.outcomes[1].failure.retryable is True


# -- what handlers report: snoozes, progress, checkpoints ---------------------------


def beat_reports(fake: FakeWorkerService, stream: int = 0) -> list[list[pb.TaskReport]]:
    """The reports of each heartbeat a stream received, in order (none while it is not open)."""
    requests = fake.streams[stream].requests if len(fake.streams) > stream else []
    return [list(r.heartbeat.reports) for r in requests if r.HasField("heartbeat")]


def progress(value: float, message: str) -> task_pb2.TaskProgress:
    return task_pb2.TaskProgress(value=value, message=message)


async def test_a_snooze_is_reported_with_its_ms_and_reason():
    fake = FakeWorkerService()
    fake.script = [[task(1, {"s": 1.5, "why": "rate limited"}), task(2, {"s": 0}), task(3, {"s": 4.35})]]

    async def handle(ctx: cronoq.TaskContext) -> Any:
        raise cronoq.Snooze(ctx.payload["s"], **({"reason": ctx.payload["why"]} if "why" in ctx.payload else {}))

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.outcomes) == 3, what="three outcomes", running=running)
    await stop(worker, running)
    snoozed = {i: o.snoozed for i, o in fake.outcomes.items() if o.WhichOneof("outcome") == "snoozed"}
    assert snoozed == {
        1: pb.TaskSnoozed(snooze_ms=1500, reason="rate limited"),
        2: pb.TaskSnoozed(snooze_ms=0),  # due at once, and still a snooze
        3: pb.TaskSnoozed(snooze_ms=4350),  # as written, not 4349.999...
    }
    assert not any(o.HasField("report") for o in fake.outcomes.values())  # nothing was reported


def test_a_snooze_is_whole_ms_from_0_to_the_uint32_max():
    assert cronoq.Snooze(0.0019).snooze_ms == 1  # rounded down
    assert cronoq.Snooze(4294967.295).snooze_ms == 4294967295
    assert str(cronoq.Snooze(2, reason="later")) == "snoozed for 2000 ms: later"
    for seconds in (-1, -0.0001, 4294967.296, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"snooze: .* s, not from 0 to 4294967\.295 s"):
            cronoq.Snooze(seconds)


async def test_a_bad_snooze_fails_the_attempt_saying_so():
    fake = FakeWorkerService()
    fake.script = [[task(1)]]

    async def handle(ctx: cronoq.TaskContext) -> Any:
        raise cronoq.Snooze(-1)

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.outcomes, what="an outcome", running=running)
    await stop(worker, running)
    assert fake.outcomes[1].failure == pb.TaskFailure(
        error="ValueError: snooze: -1 s, not from 0 to 4294967.295 s", retryable=True
    )


def test_bad_reports_are_refused_and_nothing_is_recorded():
    ctx = cronoq.TaskContext(task(1, checkpoint=b"kept"), max_checkpoint_bytes=10)
    for value in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match=r"progress value: .*, not a finite number"):
            ctx.report_progress(value)
    for message in ("x" * 1025, "é" * 513):
        with pytest.raises(ValueError, match=f"progress message: {len(message.encode())} bytes, more than 1024"):
            ctx.report_progress(0.5, message)
    with pytest.raises(ValueError, match=r"progress message: control character '\\n'"):
        ctx.report_progress(0.5, "two\nlines")  # the server refuses control characters
    for bad in "\u2028\u2029\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u061c":
        with pytest.raises(ValueError, match=rf"progress message: control character '\\u{ord(bad):04x}'"):
            ctx.report_progress(0.5, f"report{bad}fdp.exe")  # line separators and bidi controls too
    with pytest.raises(ValueError, match="checkpoint: 11 bytes, more than max_checkpoint_bytes 10"):
        ctx.save_checkpoint(b"x" * 11)
    with pytest.raises(TypeError, match="checkpoint: bytes, not str"):
        ctx.save_checkpoint("text")  # type: ignore[arg-type]
    assert ctx.checkpoint == b"kept"
    assert ctx._pending() == (None, 0)
    ctx.report_progress(1, "x" * 1024)  # at the bounds
    ctx.save_checkpoint(bytearray(b"y" * 10))
    report, version = ctx._pending()
    assert version == 2
    assert report == pb.TaskReport(task_id=1, attempt=1, progress=progress(1, "x" * 1024), checkpoint=b"y" * 10)


@pytest.mark.parametrize(("max_checkpoint", "allowed"), [(0, 256 << 10), (10, 10)])
async def test_the_checkpoint_bound_comes_from_registration(max_checkpoint: int, allowed: int):
    fake = FakeWorkerService(
        pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=60_000, max_checkpoint_bytes=max_checkpoint)
    )
    fake.script = [[task(1)]]
    refused: list[str] = []

    async def handle(ctx: cronoq.TaskContext) -> Any:
        try:
            ctx.save_checkpoint(b"x" * (allowed + 1))
        except ValueError as err:
            refused.append(str(err))
        ctx.save_checkpoint(b"x" * allowed)

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.outcomes, what="an outcome", running=running)
    await stop(worker, running)
    assert refused == [f"checkpoint: {allowed + 1} bytes, more than max_checkpoint_bytes {allowed}"]
    assert fake.outcomes[1].report.checkpoint == b"x" * allowed


async def test_a_leased_tasks_checkpoint_and_snoozes_reach_its_handler():
    fake = FakeWorkerService()
    fake.script = [[task(1, attempt=2, snoozes=3, checkpoint=b"step-7"), task(2)]]
    seen: dict[int, list[Any]] = {}

    async def handle(ctx: cronoq.TaskContext) -> Any:
        seen[ctx.id] = [ctx.snoozes, ctx.checkpoint]
        ctx.save_checkpoint(b"step-8")
        seen[ctx.id].append(ctx.checkpoint)  # the one saved
        ctx.save_checkpoint(b"")
        seen[ctx.id].append(ctx.checkpoint)  # cleared

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.outcomes) == 2, what="two outcomes", running=running)
    await stop(worker, running)
    assert seen == {1: [3, b"step-7", b"step-8", None], 2: [0, None, b"step-8", None]}
    assert fake.outcomes[1].report.HasField("checkpoint") and fake.outcomes[1].report.checkpoint == b""


async def test_reports_are_coalesced_into_the_next_heartbeat_and_dropped_once_answered():
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=50))
    fake.script = [[task(1, attempt=2), task(2)]]
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        if ctx.id == 1:
            ctx.report_progress(0.25, "a quarter")
            ctx.save_checkpoint(b"step-2")
            other = threading.Thread(target=ctx.report_progress, args=(0.5, "half"))  # from another thread too
            other.start()
            other.join()
        await release.wait()  # task 2 reports nothing

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: any(beat_reports(fake)), what="a heartbeat with a report", running=running)
    carried = beat_reports(fake)
    await until(lambda: len(beat_reports(fake)) >= len(carried) + 2, what="two more heartbeats")
    release.set()
    await until(lambda: len(fake.outcomes) == 2, what="two outcomes", running=running)
    await stop(worker, running)
    beats = beat_reports(fake)
    first = next(i for i, b in enumerate(beats) if b)
    # The first heartbeat after the reports carries the last of each, once; answered, they are
    # no longer pending: no later heartbeat, nor the outcome, carries them again.
    assert beats[first] == [pb.TaskReport(task_id=1, attempt=2, progress=progress(0.5, "half"), checkpoint=b"step-2")]
    assert not any(beats[first + 1 :])
    assert not any(o.HasField("report") for o in fake.outcomes.values())


@pytest.mark.parametrize("end", ["success", "failure", "snoozed", "cancelled", "released"])
async def test_a_report_not_yet_sent_rides_the_outcome(end: str):
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=50))
    fake.script = [[task(1, attempt=3)]]
    started = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        def report() -> None:  # just before the handler ends: no heartbeat comes in between
            ctx.save_checkpoint(b"almost")
            ctx.report_progress(0.9, "nearly")

        if end in ("cancelled", "released"):
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                report()
                raise
        report()
        if end == "failure":
            raise cronoq.TaskError("crash")
        if end == "snoozed":
            raise cronoq.Snooze(1)

    worker = make_worker(fake, handle, shutdown_grace=0.05)
    running = asyncio.create_task(worker.run())
    if end == "cancelled":
        await until(started.is_set, what="the handler to start", running=running)
        fake.heartbeat_cancels = [1]
    if end == "released":
        await until(started.is_set, what="the handler to start", running=running)
        worker.stop()
    await until(lambda: fake.outcomes, what="an outcome", running=running)
    await stop(worker, running)
    assert fake.outcomes[1].WhichOneof("outcome") == end
    assert fake.outcomes[1].report == pb.TaskReport(
        task_id=1, attempt=3, progress=progress(0.9, "nearly"), checkpoint=b"almost"
    )
    assert not any(beat_reports(fake))


async def test_a_report_sent_and_not_answered_is_sent_again_on_the_next_stream():
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=50))
    fake.script = [[task(1)]]
    fake.hold_heartbeats = True
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        ctx.report_progress(0.5, "half")
        await release.wait()

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: any(beat_reports(fake)), what="a heartbeat with the report", running=running)
    fake.script.append(rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset"))  # before any answer
    await until(lambda: any(beat_reports(fake, 1)), what="the next stream's heartbeat with the report")
    fake.hold_heartbeats = False
    fake.streams[1].answer_withheld()  # answered at last: no longer pending
    carried = len(beat_reports(fake, 1))
    await until(lambda: len(beat_reports(fake, 1)) >= carried + 2, what="two more heartbeats")
    release.set()
    await until(lambda: fake.outcomes, what="an outcome", running=running)
    await stop(worker, running)
    beats = beat_reports(fake, 1)
    assert beats[0] == [pb.TaskReport(task_id=1, attempt=1, progress=progress(0.5, "half"))]
    assert not any(beats[carried:])
    assert not fake.outcomes[1].HasField("report")


async def test_an_answer_drops_only_what_was_not_replaced_and_what_is_left_rides_the_outcome():
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=50))
    fake.script = [[task(1)]]
    fake.hold_heartbeats = True
    again, end = asyncio.Event(), asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        ctx.report_progress(0.25, "a quarter")
        ctx.save_checkpoint(b"step-1")
        await again.wait()
        ctx.report_progress(0.5, "half")  # replaces the progress the first heartbeat carried
        await end.wait()

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: any(beat_reports(fake)), what="a heartbeat with the reports", running=running)
    again.set()
    await until(lambda: beat_reports(fake)[-1][0].progress.message == "half", what="one with the new progress")
    fake.streams[0].answer_withheld()  # the first heartbeat's answer: its checkpoint is no longer pending
    await until(lambda: not beat_reports(fake)[-1][0].HasField("checkpoint"), what="one without the checkpoint")
    end.set()
    await until(lambda: fake.outcomes, what="an outcome", running=running)
    await stop(worker, running)
    first = next(b for b in beat_reports(fake) if b)
    assert first == [pb.TaskReport(task_id=1, attempt=1, progress=progress(0.25, "a quarter"), checkpoint=b"step-1")]
    # Sent and not answered: with the outcome.
    assert fake.outcomes[1].report == pb.TaskReport(task_id=1, attempt=1, progress=progress(0.5, "half"))


async def test_reports_that_do_not_fit_the_message_wait_for_the_next_heartbeat(monkeypatch):
    monkeypatch.setattr(worker_mod, "MAX_REQUEST_BYTES", 3000)
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=50))
    fake.script = [[task(1), task(2)]]
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        ctx.save_checkpoint(bytes([ctx.id]) * 2000)
        await release.wait()

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    assert worker.max_checkpoint_bytes == 256 << 10  # not registered yet
    await until(lambda: sum(map(len, beat_reports(fake))) >= 2, what="both reports", running=running)
    release.set()
    await until(lambda: len(fake.outcomes) == 2, what="two outcomes", running=running)
    await stop(worker, running)
    assert worker.max_checkpoint_bytes == 3000  # what one message can carry
    carried = [[r.task_id for r in b] for b in beat_reports(fake) if b]
    assert carried[:2] == [[1], [2]]  # one a heartbeat
    assert all(r.ByteSize() < 3000 for r in fake.streams[0].requests)


# -- structured log fields ------------------------------------------------------------


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: getattr(record, k) for k in ("worker_id", "task_id", "attempt", "pool") if hasattr(record, k)}


async def test_log_lines_about_a_task_carry_the_worker_task_attempt_and_pool_as_fields(caplog):
    """The SDK's log records carry worker_id, task_id (a decimal string), attempt and pool as
    structured fields (logging's extra): the names the server's JSON log lines use."""
    caplog.set_level(logging.DEBUG, "cronoq.worker")
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w-7", heartbeat_interval_ms=100))
    big = (1 << 63) + 5  # a task id over 2**63: a decimal string, unchanged
    fake.script = [[task(big, {"wait": False}, attempt=3), task(6, {"wait": True}, attempt=2)]]

    async def refuse(req: pb.WorkRequest) -> list[pb.FinishTaskResult]:
        return [
            pb.FinishTaskResult(task_id=o.task_id, code="FAILED_PRECONDITION", message="fenced") for o in req.outcomes
        ]

    async def handle(ctx: cronoq.TaskContext) -> Any:
        if ctx.payload["wait"]:
            await asyncio.sleep(3600)
        return "done"

    fake.finish = refuse
    worker = make_worker(fake, handle, concurrency=2)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.reports and fake.heartbeats, what="the refused outcome and a heartbeat", running=running)
    fake.heartbeat_losts = [6]
    await until(lambda: any("lost its lease" in r.getMessage() for r in caplog.records), what="the lost lease")
    await stop(worker, running)

    refused = next(r for r in caplog.records if "refused" in r.getMessage())
    assert refused.levelno == logging.WARNING and refused.name == "cronoq.worker"
    assert record_fields(refused) == {"worker_id": "w-7", "task_id": str(big), "attempt": 3, "pool": "default"}
    lost = next(r for r in caplog.records if "lost its lease" in r.getMessage())
    assert record_fields(lost) == {"worker_id": "w-7", "task_id": "6", "attempt": 2, "pool": "default"}
    registered = next(r for r in caplog.records if "registered with shard" in r.getMessage())
    assert record_fields(registered) == {"worker_id": "w-7"}  # a line about the worker: no task's fields


# -- workflows: dependency results and spawn -----------------------------------------


def dependency(task_id: int, key: str, state: int, result: bytes = b"", content_type: str = "", error: str = ""):
    return task_pb2.DependencyResult(
        id=task_id, key=key, state=state, result=result, content_type=content_type, error=error
    )


def test_dependency_results_are_decoded_like_payloads_in_depends_on_order():
    leased = task(
        9,
        {},
        dependency_results=[
            dependency(3, "wf-a", task_pb2.TASK_STATE_SUCCEEDED, b'{"n":2}', "application/json"),
            dependency(1, "", task_pb2.TASK_STATE_SUCCEEDED, b"\x00raw"),
            dependency(5, "wf-c", task_pb2.TASK_STATE_FAILED, error="boom"),
        ],
    )
    ctx = cronoq.TaskContext(leased)
    assert ctx.dependencies == [
        cronoq.DependencyResult(3, "wf-a", task_pb2.TASK_STATE_SUCCEEDED, {"n": 2}, ""),
        cronoq.DependencyResult(1, "", task_pb2.TASK_STATE_SUCCEEDED, b"\x00raw", ""),
        cronoq.DependencyResult(5, "wf-c", task_pb2.TASK_STATE_FAILED, None, "boom"),  # no result: None
    ]
    assert ctx.dependency_results == {3: {"n": 2}, 1: b"\x00raw", 5: None}
    assert ctx.dependency("wf-a") == {"n": 2}
    assert ctx.dependency(1) == b"\x00raw"
    assert ctx.dependency(5) is None
    for absent in ("wf-b", "", 4):
        with pytest.raises(KeyError, match=f"{absent!r} is not a dependency of task 9"):
            ctx.dependency(absent)
    assert cronoq.TaskContext(task(10, {})).dependencies == []


def test_spawn_refuses_a_bad_run_when_or_reference_and_records_nothing():
    ctx = cronoq.TaskContext(task(9, {}))
    with pytest.raises(ValueError, match="run_when: 'later' is not"):
        ctx.spawn("default", {}, run_when="later")
    with pytest.raises(TypeError, match="task reference must be an id"):
        ctx.spawn("default", {}, depends_on=[1.5])  # type: ignore[list-item]
    assert ctx._spawned == []


async def test_spawned_tasks_ride_the_success_outcome_only():
    fake = FakeWorkerService(
        pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=60_000, max_result_bytes=1000)
    )
    ends = ["return", "fail", "snooze", "too_big", "crash"]
    fake.script = [[task(i + 1, {"end": end}) for i, end in enumerate(ends)]]

    async def handle(ctx: cronoq.TaskContext) -> Any:
        ctx.spawn("default", {"part": 1}, key=f"c{ctx.id}")
        ctx.spawn(
            "default",
            b"\x01",
            depends_on=[f"c{ctx.id}", ctx.id],
            run_when="ended",
            priority=5,
            content_type="application/octet-stream",
        )
        end = ctx.payload["end"]
        if end == "fail":
            raise cronoq.TaskError("no", retryable=False)
        if end == "snooze":
            raise cronoq.Snooze(1)
        if end == "crash":
            raise RuntimeError("bug")
        return "x" * 2000 if end == "too_big" else {"ok": True}

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.outcomes) == len(ends), what="every outcome", running=running)
    await stop(worker, running)
    success = fake.outcomes[1].success
    assert success.result == b'{"ok":true}'
    first, second = success.spawn
    assert (first.pool, first.key, first.payload, first.content_type) == (
        "default",
        "c1",
        b'{"part":1}',
        "application/json",
    )
    assert list(first.depends_on) == [] and first.run_when == task_pb2.RUN_WHEN_UNSPECIFIED
    assert second.depends_on == [task_pb2.TaskRef(key="c1"), task_pb2.TaskRef(id=1)]
    assert second.run_when == task_pb2.RUN_WHEN_DEPENDENCIES_ENDED
    assert (second.payload, second.content_type, second.priority) == (b"\x01", "application/octet-stream", 5)
    kinds = {i: o.WhichOneof("outcome") for i, o in fake.outcomes.items()}
    assert kinds == {1: "success", 2: "failure", 3: "snoozed", 4: "failure", 5: "failure"}
    assert fake.outcomes[4].failure.error == "result of 2002 bytes exceeds max_result_bytes 1000"
    # Every outcome sent, as sent: only the success carried them.
    sent = [(o.task_id, len(o.success.spawn)) for r in fake.requests for o in r.outcomes]
    assert sorted(sent) == [(1, 2), (2, 0), (3, 0), (4, 0), (5, 0)]


async def test_a_lost_attempt_sends_no_outcome_and_so_none_of_its_spawns():
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=50))
    fake.script = [[task(1, {})]]
    spawned = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        ctx.spawn("default", {"child": True})
        spawned.set()
        try:
            await asyncio.sleep(3600)
        finally:
            ctx.spawn("default", {"after": "lost"})  # too late: the attempt is no longer ours
        return {}

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(spawned.is_set, what="the spawn", running=running)
    fake.heartbeat_losts = [1]
    await until(lambda: sum(r.credits for r in fake.requests) == 9, what="the slot given back", running=running)
    await stop(worker, running)
    assert fake.outcomes == {}
    assert not any(r.outcomes for r in fake.requests)
