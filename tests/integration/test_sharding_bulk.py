"""Bulk actions across two real shards (the deployment of test_sharding.py): every shard where
the caller holds the permission is asked, results listed per shard, a shard down is named while
the others are done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _helpers import store_table  # type: ignore[import-not-found]
from test_sharding import Stubs, TwoShards, bearer, http, submit  # type: ignore[import-not-found]

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["sqlite", "postgres"])
def shards(request: pytest.FixtureRequest, tmp_path: Path, start_server: Any) -> TwoShards:
    store = None
    if request.param == "postgres":
        store = store_table("postgres", request)
        store["schema"] += "_{shard}"
    return TwoShards(tmp_path, start_server, store, replicas=2)


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
