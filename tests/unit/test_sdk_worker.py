"""The Worker against a fake WorkerService: lease replies bounded in bytes, finish reports
split by size and never dropped as a batch, oversized results, and a shutdown that
releases unfinished tasks within a bounded time."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

import cronoq
from cronoq import worker as worker_mod
from cronoq.v1 import task_pb2
from cronoq.v1 import worker_service_pb2 as pb

MiB = 1 << 20
FAST = cronoq.RetryConfig(initial_backoff=0.001, max_backoff=0.01, max_elapsed=None)


def rpc_error(code: grpc.StatusCode, details: str = "", trailing: Any = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


def task(task_id: int, payload: Any = None, attempt: int = 1) -> task_pb2.Task:
    data = json.dumps(payload).encode() if payload is not None else b""
    return task_pb2.Task(
        id=task_id, pool="default", attempt=attempt, payload=data, content_type="application/json" if data else ""
    )


class FakeWorkerService:
    """A scripted WorkerService: `leases` holds replies (task lists) or errors to raise, in order;
    `finish` decides each FinishTasks call (default: accept everything)."""

    def __init__(self, register: pb.RegisterWorkerResponse | None = None):
        self.register_resp = register or pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=60_000)
        self.leases: list[list[task_pb2.Task] | BaseException] = []
        self.lease_requests: list[pb.LeaseTasksRequest] = []
        self.finish: Callable[[pb.FinishTasksRequest], Awaitable[pb.FinishTasksResponse]] = self.accept
        self.finish_requests: list[tuple[int, list[tuple[int, str]]]] = []  # (ByteSize, [(task id, kind)])
        self.accepted: Counter[int] = Counter()
        self.outcomes: dict[int, pb.TaskOutcome] = {}  # accepted, by task id
        self.heartbeat_cancels: list[int] = []
        self.deregistered = False

    async def accept(self, req: pb.FinishTasksRequest) -> pb.FinishTasksResponse:
        for o in req.outcomes:
            self.accepted[o.task_id] += 1
            self.outcomes[o.task_id] = o
        return pb.FinishTasksResponse(
            results=[pb.FinishTaskResult(task_id=o.task_id, accepted=True) for o in req.outcomes]
        )

    async def RegisterWorker(self, req: Any, metadata: Any = None, timeout: Any = None) -> Any:
        return self.register_resp

    async def LeaseTasks(self, req: pb.LeaseTasksRequest, metadata: Any = None, timeout: Any = None) -> Any:
        self.lease_requests.append(pb.LeaseTasksRequest(max_tasks=req.max_tasks, max_bytes=req.max_bytes))
        if not self.leases:
            await asyncio.sleep(min(req.wait_ms / 1000, 0.02))
            return pb.LeaseTasksResponse()
        reply = self.leases.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return pb.LeaseTasksResponse(tasks=reply)

    async def Heartbeat(self, req: pb.HeartbeatRequest, metadata: Any = None, timeout: Any = None) -> Any:
        cancels, self.heartbeat_cancels = self.heartbeat_cancels, []
        return pb.HeartbeatResponse(cancelled_task_ids=cancels)

    async def FinishTasks(self, req: pb.FinishTasksRequest, metadata: Any = None, timeout: Any = None) -> Any:
        self.finish_requests.append((req.ByteSize(), [(o.task_id, o.WhichOneof("outcome")) for o in req.outcomes]))
        return await self.finish(req)

    async def DeregisterWorker(self, req: Any, metadata: Any = None, timeout: Any = None) -> Any:
        self.deregistered = True
        return pb.DeregisterWorkerResponse()


def make_worker(fake: FakeWorkerService, handler: Any, **options: Any) -> cronoq.Worker:
    options.setdefault("concurrency", 8)
    options.setdefault("poll_wait", 0.02)
    options.setdefault("retry", FAST)
    worker = cronoq.Worker("http://127.0.0.1:1", "default", handler, **options)
    worker._conn._stub = fake  # no channel: every call goes to the fake
    return worker


async def until(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
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
    await until(lambda: fake.lease_requests, what="a lease")
    await stop(worker, running)
    assert worker.max_result_bytes == want_result
    assert fake.lease_requests[0].max_bytes == want_lease


# -- lease failures -----------------------------------------------------------------


async def test_refused_lease_replies_halve_max_bytes_and_the_worker_keeps_leasing(caplog):
    caplog.set_level(logging.ERROR, "cronoq.worker")
    fake = FakeWorkerService()
    fake.leases = [
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (70000000 vs. 67108864)"),
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max"),
        rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "max_tasks: odd"),
        rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "no shard named"),  # no endpoint: not a redirect
        ValueError("a reply that cannot be read"),
        [task(1, {"n": 1})],
    ]
    worker = make_worker(fake, echo)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.accepted[1] == 1, what="the task leased after the failures to finish")
    assert not running.done()
    await stop(worker, running)
    sent = [r.max_bytes for r in fake.lease_requests[:7]]
    assert sent == [16 * MiB, 8 * MiB, 4 * MiB, 2 * MiB, 1 * MiB, 1 * MiB, 1 * MiB]
    assert fake.outcomes[1].success.result == b'{"id":1}'
    assert sum("lease failed" in r.getMessage() for r in caplog.records) == 5


@pytest.mark.parametrize("code", [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED])
async def test_refused_credentials_end_run_with_the_reason(code):
    fake = FakeWorkerService()
    fake.leases = [rpc_error(code, "token revoked")]
    worker = make_worker(fake, echo)
    with pytest.raises(cronoq.CronoqError, match="token revoked"):
        await asyncio.wait_for(worker.run(), 10)


async def test_transient_lease_failures_keep_max_bytes():
    fake = FakeWorkerService()
    fake.leases = [rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED), rpc_error(grpc.StatusCode.INTERNAL), [task(1)]]
    worker = make_worker(fake, echo)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.accepted[1] == 1, what="the task to finish")
    await stop(worker, running)
    assert {r.max_bytes for r in fake.lease_requests} == {16 * MiB}


async def test_a_shard_redirect_while_leasing_still_ends_run():
    fake = FakeWorkerService()
    redirect = (("cronoq-shard", "west"), ("cronoq-shard-endpoint", "http://127.0.0.1:2"))
    fake.leases = [rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "pool moved", redirect)]
    worker = make_worker(fake, echo)
    with pytest.raises(cronoq.errors.FailedPrecondition, match="pool moved"):
        await asyncio.wait_for(worker.run(), 10)


# -- results and finish reports -----------------------------------------------------


async def test_a_result_over_max_result_bytes_is_a_final_failure():
    fake = FakeWorkerService(
        pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=60_000, max_result_bytes=1000)
    )
    fake.leases = [[task(1, {"size": 1000}), task(2, {"size": 1001}), task(3, {"json": 995})]]

    async def handle(ctx: cronoq.TaskContext) -> Any:
        if "json" in ctx.payload:
            return {"s": "x" * ctx.payload["json"]}  # 1003 bytes once encoded
        return b"x" * ctx.payload["size"]

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.outcomes) == 3, what="three outcomes")
    await stop(worker, running)
    assert fake.outcomes[1].success.result == b"x" * 1000
    for task_id, size in ((2, 1001), (3, 1003)):
        failure = fake.outcomes[task_id].failure
        assert failure.error == f"result of {size} bytes exceeds max_result_bytes 1000"
        assert failure.retryable is False


def outcome(task_id: int, result_bytes: int = 0) -> pb.TaskOutcome:
    return pb.TaskOutcome(task_id=task_id, attempt=1, success=pb.TaskSuccess(result=b"r" * result_bytes))


def test_finish_batches_stay_under_the_send_limit_and_the_count_cap():
    worker = make_worker(FakeWorkerService(), echo)
    worker.worker_id = "w" * 32
    worker._outcomes = [outcome(i, 4_000_000) for i in range(40)]  # 160 MB in all
    sizes = []
    while worker._outcomes:
        batch = worker._next_batch()
        size = pb.FinishTasksRequest(worker_id=worker.worker_id, outcomes=batch).ByteSize()
        assert batch and size <= 64 * MiB - 1 * MiB
        sizes.append(len(batch))
    assert sizes == [16, 16, 8]

    worker._outcomes = [outcome(i) for i in range(2500)]
    assert [len(worker._next_batch()) for _ in range(3)] == [1000, 1000, 500]

    worker._outcomes = [outcome(1, 70 * MiB), outcome(2)]  # one outcome always goes, alone
    assert [[o.task_id for o in worker._next_batch()] for _ in range(2)] == [[1], [2]]


async def test_big_results_finish_in_several_requests():
    fake = FakeWorkerService()
    fake.leases = [[task(i) for i in range(1, 21)]]
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> bytes:
        if ctx.id == 20:
            release.set()
        await release.wait()  # all twenty outcomes queue up together
        return bytes(4_000_000)

    worker = make_worker(fake, handle, concurrency=20)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 20, what="twenty outcomes")
    await stop(worker, running)
    assert set(fake.accepted.values()) == {1}
    assert len(fake.finish_requests) >= 2
    assert all(size <= 63 * MiB for size, _ in fake.finish_requests)


async def test_a_refused_report_is_sent_again_in_halves_and_only_the_refused_outcome_is_dropped(caplog):
    caplog.set_level(logging.WARNING, "cronoq.worker")
    fake = FakeWorkerService()
    fake.leases = [[task(i) for i in range(1, 9)]]
    poison = 5

    async def finish(req: pb.FinishTasksRequest) -> pb.FinishTasksResponse:
        if any(o.task_id == poison for o in req.outcomes):
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"outcomes: task {poison} is malformed")
        return await fake.accept(req)

    fake.finish = finish
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        if ctx.id == 8:
            release.set()
        await release.wait()
        return {"id": ctx.id}

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 7 and not worker._unacked, what="seven accepted outcomes")
    await stop(worker, running)
    assert fake.accepted == Counter({i: 1 for i in range(1, 9) if i != poison})
    assert sorted(fake.finish_requests[0][1]) == [(i, "success") for i in range(1, 9)]  # one batch at first
    assert [ids for _, ids in fake.finish_requests if ids == [(poison, "success")]]  # then refused alone
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and f"task {poison} " in dropped[0] and "malformed" in dropped[0]


async def test_a_report_too_large_for_the_server_is_split_until_it_fits():
    fake = FakeWorkerService()
    fake.leases = [[task(i) for i in range(1, 9)]]

    async def finish(req: pb.FinishTasksRequest) -> pb.FinishTasksResponse:
        if len(req.outcomes) > 2:  # e.g. a server with a smaller receive limit
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max")
        return await fake.accept(req)

    fake.finish = finish
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        if ctx.id == 8:
            release.set()
        await release.wait()
        return {"id": ctx.id}

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 8, what="eight accepted outcomes")
    await stop(worker, running)
    assert set(fake.accepted.values()) == {1}
    assert [len(ids) for _, ids in fake.finish_requests] == [8, 4, 2, 2, 4, 2, 2]


async def test_transient_finish_failures_resend_the_same_batch():
    fake = FakeWorkerService()
    fake.leases = [[task(i) for i in range(1, 4)]]
    failures = [rpc_error(grpc.StatusCode.UNAVAILABLE), rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)]

    async def finish(req: pb.FinishTasksRequest) -> pb.FinishTasksResponse:
        if failures:
            raise failures.pop(0)
        return await fake.accept(req)

    fake.finish = finish
    release = asyncio.Event()

    async def handle(ctx: cronoq.TaskContext) -> Any:
        if ctx.id == 3:
            release.set()
        await release.wait()

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(fake.accepted) == 3, what="three accepted outcomes")
    await stop(worker, running)
    assert [len(ids) for _, ids in fake.finish_requests] == [3, 3, 3]
    assert set(fake.accepted.values()) == {1}


# -- shutdown -----------------------------------------------------------------------


async def test_stop_releases_a_task_still_running_after_the_grace():
    fake = FakeWorkerService()
    fake.leases = [[task(1, {"sleep": 3600}), task(2, {"sleep": 0.05})]]
    started: list[int] = []

    async def handle(ctx: cronoq.TaskContext) -> Any:
        started.append(ctx.id)
        await asyncio.sleep(ctx.payload["sleep"])
        return "done"

    worker = make_worker(fake, handle, shutdown_grace=0.3)
    running = asyncio.create_task(worker.run())
    await until(lambda: len(started) == 2, what="both tasks to start")
    took = await stop(worker, running)
    assert 0.3 <= took < 0.3 + 1.0
    assert fake.outcomes[1].WhichOneof("outcome") == "released"
    assert fake.outcomes[1].released.reason == "worker shut down"
    assert fake.outcomes[1].attempt == 1
    assert fake.outcomes[2].success.result == b'"done"'  # finished within the grace
    assert fake.deregistered


async def test_a_task_the_server_cancelled_is_still_reported_cancelled_at_shutdown():
    fake = FakeWorkerService(pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=100))
    fake.leases = [[task(1)]]
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
    await until(lambda: worker._running, what="the task to start")
    fake.heartbeat_cancels = [1]
    await until(lambda: cancels == 1, what="the server's cancel")
    await stop(worker, running)
    assert fake.outcomes[1].WhichOneof("outcome") == "cancelled"
    assert fake.outcomes[1].cancelled.reason == "cancelled"


async def test_stop_is_bounded_with_a_handler_that_ignores_cancellation_and_a_server_that_hangs(monkeypatch):
    monkeypatch.setattr(worker_mod, "UNWIND_S", 0.1)
    monkeypatch.setattr(worker_mod, "STOP_EXTRA_S", 0.6)
    fake = FakeWorkerService()
    fake.leases = [[task(1)]]
    reported = asyncio.Event()

    async def hang(req: pb.FinishTasksRequest) -> pb.FinishTasksResponse:
        reported.set()
        await asyncio.sleep(3600)  # a server that never answers
        raise AssertionError("unreachable")

    fake.finish = hang

    stubborn_on = True

    async def stubborn(ctx: cronoq.TaskContext) -> Any:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not stubborn_on:
                    raise

    worker = make_worker(fake, stubborn, shutdown_grace=0.3)
    running = asyncio.create_task(worker.run())
    await until(lambda: worker._running, what="the task to start")
    took = await stop(worker, running)
    assert took < 0.3 + 0.6 + 0.5
    assert reported.is_set()
    assert fake.finish_requests == [(fake.finish_requests[0][0], [(1, "released")])]
    stubborn_on = False  # the stubborn handler was left running: end it
    (handle, _), *_ = worker._running.values()
    handle.cancel()
    await asyncio.gather(handle, return_exceptions=True)
    assert fake.finish_requests[1:] == []  # and its late end is not reported


async def test_a_handlers_own_cancelled_error_is_a_retryable_failure():
    fake = FakeWorkerService()
    fake.leases = [[task(1)]]

    async def handle(ctx: cronoq.TaskContext) -> Any:
        raise asyncio.CancelledError

    worker = make_worker(fake, handle)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.outcomes, what="an outcome")
    await stop(worker, running)
    assert fake.outcomes[1].failure.retryable is True
