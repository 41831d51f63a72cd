"""Fair share inside a pool (max_running_per_group): real servers, real worker processes, on
SQLite and PostgreSQL. What runs is sampled from the workers' side (their logs)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _helpers import Api, eventually, log_lines, max_overlap, run_intervals, runs_by_task, start_worker, store_table
from test_sharding import TOKENS, TwoShards, bearer  # type: ignore[import-not-found]
from test_sharding import submit as sharded_submit

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb

SUCCEEDED = task_pb2.TASK_STATE_SUCCEEDED


@pytest.fixture(params=["sqlite", "postgres"])
def store_kind(request: pytest.FixtureRequest) -> dict[str, Any]:
    return store_table(request.param, request)


def config(store: dict[str, Any], cap: int, **pool: Any) -> dict[str, Any]:
    return {
        "store": store,
        "pools": [{"name": "default", "lease_ttl": "2s", "max_running_per_group": cap, **pool}],
    }


def submit(api: Api, n: int, group: str, job: dict[str, Any] | None = None, pool: str = "default") -> list[int]:
    payload = json.dumps(job or {}).encode()
    return [api.submit(pool, payload=payload, content_type="application/json", group_key=group).id for _ in range(n)]


def all_succeed(api: Api, ids: list[int], timeout: float = 45.0) -> None:
    eventually(
        lambda: all(api.get(i).state == SUCCEEDED for i in ids), timeout=timeout, what=f"{len(ids)} tasks succeed"
    )


def test_a_group_never_runs_more_than_its_cap_while_other_groups_run_beside_it(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, cap=2))
    api = Api(srv.grpc_target)
    groups = {"a": submit(api, 12, "a", {"sleep": 0.3}), "b": submit(api, 6, "b", {"sleep": 0.3})}
    groups[""] = submit(api, 4, "", {"sleep": 0.3})  # tasks without a group are one group
    logs = [tmp_path / "w0.log", tmp_path / "w1.log"]
    workers = [start_worker(srv.endpoint, "default", log, concurrency=16) for log in logs]
    try:
        all_succeed(api, [i for ids in groups.values() for i in ids])
        runs = {task: iv for log in logs for task, iv in runs_by_task(log).items()}
        for group, ids in groups.items():
            assert max_overlap([iv for i in ids for iv in runs[i]]) <= 2, group
        assert max_overlap([iv for log in logs for iv in run_intervals(log)]) >= 5  # groups beside each other
    finally:
        for w in workers:
            w.kill()


def test_a_group_that_comes_late_runs_before_the_backlog_of_another(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, cap=100))
    api = Api(srv.grpc_target)
    backlog = submit(api, 60, "a", {"sleep": 0.02})
    late = submit(api, 3, "b", {"sleep": 0.02})
    log = tmp_path / "w.log"
    worker = start_worker(srv.endpoint, "default", log, concurrency=1)
    try:
        all_succeed(api, backlog + late)
        order = [task for task, _, _ in log_lines(log, "start")]
        assert max(order.index(i) for i in late) < 10, order[:12]  # in turn with a's, not after its 60
    finally:
        worker.kill()


def test_a_leader_failover_never_lets_a_group_past_its_cap(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    cfg = config(store_kind, cap=2, lease_ttl="10s")
    leader = start_server(cfg, name="replica0")
    standby = start_server(cfg, name="replica1", wait_ready=False)
    standby.wait_ready(leader=False)
    api = Api(leader.grpc_target)
    ids = submit(api, 10, "a", {"sleep": 1.0})
    endpoints = f"{leader.endpoint},{standby.endpoint}"
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    workers = [start_worker(endpoints, "default", log, concurrency=8) for log in logs]
    try:
        eventually(lambda: sum(len(log_lines(log, "start")) for log in logs) >= 2, what="tasks run")
        leader.kill()  # two tasks of the group run under the old leader
        standby.wait_ready()
        all_succeed(Api(standby.grpc_target), ids, timeout=60)
        assert max_overlap([iv for log in logs for iv in run_intervals(log)]) <= 2
    finally:
        for w in workers:
            w.kill()


def test_the_snapshot_shows_the_cap_and_the_groups_with_the_most_tasks(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, cap=1))
    api = Api(srv.grpc_target)
    submit(api, 3, "a", {"sleep": 30})
    submit(api, 2, "b", {"sleep": 30})
    submit(api, 1, "c", {"sleep": 30})
    log = tmp_path / "w.log"
    worker = start_worker(srv.endpoint, "default", log, concurrency=8)
    try:
        eventually(lambda: len(log_lines(log, "start")) == 3, what="one task of each group runs")

        def pool() -> dict[str, Any]:
            status, body = srv.http("GET", "/v1/snapshot")
            assert status == 200, body
            return next(p for p in body["shards"][0]["pools"] if p["pool"] == "default")

        shown = eventually(lambda: (p := pool()) and p.get("groups") and p, what="groups in the snapshot")
        assert shown["max_running_per_group"] == 1
        with urllib.request.urlopen(srv.http_url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'cronoq_groups_running{pool="default"} 3.0' in metrics
        assert 'cronoq_groups_at_cap{pool="default"} 3.0' in metrics
        assert [(g["group_key"], int(g.get("pending", 0)), int(g.get("running", 0))) for g in shown["groups"]] == [
            ("a", 2, 1),
            ("b", 1, 1),
            ("c", 0, 1),
        ]
    finally:
        worker.kill()


def test_a_pools_groups_live_in_its_shard(start_server: Any, tmp_path: Path) -> None:
    """Tasks of gpu's pool submitted through cpu, and a worker given cpu's endpoint: gpu caps
    the groups."""
    shards = TwoShards(tmp_path, start_server, llm={"max_running_per_group": 1})
    stubs = shards.stubs["cpu"]
    payload = json.dumps({"sleep": 0.3}).encode()
    groups = {
        g: [
            sharded_submit(stubs, "llm", payload=payload, content_type="application/json", group_key=g).task.id
            for _ in range(3)
        ]
        for g in ("a", "b")
    }
    log = tmp_path / "w.log"
    worker = start_worker(shards.cpu.endpoint, "llm", log, concurrency=8, token=TOKENS["full"])
    try:
        ids = [i for group in groups.values() for i in group]

        def done() -> bool:
            got = [
                stubs.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=i)), metadata=bearer("full"))
                for i in ids
            ]
            return all(g.task.state == SUCCEEDED for g in got)

        eventually(done, timeout=45, what="every task succeeds")
        runs = runs_by_task(log)
        for group, ids in groups.items():
            assert max_overlap([iv for i in ids for iv in runs[i]]) == 1, group
        assert max_overlap(run_intervals(log)) == 2  # the two groups beside each other
    finally:
        worker.kill()
