"""Resources enforced at lease time, and execution timeouts: real servers, real worker
processes, on SQLite and PostgreSQL."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import Api, eventually, log_lines, max_overlap, run_intervals, start_worker, store_table

from cronoq.v1 import task_pb2

SUCCEEDED = task_pb2.TASK_STATE_SUCCEEDED


@pytest.fixture(params=["sqlite", "postgres"])
def store_kind(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The [store] table of a fresh store of each kind."""
    return store_table(request.param, request)


def config(store: dict[str, Any], resources: list[dict[str, Any]], **pool: Any) -> dict[str, Any]:
    return {
        "store": store,
        "pools": [{"name": "default", "lease_ttl": "2s", "retry_backoff": "50ms", **pool}],
        "resources": resources,
    }


def submit(api: Api, n: int, job: dict[str, Any] | None = None, **kw: Any) -> list[int]:
    payload = json.dumps(job or {}).encode()
    return [api.submit(payload=payload, content_type="application/json", **kw).id for _ in range(n)]


def all_succeed(api: Api, ids: list[int], timeout: float = 30.0) -> list[task_pb2.Task]:
    return eventually(
        lambda: (tasks := [api.get(i) for i in ids]) and all(t.state == SUCCEEDED for t in tasks) and tasks,
        timeout=timeout,
        what=f"{len(ids)} tasks succeed",
    )


def test_concurrency_never_exceeds_capacity_and_slots_return_after_a_worker_dies(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, [{"name": "gpu", "concurrency": 2}]))
    api = Api(srv.grpc_target)
    # Two workers whose tasks hang on attempt 1: one is SIGKILLed holding both slots.
    doomed_log = tmp_path / "doomed.log"
    doomed = start_worker(srv.endpoint, "default", doomed_log, concurrency=8)
    hung = submit(api, 2, {"sleep_first": 60}, resources={"gpu": 1})
    eventually(lambda: len(log_lines(doomed_log, "start")) == 2, what="the first worker holds both gpu slots")
    plain = submit(api, 3)  # tasks without resources still run beside them
    all_succeed(api, plain)
    doomed.kill()
    doomed.wait(5)
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    workers = [start_worker(srv.endpoint, "default", log, concurrency=8) for log in logs]
    try:
        ids = submit(api, 20, {"sleep": 0.15}, resources={"gpu": 1})
        tasks = all_succeed(api, hung + ids, timeout=45)
        assert {t.attempt for t in tasks[:2]} == {2}  # the dead worker's leases expired; slots came back
        intervals = [iv for log in logs for iv in run_intervals(log)]
        assert len(intervals) == 22
        assert max_overlap(intervals) == 2
    finally:
        for w in workers:
            w.kill()


def test_a_task_waiting_for_a_resource_does_not_block_the_tasks_behind_it(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, [{"name": "gpu", "concurrency": 1}]))
    api = Api(srv.grpc_target)
    log = tmp_path / "w.log"
    worker = start_worker(srv.endpoint, "default", log, concurrency=8)
    try:
        (busy,) = submit(api, 1, {"sleep": 4}, resources={"gpu": 1}, priority=10)
        eventually(lambda: log_lines(log, "start"), what="the gpu task starts")
        (waiting,) = submit(api, 1, resources={"gpu": 1}, priority=10)  # ahead of the plain ones
        plain = submit(api, 5)
        all_succeed(api, plain, timeout=3)
        assert api.get(busy).state == task_pb2.TASK_STATE_RUNNING
        assert api.get(waiting).state == task_pb2.TASK_STATE_PENDING
        all_succeed(api, [busy, waiting], timeout=15)
    finally:
        worker.kill()


def test_a_long_poll_while_every_due_task_waits_for_a_resource_waits_to_be_told(
    start_server: Any, store_kind: dict[str, Any]
) -> None:
    """The due tasks wait for a slot: a long poll looks at the store again when one is freed (or a
    task becomes due), not every millisecond. Measured as the server's CPU time over the poll
    (looking again every millisecond took a fifth of a core or more)."""
    srv = start_server(config(store_kind, [{"name": "gpu", "concurrency": 1}], lease_ttl="60s"))
    api = Api(srv.grpc_target)
    submit(api, 20, resources={"gpu": 1})
    holder, poller = api.register(), api.register()
    (held,) = api.lease(holder, n=1)
    cpu = process_cpu_seconds(srv.proc.pid)
    started = time.monotonic()
    assert api.lease(poller, n=1, wait_ms=3000) == []  # the slot stays held for the whole poll
    waited = time.monotonic() - started
    busy = process_cpu_seconds(srv.proc.pid) - cpu
    assert waited >= 2.9 and busy < 0.1 * waited, f"{busy:.2f} s of CPU over a {waited:.2f} s long poll"
    api.succeed(holder, held)
    assert len(api.lease(poller, n=5, wait_ms=3000)) == 1  # told: the slot is free again


