"""Bulk actions across two real shards (the deployment of test_sharding.py): every shard where
the caller holds the permission is asked, results listed per shard, a shard down is named while
the others are done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_sharding import Stubs, TwoShards, bearer, http, submit  # type: ignore[import-not-found]

from cronoq.v1 import task_pb2, worker_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["sqlite", "postgres"])
def shards(request: pytest.FixtureRequest, tmp_path: Path, start_server: Any) -> TwoShards:
    return TwoShards.on_store_of(request, tmp_path, start_server, replicas=2)


def per_shard(response: Any) -> list[tuple[str, int, int]]:
    return [(s.shard, s.matched, s.changed) for s in response.shards]


def test_bulk_cancel_across_shards_then_with_one_down(shards: TwoShards) -> None:
    """Each shard with a standby: a standby asks its leader for its shard's part."""
    cpu = shards.stubs["cpu"]
    on_cpu = [submit(cpu, "default").task for _ in range(3)]
    on_gpu = [submit(cpu, "llm").task for _ in range(2)]
    pending = tpb.TaskFilter(states=[task_pb2.TASK_STATE_PENDING])

    answer = cpu.tasks.CancelTasks(tpb.CancelTasksRequest(filter=pending, dry_run=True), metadata=bearer("full"))
    assert (answer.matched, answer.changed, per_shard(answer)) == (5, 0, [("cpu", 3, 0), ("gpu", 2, 0)])
    # A caller that may cancel in cpu's pool only: gpu is not asked (nor named).
    answer = cpu.tasks.CancelTasks(
        tpb.CancelTasksRequest(filter=tpb.TaskFilter(ids=[on_cpu[0].id, on_gpu[0].id])), metadata=bearer("default-only")
    )
    assert (answer.matched, answer.changed, per_shard(answer)) == (1, 1, [("cpu", 1, 1)])
    # One pool: its shard only, also when asked of the other shard.
    answer = shards.stubs["gpu"].tasks.CancelTasks(
        tpb.CancelTasksRequest(filter=tpb.TaskFilter(pool="default", ids=[on_cpu[1].id])), metadata=bearer("full")
    )
    assert per_shard(answer) == [("cpu", 1, 1)]

    # At cpu's standby: cpu's part at cpu's leader, gpu's at gpu's.
    standby = Stubs(shards.servers["cpu"][1])
    answer = standby.tasks.CancelTasks(
        tpb.CancelTasksRequest(filter=tpb.TaskFilter(ids=[on_cpu[2].id, on_gpu[1].id]), dry_run=True),
        metadata=bearer("full"),
    )
    assert per_shard(answer) == [("cpu", 1, 0), ("gpu", 1, 0)] and not answer.unavailable_shards

    shards.kill("gpu")
    status, headers, body = http(
        shards.cpu, "POST", "/v1/tasks/bulk-cancel", {"filter": {"states": ["TASK_STATE_PENDING"]}}
    )
    assert status == 200, body
    assert body["unavailable_shards"] == ["gpu"] and headers["cronoq-unavailable-shards"] == "gpu"
    assert [(s["shard"], int(s["matched"]), int(s["changed"])) for s in body["shards"]] == [("cpu", 1, 1)]
    got = cpu.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=on_cpu[2].id)), metadata=bearer("full"))
    assert got.task.state == task_pb2.TASK_STATE_CANCELLED


def fail_all(shards: TwoShards, shard: str, pool: str, n: int) -> list[int]:
    """n tasks of the pool, FAILED after their one attempt (leased and failed at their shard)."""
    stubs = shards.stubs[shard]
    ids = [submit(stubs, pool, max_attempts=1).task.id for _ in range(n)]
    workers = worker_service_pb2_grpc.WorkerServiceStub(stubs.channel)
    md = bearer("full")
    worker = workers.RegisterWorker(wpb.RegisterWorkerRequest(name="w", pools=[pool]), metadata=md).worker_id
    leased = workers.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker, max_tasks=n), metadata=md).tasks
    outcomes = [
        wpb.TaskOutcome(task_id=t.id, attempt=t.attempt, failure=wpb.TaskFailure(error="api down")) for t in leased
    ]
    workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=outcomes), metadata=md)
    return ids


def test_bulk_retry_across_shards_then_with_one_down(shards: TwoShards) -> None:
    cpu = shards.stubs["cpu"]
    on_cpu, on_gpu = fail_all(shards, "cpu", "default", 3), fail_all(shards, "gpu", "llm", 2)
    failed = tpb.TaskFilter(states=[task_pb2.TASK_STATE_FAILED], error_contains="api down")

    answer = cpu.tasks.RetryTasks(tpb.RetryTasksRequest(filter=failed, dry_run=True), metadata=bearer("full"))
    assert (answer.matched, answer.changed, per_shard(answer)) == (5, 0, [("cpu", 3, 0), ("gpu", 2, 0)])
    by_ids = tpb.TaskFilter(ids=[on_cpu[0], on_gpu[0]])
    answer = cpu.tasks.RetryTasks(tpb.RetryTasksRequest(filter=by_ids), metadata=bearer("full"))
    assert per_shard(answer) == [("cpu", 1, 1), ("gpu", 1, 1)] and not answer.unavailable_shards

    shards.kill("gpu")
    answer = cpu.tasks.RetryTasks(tpb.RetryTasksRequest(filter=failed), metadata=bearer("full"))
    assert (answer.matched, answer.changed, per_shard(answer)) == (2, 2, [("cpu", 2, 2)])
    assert list(answer.unavailable_shards) == ["gpu"]
    for task_id in on_cpu:
        got = cpu.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task_id)), metadata=bearer("full"))
        assert got.task.state == task_pb2.TASK_STATE_PENDING
