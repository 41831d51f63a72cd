"""Extreme values in every numeric field a caller sets, on SQLite and PostgreSQL.

A property test over a seeded table of values: each request that carries one extreme value
is either refused with INVALID_ARGUMENT naming the field, or accepted; and after each, the
pool still leases and finishes a normal task (one task's value must never stall its pool:
a timeout_ms of 2^63-1 once made every lease of its pool fail on PostgreSQL).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from _helpers import Api, store_table

from cronoq.v1 import schedule_service_pb2 as spb
from cronoq.v1 import schedule_service_pb2_grpc, task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb
from cronoq_server.core.limits import TASK_RANGES

INT32 = (-(2**31), 2**31 - 1)
UINT32 = (0, 2**32 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)
TIMESTAMP_S = (-62_135_596_800, 253_402_300_799)  # google.protobuf.Timestamp's range


def extremes(low: int, high: int, seed: str) -> list[int]:
    """The edges of a type's range, the values around 0 and the usual overflow points within it,
    the edges of the field's documented range and the values just past them, and a few seeded
    random values."""
    fixed = {0, 1, -1, low, high, low + 1, high - 1, 2**31 - 1, 2**32, 2**53, 9_223_372_036_854_775, 10**15}
    if (allowed := TASK_RANGES.get(seed.removeprefix("schedule "))) is not None:
        fixed |= {allowed.low - 1, allowed.low, allowed.high, allowed.high + 1}
    rng = random.Random(seed)
    fixed.update(rng.randint(low, high) for _ in range(3))
    fixed.update(rng.randint(0, min(high, 10**7)) for _ in range(2))
    return sorted(v for v in fixed if low <= v <= high)


SUBMIT_FIELDS: dict[str, tuple[int, int]] = {
    "priority": INT32,
    "max_attempts": INT32,
    "timeout_ms": INT64,
    "resources.gpu": INT64,  # a concurrency resource, capacity 2
    "resources.api": INT64,  # a rate resource, burst 3
    "run_at.seconds": INT64,
    "run_at.nanos": INT32,
}
SCHEDULE_FIELDS = ("priority", "max_attempts", "timeout_ms", "resources.gpu", "resources.api")


@pytest.fixture(params=["sqlite", "postgres"])
def store_kind(request: pytest.FixtureRequest) -> dict[str, Any]:
    return store_table(request.param, request)


def _config(store: dict[str, Any]) -> dict[str, Any]:
    return {
        "store": store,
        "pools": [{"name": "default", "lease_ttl": "30s", "retry_backoff": "50ms"}],
        "resources": [{"name": "gpu", "concurrency": 2}, {"name": "api", "rate": 1000, "burst": 3}],
    }


def _with_field(message: Any, field: str, value: int) -> Any:
    if field.startswith("resources."):
        message.resources[field.split(".", 1)[1]] = value
    elif field.startswith("run_at."):
        setattr(message.run_at, field.split(".", 1)[1], value)
    else:
        setattr(message, field, value)
    return message


class Probe:
    """Calls with one extreme value each, then a normal task through the pool."""

    def __init__(self, api: Api, worker: str):
        self.api = api
        self.worker = worker
        self.problems: list[str] = []

    def call(self, case: str, field: str, fn: Callable[[], Any], value: int | None = None) -> Any:
        """fn's answer, or None when refused; with value, a field of TASK_RANGES must be accepted
        exactly when the value is in its range."""
        allowed = TASK_RANGES.get(field.rsplit(".", 1)[-1])
        answer = self._call(case, field, fn)
        if allowed is not None and value is not None and (answer is not None) != (allowed.low <= value <= allowed.high):
            self.problems.append(f"{case}: {'accepted' if answer is not None else 'refused'}; range {allowed}")
        return answer

    def _call(self, case: str, field: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except grpc.RpcError as err:
            details = err.details() or ""
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                self.problems.append(f"{case}: {err.code().name} {details!r}, want OK or INVALID_ARGUMENT")
            elif field not in details:
                self.problems.append(f"{case}: INVALID_ARGUMENT {details!r} does not name {field!r}")
            return None

    def pool_still_works(self, case: str) -> None:
        """A normal task is leased (with whatever else is due) and finished; what was leased
        beside it is finished too (or was already lost to its own short timeout), so no slot
        stays held."""
        normal = self.api.submit(payload=b"normal").id
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                leased = self.api.lease(self.worker, n=100, wait_ms=200)
            except grpc.RpcError as err:
                self.problems.append(f"after {case}: LeaseTasks {err.code().name} {err.details()!r}")
                return
            for task in leased:
                result = self.api.succeed(self.worker, task)
                if not result.accepted and task.id == normal:
                    self.problems.append(f"after {case}: finishing task {task.id}: {result.code} {result.message!r}")
            if any(t.id == normal for t in leased):
                if self.api.get(normal).state != task_pb2.TASK_STATE_SUCCEEDED:
                    self.problems.append(f"after {case}: the normal task did not succeed")
                return
        self.problems.append(f"after {case}: the normal task was not leased within 20 s")


def test_extreme_values_never_stall_the_pool(start_server: Any, store_kind: dict[str, Any]) -> None:
    srv = start_server(_config(store_kind))
    api = Api(srv.grpc_target)
    schedules = schedule_service_pb2_grpc.ScheduleServiceStub(api.channel)
    worker = api.register()
    probe = Probe(api, worker)

    # Tasks: SubmitTask and SubmitBatch, one field at a time.
    for field, (low, high) in SUBMIT_FIELDS.items():
        name = field.split(".")[0]  # the message names resources['gpu'], run_at with seconds and nanos
        for value in extremes(low, high, field):
            case = f"SubmitTask {field}={value}"
            req = _with_field(tpb.SubmitTaskRequest(pool="default"), field, value)
            probe.call(case, name, lambda req=req: api.tasks.SubmitTask(req, timeout=10), value)
            batch = tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default"), req])
            probe.call(
                f"SubmitBatch {field}={value}", f"tasks[1].{name}", lambda b=batch: api.tasks.SubmitBatch(b), value
            )
            probe.pool_still_works(case)

    # Schedules: every accepted one fires (every second) beside the others, then the pool must work.
    names = []
    for field in SCHEDULE_FIELDS:
        low, high = SUBMIT_FIELDS[field]
        name = field.split(".")[0]
        for i, value in enumerate(extremes(low, high, "schedule " + field)):
            sched = _with_field(
                spb.Schedule(pool="default", name=f"x-{field.replace('.', '-')}-{i}", cron="* * * * * *"), field, value
            )
            put = spb.PutScheduleRequest(schedule=sched)
            case = f"PutSchedule {field}={value}"
            if (
                probe.call(case, f"schedule.{name}", lambda p=put: schedules.PutSchedule(p, timeout=10), value)
                is not None
            ):
                names.append(sched.name)
    time.sleep(2.5)  # every accepted schedule fires at least once
    for name in names:
        schedules.DeleteSchedule(spb.DeleteScheduleRequest(pool="default", name=name), timeout=10)
    probe.pool_still_works("the schedules' tasks")

    # Worker and read calls: each numeric field alone.
    done = api.submit()
    [leased] = api.lease(worker, n=1)
    api.succeed(worker, leased)
    for value in extremes(*INT32, "concurrency"):
        req = wpb.RegisterWorkerRequest(name="x", pools=["default"], concurrency=value)
        probe.call(f"RegisterWorker concurrency={value}", "concurrency", lambda r=req: api.workers.RegisterWorker(r))
    for field, (low, high) in {"max_tasks": INT32, "wait_ms": UINT32, "max_bytes": UINT64}.items():
        for value in extremes(low, high, field):
            api.submit(payload=b"normal")  # due, so even the longest wait returns at once
            req = _with_field(wpb.LeaseTasksRequest(worker_id=worker, max_tasks=100, wait_ms=100), field, value)
            got = probe.call(f"LeaseTasks {field}={value}", field, lambda r=req: api.workers.LeaseTasks(r, timeout=30))
            for task in getattr(got, "tasks", ()):
                api.succeed(worker, task)
            probe.pool_still_works(f"LeaseTasks {field}={value}")
    for value in extremes(*UINT32, "retry_after_ms"):
        api.submit(max_attempts=2)
        lease = wpb.LeaseTasksRequest(worker_id=worker, max_tasks=100)
        for task in getattr(probe.call("LeaseTasks", "", lambda r=lease: api.workers.LeaseTasks(r)), "tasks", ()):
            outcome = wpb.TaskOutcome(
                task_id=task.id, attempt=task.attempt, failure=wpb.TaskFailure(error="x", retry_after_ms=value)
            )
            req = wpb.FinishTasksRequest(worker_id=worker, outcomes=[outcome])
            probe.call(
                f"FinishTasks retry_after_ms={value}", "retry_after_ms", lambda r=req: api.workers.FinishTasks(r)
            )
        probe.pool_still_works(f"FinishTasks retry_after_ms={value}")
    for value in extremes(*INT32, "attempt"):
        beat = wpb.HeartbeatRequest(worker_id=worker, tasks=[wpb.TaskAttempt(task_id=done.id, attempt=value)])
        probe.call(f"Heartbeat attempt={value}", "attempt", lambda r=beat: api.workers.Heartbeat(r))
    for value in extremes(*UINT32, "wait timeout_ms"):
        req = tpb.WaitTaskRequest(task=task_pb2.TaskRef(id=done.id), timeout_ms=value)  # ended: answers at once
        probe.call(f"WaitTask timeout_ms={value}", "timeout_ms", lambda r=req: api.tasks.WaitTask(r, timeout=10))
    for value in extremes(*INT32, "page_size"):
        req = tpb.ListTasksRequest(pool="default", page_size=value)
        probe.call(f"ListTasks page_size={value}", "page_size", lambda r=req: api.tasks.ListTasks(r, timeout=10))
    probe.pool_still_works("the worker and read calls")

    assert not probe.problems, "\n".join(probe.problems)
    assert srv.log().count("Traceback") == 0, srv.log()[-3000:]