def process_cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_rate_is_held_over_every_second(start_server: Any, store_kind: dict[str, Any], tmp_path: Path) -> None:
    srv = start_server(config(store_kind, [{"name": "api", "rate": 5, "burst": 1}]))
    api = Api(srv.grpc_target)
    ids = submit(api, 40, resources={"api": 1})
    worker = start_worker(srv.endpoint, "default", tmp_path / "w.log", concurrency=16)
    try:
        tasks = all_succeed(api, ids, timeout=30)
    finally:
        worker.kill()
    starts = sorted(t.started_at.ToMicroseconds() / 1e6 for t in tasks)
    for i, t in enumerate(starts):
        in_window = sum(1 for s in starts[i:] if s < t + 1.0)
        assert in_window <= 5 + 1, f"{in_window} starts in the second after {t - starts[0]:.3f}s"
    first_six = sum(1 for s in starts if s < starts[0] + 6.0)
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(starts)]
    assert abs(first_six - 30) <= 1, f"{first_six} starts in the first 6 s; gaps {gaps}"


def test_a_leader_failover_never_lets_more_than_the_capacity_run(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    cfg = config(store_kind, [{"name": "gpu", "concurrency": 2}], lease_ttl="10s")
    leader = start_server(cfg, name="replica0")
    standby = start_server(cfg, name="replica1", wait_ready=False)
    standby.wait_ready(leader=False)
    api = Api(leader.grpc_target)
    ids = submit(api, 12, {"sleep": 1.0}, resources={"gpu": 1})
    endpoints = f"{leader.endpoint},{standby.endpoint}"
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    workers = [start_worker(endpoints, "default", log, concurrency=8) for log in logs]
    try:
        eventually(lambda: sum(len(log_lines(log, "start")) for log in logs) >= 3, what="tasks run")
        leader.kill()  # two tasks are running under the old leader, holding both slots
        standby.wait_ready()
        api = Api(standby.grpc_target)
        all_succeed(api, ids, timeout=60)
        intervals = [iv for log in logs for iv in run_intervals(log)]
        assert max_overlap(intervals) <= 2
    finally:
        for w in workers:
            w.kill()


def test_a_handler_past_its_timeout_is_cancelled_and_retried(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, [], lease_ttl="30s", timeout="10s"))
    api = Api(srv.grpc_target)
    log = tmp_path / "w.log"
    worker = start_worker(srv.endpoint, "default", log)
    try:
        (task_id,) = submit(api, 1, {"sleep_first": 20}, timeout_ms=500)
        (capped,) = submit(api, 1, timeout_ms=60_000)
        assert api.get(capped).timeout_ms == 10_000  # capped by the pool's timeout
        (task,) = all_succeed(api, [task_id], timeout=10)
        assert task.attempt == 2
        starts = {
            int(p[2]): float(p[4]) for p in (line.split() for line in log.read_text().splitlines())
            if p[0] == "start" and int(p[1]) == task_id
        }  # fmt: skip
        assert sorted(starts) == [1, 2]
        assert 0.5 <= starts[2] - starts[1] < 3  # cancelled at 500 ms, not at lease expiry (30 s)
        assert [(t, a) for t, a, _ in log_lines(log, "done") if t == task_id] == [(task_id, 2)]
    finally:
        worker.kill()


def test_a_hung_worker_loses_the_task_at_its_deadline(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, [], lease_ttl="30s"))
    api = Api(srv.grpc_target)
    hung_log = tmp_path / "hung.log"
    hung = start_worker(srv.endpoint, "default", hung_log)
    try:
        (task_id,) = submit(api, 1, {"sleep_first": 60}, timeout_ms=1000)
        eventually(lambda: log_lines(hung_log, "start"), what="the task starts")
        hung.send_signal(signal.SIGSTOP)  # hangs entirely: no heartbeat, no cancellation
        stopped = time.monotonic()
        helper = start_worker(srv.endpoint, "default", tmp_path / "helper.log")
        try:
            (task,) = all_succeed(api, [task_id], timeout=15)
            assert task.attempt == 2
            assert time.monotonic() - stopped < 10  # the deadline, not the 30 s lease TTL
        finally:
            helper.kill()
    finally:
        hung.send_signal(signal.SIGCONT)
        hung.kill()
