"""Bulk actions under load, on both stores: many callers' dry runs scanning every task at once, or
a long delete, leave another caller's SubmitTask+GetTask fast; a caller's bulk calls beyond
limits.max_bulk_calls are refused with RESOURCE_EXHAUSTED and when to retry."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import grpc
import pytest
from _helpers import Api, store_table  # type: ignore[import-not-found]
from conftest import ServerProcess  # type: ignore[import-not-found]

from cronoq.status import decode_details
from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

pytestmark = pytest.mark.timeout(600)

SCANNERS = 8  # callers, each with limits.max_bulk_calls (4) dry runs at once: 32 scans
MAX_BULK_CALLS = 4
FAILED_TASKS = 8000
ERROR = hashlib.sha256(b"x").hexdigest() * 128  # 8 KiB, not compressible to a few bytes
QUIET_S, LOADED_S = 3.0, 6.0
# Another caller's p99 under load at most this, or LOADED_OVER_QUIET times its quiet p99 when the
# machine is too busy for that (today's code: seconds on PostgreSQL).
P99_BOUND_S = 0.05
LOADED_OVER_QUIET = 3.0


def _token(name: str, pools: list[str], permissions: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "sha256": hashlib.sha256(name.encode()).hexdigest(),
        "pools": pools,
        "permissions": permissions,
    }


@pytest.fixture(params=["sqlite", "postgres"])
def srv(request: pytest.FixtureRequest, start_server: Any) -> ServerProcess:
    scanners = [_token(f"scan{i}", ["default"], ["submit", "read"]) for i in range(SCANNERS)]
    return start_server(
        {
            "pools": [{"name": "default", "lease_ttl": "60s"}, {"name": "probe"}],
            "store": store_table(request.param, request),
            "tokens": [
                _token("admin", ["*"], ["submit", "read", "cancel", "work", "admin"]),
                _token("probe", ["probe"], ["submit", "read"]),
                *scanners,
            ],
        }
    )


def _as(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def make_failed(api: Api, total: int, error: str) -> None:
    """total tasks of pool default, FAILED after their one attempt with this error."""
    admin = _as("admin")
    worker = api.workers.RegisterWorker(
        wpb.RegisterWorkerRequest(name="setup", pools=["default"], concurrency=1000), metadata=admin
    ).worker_id
    for done in range(0, total, 1000):
        n = min(1000, total - done)
        req = tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default", max_attempts=1)] * n)
        api.tasks.SubmitBatch(req, metadata=admin, timeout=60)
        leased = api.workers.LeaseTasks(
            wpb.LeaseTasksRequest(worker_id=worker, max_tasks=n), metadata=admin, timeout=60
        ).tasks
        assert len(leased) == n
        for i in range(0, n, 250):  # 250 errors of 8 KiB: 2 MiB, under gRPC's 4 MiB message cap
            outcomes = [
                wpb.TaskOutcome(task_id=t.id, attempt=t.attempt, failure=wpb.TaskFailure(error=error, retryable=False))
                for t in leased[i : i + 250]
            ]
            req = wpb.FinishTasksRequest(worker_id=worker, outcomes=outcomes)
            api.workers.FinishTasks(req, metadata=admin, timeout=60)


class Probe:
    """Another caller: SubmitTask then GetTask of that task, one pair at a time, timed."""

    def __init__(self, api: Api):
        self.api = api

    def measure(self, seconds: float) -> list[float]:
        took: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            req = tpb.SubmitTaskRequest(pool="probe", payload=b"p")
            task = self.api.tasks.SubmitTask(req, metadata=_as("probe"), timeout=60).task
            self.api.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=_as("probe"))
            took.append(time.perf_counter() - started)
        return took


def p99(took: list[float]) -> float:
    ordered = sorted(took)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def figures(what: str, took: list[float]) -> str:
    ordered = sorted(took)
    return f"{what}: {len(took)} calls, p50 {ordered[len(ordered) // 2] * 1e3:.1f} ms, p99 {p99(took) * 1e3:.1f} ms"


class Scanners:
    """Each of SCANNERS callers runs MAX_BULK_CALLS dry runs at once, again and again, with a
    filter that matches none of the tasks (so every call reads them all)."""

    def __init__(self, api: Api):
        self.api = api
        self.stop = threading.Event()
        self.answered = 0
        self.refused: list[grpc.RpcError] = []
        self.threads = [
            threading.Thread(target=self._run, args=(f"scan{i}",), daemon=True)
            for i in range(SCANNERS)
            for _ in range(MAX_BULK_CALLS)
        ]

    def _run(self, token: str) -> None:
        req = tpb.RetryTasksRequest(filter=tpb.TaskFilter(error_contains="no such text"), dry_run=True)
        while not self.stop.is_set():
            try:
                self.api.tasks.RetryTasks(req, metadata=_as(token), timeout=120)
                self.answered += 1
            except grpc.RpcError as err:
                self.refused.append(err)

    def __enter__(self) -> Scanners:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


def test_concurrent_dry_runs_leave_other_callers_fast_and_a_callers_extra_bulk_call_is_refused(
    srv: ServerProcess,
) -> None:
    api = Api(srv.grpc_target)
    make_failed(api, FAILED_TASKS, ERROR)
    probe = Probe(api)
    probe.measure(0.5)  # warm
    quiet = probe.measure(QUIET_S)
    with Scanners(api) as scanners:
        time.sleep(1.0)  # every scan under way
        loaded = probe.measure(LOADED_S)
        # A scanner's calls are back to back: scan0 may be between two, so its 5th is tried again.
        extra = tpb.RetryTasksRequest(filter=tpb.TaskFilter(error_contains="no such text"), dry_run=True)
        refused: grpc.RpcError | None = None
        for _ in range(20):
            try:
                api.tasks.RetryTasks(extra, metadata=_as("scan0"), timeout=120)
            except grpc.RpcError as err:
                refused = err
                break
        filter_json = {"filter": {"error_contains": "no such text"}, "dry_run": True}
        for _ in range(20):
            status, body = srv.http("POST", "/v1/tasks/bulk-retry", filter_json, timeout=120, token="scan1")
            if status != 200:
                break
    print(figures("quiet", quiet), figures("loaded", loaded), f"dry runs answered: {scanners.answered}")
    assert not scanners.refused, [e.details() for e in scanners.refused[:3]]  # type: ignore[attr-defined]
    assert scanners.answered >= SCANNERS * MAX_BULK_CALLS
    assert p99(loaded) <= max(P99_BOUND_S, LOADED_OVER_QUIET * p99(quiet)), (
        figures("quiet", quiet),
        figures("loaded", loaded),
    )

    assert refused is not None, "a 5th bulk call of one caller was never refused"
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()  # type: ignore[attr-defined]
    assert f"limits.max_bulk_calls: 'scan0' has {MAX_BULK_CALLS} bulk calls in progress" in refused.details()  # type: ignore[attr-defined]
    details = decode_details(refused.trailing_metadata())  # type: ignore[attr-defined]
    assert details is not None and details.reason == "BULK_CALLS_LIMIT" and details.retry_delay == 1.0, details
    assert (status, body["code"], body["reason"]) == (429, "RESOURCE_EXHAUSTED", "BULK_CALLS_LIMIT"), body


def test_a_long_delete_leaves_other_callers_fast(srv: ServerProcess) -> None:
    api = Api(srv.grpc_target)
    total = 2000
    make_failed(api, total, "boom")
    probe = Probe(api)
    probe.measure(0.5)
    quiet = probe.measure(QUIET_S)
    answers: list[tpb.DeleteTasksResponse] = []

    def delete() -> None:
        req = tpb.DeleteTasksRequest(filter=tpb.TaskFilter(pool="default", states=[task_pb2.TASK_STATE_FAILED]))
        while not answers or answers[-1].incomplete:
            answers.append(api.tasks.DeleteTasks(req, metadata=_as("admin"), timeout=120))

    deleting = threading.Thread(target=delete, daemon=True)
    started = time.perf_counter()
    deleting.start()
    loaded: list[float] = []
    while deleting.is_alive():
        loaded += probe.measure(0.2)
    took = time.perf_counter() - started
    deleting.join()
    print(figures("quiet", quiet), figures("while deleting", loaded), f"delete of {total}: {took:.1f} s")
    assert sum(a.changed for a in answers) == total
    assert p99(loaded) <= max(P99_BOUND_S, LOADED_OVER_QUIET * p99(quiet)), (
        figures("quiet", quiet),
        figures("loaded", loaded),
    )
