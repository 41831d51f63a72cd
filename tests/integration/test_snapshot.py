"""Snapshot, server info, worker listings and metrics as tasks run; silent workers reaped."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, eventually, log_lines, start_worker, store_table

from cronoq.v1 import admin_service_pb2 as apb
from cronoq.v1 import admin_service_pb2_grpc, task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb


def metric(srv: Any, name: str, labels: str) -> float | None:
    with urllib.request.urlopen(srv.http_url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
    return None


def test_snapshot_shows_resources_in_use_and_workers_running_tasks(start_server: Any, tmp_path: Path) -> None:
    srv = start_server(
        {
            "pools": [{"name": "default"}],
            "resources": [{"name": "gpu", "concurrency": 2}, {"name": "api", "rate": 5, "burst": 2}],
        }
    )
    api = Api(srv.grpc_target)
    admin = admin_service_pb2_grpc.AdminServiceStub(api.channel)
    log = tmp_path / "w.log"
    worker = start_worker(srv.endpoint, "default", log)
    try:
        payload = json.dumps({"sleep": 30}).encode()
        for _ in range(3):
            api.submit(payload=payload, content_type="application/json", resources={"gpu": 1})
        eventually(lambda: len(log_lines(log, "start")) == 2, what="two gpu tasks run")
        shard = admin.GetSnapshot(apb.GetSnapshotRequest()).shards[0]
        assert shard.pools[0].running == 2 and shard.pools[0].pending == 1
        usage = {r.name: r for r in shard.resources}
        assert (usage["gpu"].in_use, usage["gpu"].capacity) == (2, 2)
        assert (usage["api"].rate, usage["api"].burst) == (5.0, 2)
        assert [w.running for w in shard.workers] == [2]
        listed = api.workers.ListWorkers(wpb.ListWorkersRequest()).workers
        assert [w.running for w in listed] == [2] and listed[0].last_seen_at.seconds > 0
        assert metric(srv, "cronoq_resource_in_use", 'resource="gpu"') == 2
        assert metric(srv, "cronoq_resource_capacity", 'resource="gpu"') == 2
        info = admin.GetServerInfo(apb.GetServerInfoRequest())
        assert info.role == apb.ROLE_LEADER and info.term == shard.term
    finally:
        worker.kill()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_silent_workers_are_reaped(start_server: Any, kind: str, request: pytest.FixtureRequest) -> None:
    srv = start_server(
        {"store": store_table(kind, request), "server": {"worker_reap_after": "1s"}, "pools": [{"name": "default"}]}
    )
    api = Api(srv.grpc_target)
    silent = api.register()
    lively = api.register()

    def only_the_lively_one_is_left() -> bool:  # it keeps heartbeating; the other says nothing
        api.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=lively))
        return [w.id for w in api.workers.ListWorkers(wpb.ListWorkersRequest()).workers] == [lively]

    eventually(only_the_lively_one_is_left, timeout=10, interval=0.2, what="the silent worker is reaped")
    with pytest.raises(grpc.RpcError) as err:
        api.lease(silent)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # it registers again


def test_snapshot_activity_counts_submissions_starts_and_outcomes_per_pool(start_server: Any) -> None:
    srv = start_server({"pools": [{"name": "default"}, {"name": "quiet"}]})
    api = Api(srv.grpc_target)
    admin = admin_service_pb2_grpc.AdminServiceStub(api.channel)
    for _ in range(3):
        api.submit()
    worker = api.register()
    tasks = api.lease(worker)
    assert len(tasks) == 3
    api.succeed(worker, tasks[0])
    api.succeed(worker, tasks[1])
    api.fail(worker, tasks[2], retryable=False)

    def totals() -> dict[str, dict[str, float]]:
        shard = admin.GetSnapshot(apb.GetSnapshotRequest()).shards[0]
        out = {}
        for a in shard.activity:
            assert a.bucket_ms == 5000 and len(a.submitted) == len(a.start_latency_max_ms) == 120
            assert a.start_unix_ms % 5000 == 0
            fields = ("submitted", "started", "succeeded", "failed", "start_latency_sum_ms")
            out[a.pool] = {f: sum(getattr(a, f)) for f in fields}
        return out

    got = eventually(lambda: (t := totals())["default"]["failed"] == 1 and t, what="the outcomes are counted")
    assert {k: v for k, v in got["default"].items() if k != "start_latency_sum_ms"} == {
        "submitted": 3,
        "started": 3,
        "succeeded": 2,
        "failed": 1,
    }
    assert got["default"]["start_latency_sum_ms"] > 0
    assert set(got["quiet"].values()) == {0}


def test_a_read_token_sees_its_pools_in_the_snapshot_and_no_resources_and_its_grants_in_server_info(
    start_server: Any,
) -> None:
    def token(name: str, pools: list[str], permissions: list[str]) -> dict[str, Any]:
        return {
            "name": name,
            "sha256": hashlib.sha256(name.encode()).hexdigest(),
            "pools": pools,
            "permissions": permissions,
        }

    srv = start_server(
        {
            "pools": [{"name": "a"}, {"name": "b"}],
            "resources": [{"name": "gpu", "concurrency": 2}],
            "tokens": [token("reader-a", ["a"], ["read"]), token("ops", ["*"], ["admin", "cancel"])],
        }
    )
    admin = admin_service_pb2_grpc.AdminServiceStub(grpc.insecure_channel(srv.grpc_target))

    def as_(name: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {name}")]

    shard = admin.GetSnapshot(apb.GetSnapshotRequest(), metadata=as_("reader-a")).shards[0]
    assert [p.pool for p in shard.pools] == ["a"] and [a.pool for a in shard.activity] == ["a"]
    assert list(shard.resources) == []
    caller = admin.GetServerInfo(apb.GetServerInfoRequest(), metadata=as_("reader-a")).caller
    assert (caller.name, caller.all_pools, list(caller.pools), list(caller.permissions)) == (
        "reader-a",
        False,
        ["a"],
        ["read"],
    )
    shard = admin.GetSnapshot(apb.GetSnapshotRequest(), metadata=as_("ops")).shards[0]
    assert [p.pool for p in shard.pools] == ["a", "b"] and [r.name for r in shard.resources] == ["gpu"]
    caller = admin.GetServerInfo(apb.GetServerInfoRequest(), metadata=as_("ops")).caller
    assert caller.all_pools and list(caller.permissions) == ["cancel", "admin"]


def test_get_task_lists_its_dependents_when_asked(start_server: Any) -> None:
    srv = start_server({"pools": [{"name": "default"}, {"name": "other"}]})
    api = Api(srv.grpc_target)
    first = api.submit(key="first")
    second = api.submit(depends_on=[first.id])
    third = api.submit(pool="other", depends_on=["first"])
    asked = api.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=first.id), include_dependents=True))
    assert list(asked.dependents) == [second.id, third.id]
    assert list(api.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=first.id))).dependents) == []
    by_key = api.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(key="first"), include_dependents=True))
    assert list(by_key.dependents) == [second.id, third.id]
    with urllib.request.urlopen(f"{srv.http_url}/v1/tasks/{first.id}?include_dependents=true", timeout=5) as r:
        assert json.loads(r.read())["dependents"] == [str(second.id), str(third.id)]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_worker_silent_past_its_leases_is_not_listed_until_it_heartbeats_again(
    start_server: Any, kind: str, request: pytest.FixtureRequest
) -> None:
    # As after a shard restart: the old process's worker id must not stay listed beside the new one
    # for the whole of worker_reap_after (10 minutes by default).
    srv = start_server({"store": store_table(kind, request), "pools": [{"name": "default", "lease_ttl": "1s"}]})
    api = Api(srv.grpc_target)
    silent = api.register()
    lively = api.register()

    def listed() -> list[str]:
        return sorted(w.id for w in api.workers.ListWorkers(wpb.ListWorkersRequest()).workers)

    assert listed() == sorted([silent, lively])

    def only_the_lively_one_is_listed() -> bool:
        api.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=lively))
        return listed() == [lively]

    # Twice the lease_ttl, but 30 s at least (leases.PRESENT_FOR_US).
    eventually(only_the_lively_one_is_listed, timeout=60, interval=0.5, what="the silent worker leaves the list")
    admin = admin_service_pb2_grpc.AdminServiceStub(api.channel)
    snapshot_workers = [w.id for w in admin.GetSnapshot(apb.GetSnapshotRequest()).shards[0].workers]
    assert snapshot_workers == [lively]
    api.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=silent))  # not reaped: it comes back as it was
    assert listed() == sorted([silent, lively])
