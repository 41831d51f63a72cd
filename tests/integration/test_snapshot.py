"""Snapshot, server info, worker listings and metrics as tasks run; silent workers reaped."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, eventually, log_lines, start_worker, store_table

from cronoq.v1 import admin_service_pb2 as apb
from cronoq.v1 import admin_service_pb2_grpc
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
