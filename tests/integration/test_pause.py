"""Pausing a pool (PausePool / ResumePool): it accepts submissions, leases nothing, lets its
running tasks finish, and stays paused across a restart (SQLite) and a failover (PostgreSQL);
a pause of another shard's pool is forwarded there."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, eventually, log_lines, start_worker, store_table
from preconditions import missing  # type: ignore[import-not-found]
from test_sharding import TOKENS, TwoShards, bearer, metric  # type: ignore[import-not-found]

from cronoq.v1 import admin_service_pb2 as apb
from cronoq.v1 import admin_service_pb2_grpc, schedule_service_pb2_grpc, task_pb2
from cronoq.v1 import schedule_service_pb2 as spb
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

pytestmark = pytest.mark.timeout(180)

SLEEP = json.dumps({"sleep": 1.5}).encode()


def paused_in_snapshot(admin: Any, metadata: Any = ()) -> dict[str, bool]:
    snapshot = admin.GetSnapshot(apb.GetSnapshotRequest(), metadata=metadata, timeout=10)
    return {p.pool: p.paused for s in snapshot.shards for p in s.pools}


def paused_gauge(srv: Any) -> dict[str, float]:
    with urllib.request.urlopen(srv.http_url + "/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    prefix = 'cronoq_pool_paused{pool="'
    return {ln[len(prefix) :].split('"')[0]: float(ln.split()[-1]) for ln in lines if ln.startswith(prefix)}


def leases_nothing_for_a_second(api: Api, worker_id: str) -> None:
    """A long poll of the paused pool waits its whole second and gets nothing."""
    start = time.monotonic()
    assert api.lease(worker_id, wait_ms=1000) == []
    assert time.monotonic() - start >= 0.9


def started(log: Path, task_id: int) -> bool:
    return any(t == task_id for t, _, _ in log_lines(log, "start"))


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_paused_pool_accepts_leases_nothing_and_stays_paused(
    start_server: Any, kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    config = {"store": store_table(kind, request), "pools": [{"name": "default"}, {"name": "other"}]}
    srv = start_server(config, name="first")
    standby = None
    if kind == "postgres":  # on one schema: it takes over when the leader is killed
        standby = start_server(config, name="second", wait_ready=False)
        standby.wait_ready(leader=False)
    api = Api(srv.grpc_target)
    admin = admin_service_pb2_grpc.AdminServiceStub(api.channel)
    log = tmp_path / "w.log"
    endpoints = srv.endpoint + (f",{standby.endpoint}" if standby else "")
    worker = start_worker(endpoints, "default", log)  # a worker process: a Work stream
    try:
        running = api.submit(payload=SLEEP, content_type="application/json")
        eventually(lambda: started(log, running.id), what="the first task starts")

        status, body = srv.http("POST", "/v1/pools/default/pause", {})
        assert status == 200, body
        first = body["pause"]
        assert (first["pool"], first["paused"], first["paused_by"]) == ("default", True, "anonymous")
        assert first["paused_at"]
        again = admin.PausePool(apb.PausePoolRequest(pool="default")).pause
        assert again.paused and again.paused_at.ToJsonString() == first["paused_at"]  # the first pause is kept

        queued = api.submit(payload=b"{}", content_type="application/json")  # accepted
        assert queued.state == task_pb2.TASK_STATE_PENDING
        leases_nothing_for_a_second(api, api.register())
        other = api.register(pools=("other",))
        api.submit("other")
        assert len(api.lease(other, wait_ms=5000)) == 1  # another pool is leased as before
        # The running task finishes normally; the queued one waits.
        eventually(lambda: any(t == running.id for t, _, _ in log_lines(log, "done")), what="the running one ends")
        # The worker sends its outcome just after its handler returns.
        eventually(lambda: api.get(running.id).state == task_pb2.TASK_STATE_SUCCEEDED, what="its outcome is stored")
        assert not started(log, queued.id)
        assert paused_in_snapshot(admin) == {"default": True, "other": False}
        assert paused_gauge(srv) == {"default": 1.0, "other": 0.0}

        if standby is None:  # restart on the same file
            srv.stop()
            srv.start()
            leader = srv
        else:  # failover: the standby takes over on the same schema
            srv.kill()
            standby.wait_ready(timeout=30)
            leader = standby
        api = Api(leader.grpc_target)
        admin = admin_service_pb2_grpc.AdminServiceStub(api.channel)
        assert paused_in_snapshot(admin) == {"default": True, "other": False}
        assert paused_gauge(leader) == {"default": 1.0, "other": 0.0}
        leases_nothing_for_a_second(api, api.register())
        assert not started(log, queued.id)

        resumed_at = time.monotonic()
        status, body = leader.http("POST", "/v1/pools/default/resume", {})
        assert status == 200 and body["pause"] == {"pool": "default", "paused": False, "paused_by": ""}, body
        eventually(lambda: started(log, queued.id), what="the worker runs the queued one")
        assert time.monotonic() - resumed_at < 5
        assert paused_in_snapshot(admin)["default"] is False
        assert paused_gauge(leader) == {"default": 0.0, "other": 0.0}
    finally:
        worker.kill()


def test_resume_wakes_the_waiting_long_polls_and_bad_pools_are_refused(start_server: Any) -> None:
    srv = start_server({"pools": [{"name": "default"}, {"name": "cron"}]})
    api = Api(srv.grpc_target)
    admin = admin_service_pb2_grpc.AdminServiceStub(api.channel)
    admin.PausePool(apb.PausePoolRequest(pool="default"))
    # A paused pool's schedule fires as usual: its tasks wait.
    admin.PausePool(apb.PausePoolRequest(pool="cron"))
    schedules = schedule_service_pb2_grpc.ScheduleServiceStub(api.channel)
    every_second = spb.Schedule(pool="cron", name="tick", cron="* * * * * *")
    schedules.PutSchedule(spb.PutScheduleRequest(schedule=every_second), timeout=10)
    tasks = {api.submit().id for _ in range(3)}
    # Three long polls of one task each: without the resume's wake, the leader's once-a-second
    # nudge would hand them out one a second.
    polls = [
        api.workers.LeaseTasks.future(wpb.LeaseTasksRequest(worker_id=api.register(), max_tasks=1, wait_ms=30_000))
        for _ in range(3)
    ]
    time.sleep(1.5)
    assert not any(p.done() for p in polls)
    start = time.monotonic()
    admin.ResumePool(apb.ResumePoolRequest(pool="default"))
    assert {t.id for p in polls for t in p.result(timeout=10).tasks} == tasks
    assert time.monotonic() - start < 1.5
    fired = api.tasks.ListTasks(tpb.ListTasksRequest(pool="cron"), timeout=10).tasks
    assert fired and all(t.state == task_pb2.TASK_STATE_PENDING for t in fired)

    with pytest.raises(grpc.RpcError) as err:
        admin.PausePool(apb.PausePoolRequest(pool="nope"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'nope'" in (err.value.details() or "")
    status, body = srv.http("POST", "/v1/pools/nope/resume")  # no body: as good as {}
    assert status == 400 and "'nope'" in json.dumps(body), body


def test_pausing_a_pool_of_another_shard_is_forwarded(tmp_path: Path, start_server: Any) -> None:
    shards = TwoShards(tmp_path, start_server)
    admin = admin_service_pb2_grpc.AdminServiceStub(shards.stubs["cpu"].channel)
    pause = admin.PausePool(apb.PausePoolRequest(pool="llm"), metadata=bearer("full"), timeout=10).pause
    assert pause.paused and pause.paused_by == "full"
    assert metric(shards.gpu, "cronoq_pool_paused", pool="llm") == 1
    assert paused_in_snapshot(admin, bearer("full")) == {"default": False, "llm": True}
    status, body = shards.cpu.http("POST", "/v1/pools/llm/resume", {}, token=TOKENS["full"])
    assert status == 200 and body["pause"]["paused"] is False, body
    assert metric(shards.gpu, "cronoq_pool_paused", pool="llm") == 0
    assert metric(shards.cpu, "cronoq_pool_paused", pool="default") == 0


def samples(srv: Any) -> tuple[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    """The /metrics text, and its samples by name and labels."""
    with urllib.request.urlopen(srv.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if m and not line.startswith("#"):
            out[(m.group(1), frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))] = float(m.group(3))
    return text, out


def value(all_samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return all_samples.get((name, frozenset(labels.items())), 0.0)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_metrics_by_pool_after_a_known_workload(start_server: Any, kind: str, request: pytest.FixtureRequest) -> None:
    srv = start_server(
        {
            "store": store_table(kind, request),
            "pools": [{"name": "default", "lease_ttl": "1s", "retry_backoff": "50ms"}, {"name": "other"}],
        }
    )
    api = Api(srv.grpc_target)
    admin = admin_service_pb2_grpc.AdminServiceStub(api.channel)
    worker = api.register(pools=("default", "other"))
    began = time.monotonic()
    ok, retried, lost = (api.submit(max_attempts=2) for _ in range(3))
    cancelled, released = api.submit("other"), api.submit("other")
    assert {t.id for t in api.lease(worker)} == {ok.id, retried.id, lost.id, cancelled.id, released.id}
    admin.PausePool(apb.PausePoolRequest(pool="other"))  # its running tasks still report
    # Given back unfinished: leased, but neither an attempt that ran nor a retry; it waits.
    assert api.finish(worker, api.get(released.id), released=wpb.TaskReleased()).accepted
    api.succeed(worker, api.get(ok.id))
    api.fail(worker, api.get(retried.id))  # retried: attempts remain
    api.finish(worker, api.get(cancelled.id), cancelled=wpb.TaskCancelled(reason="no"))
    # `lost` is never heartbeaten: its 1 s lease expires, and it is retried.
    eventually(lambda: api.get(lost.id).error == "lease expired", what="the lease expires")
    again: list[task_pb2.Task] = []
    eventually(lambda: again.extend(api.lease(worker)) or len(again) == 2, what="both leased again")
    api.fail(worker, api.get(retried.id), retryable=False)
    api.succeed(worker, api.get(lost.id))

    expected = {
        ("cronoq_tasks_leased_total", "default", ""): 5,
        ("cronoq_tasks_leased_total", "other", ""): 2,
        ("cronoq_task_start_latency_seconds_count", "default", ""): 5,
        ("cronoq_task_start_latency_seconds_count", "other", ""): 2,
        ("cronoq_tasks_finished_total", "default", "succeeded"): 2,
        ("cronoq_tasks_finished_total", "default", "failed"): 1,
        ("cronoq_tasks_finished_total", "other", "cancelled"): 1,
        ("cronoq_task_run_duration_seconds_count", "default", "succeeded"): 2,
        ("cronoq_task_run_duration_seconds_count", "default", "failed"): 2,
        ("cronoq_task_run_duration_seconds_count", "default", "lost"): 1,
        ("cronoq_task_run_duration_seconds_count", "other", "cancelled"): 1,
        ("cronoq_task_retries_total", "default", "failure"): 1,
        ("cronoq_task_retries_total", "default", "lost"): 1,
        ("cronoq_pool_paused", "default", ""): 0,
        ("cronoq_pool_paused", "other", ""): 1,
    }

    def label(name: str, pool: str, second: str) -> dict[str, str]:
        key = "reason" if name == "cronoq_task_retries_total" else "outcome"
        return {"pool": pool, key: second} if second else {"pool": pool}

    def as_expected() -> dict[tuple[str, str, str], float] | None:
        _, got = samples(srv)
        found = {k: value(got, k[0], **label(*k)) for k in expected}
        if found != expected or value(got, "cronoq_oldest_pending_age_seconds", pool="other") < 1:
            return None
        return found

    found = eventually(as_expected, timeout=20, interval=0.2, what="the workload's metrics")
    text, got = samples(srv)
    assert found == expected
    # Counted once each: no series beyond these pools and outcomes.
    assert value(got, "cronoq_tasks_finished_total", pool="other", outcome="succeeded") == 0
    # The lost attempt ran for its lease (1 s) at least; the paused pool's task has waited since it was submitted.
    assert value(got, "cronoq_task_run_duration_seconds_count", pool="other", outcome="failed") == 0
    assert 0.9 <= value(got, "cronoq_task_run_duration_seconds_sum", pool="default", outcome="lost") < 15
    age = value(got, "cronoq_oldest_pending_age_seconds", pool="other")
    assert 1 <= age <= time.monotonic() - began + 1
    assert value(got, "cronoq_oldest_pending_age_seconds", pool="default") == 0

    promtool = shutil.which("promtool")
    if promtool is None:
        missing("promtool not found: install Debian's 'prometheus' (it provides /usr/bin/promtool)")
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
