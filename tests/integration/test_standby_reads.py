"""A standby answers reads by asking its leader (with the caller's own token, marked
cronoq-forwarded), so its dashboard and the read API work there; a change is still refused
with UNAVAILABLE naming the leader (cronoq-leader), which clients follow.

Sharded: a standby's read of every shard asks its own shard's leader for its part and the
other shards as any server does. The deployment of test_sharding, each shard with a standby,
on SQLite and on PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from test_sharding import TIMEOUT, Stubs, TwoShards, bearer, refusal, submit, trailers

from cronoq.v1 import admin_service_pb2 as apb
from cronoq.v1 import admin_service_pb2_grpc, task_pb2
from cronoq.v1 import task_service_pb2 as tpb


@pytest.fixture(params=["sqlite", "postgres"])
def shards(request: pytest.FixtureRequest, tmp_path: Path, start_server: Any) -> TwoShards:
    """cpu and gpu, each a leader and a standby."""
    return TwoShards.on_store_of(request, tmp_path, start_server, replicas=2)


def test_a_standby_reads_its_shard_from_its_leader_and_refuses_changes(shards: TwoShards) -> None:
    cpu_task = submit(shards.stubs["cpu"], "default", key="on-cpu").task
    gpu_task = submit(shards.stubs["cpu"], "llm", key="on-gpu").task
    standby_srv = shards.servers["cpu"][1]
    standby = Stubs(standby_srv)
    md = bearer("full")

    listed = standby.tasks.ListTasks(tpb.ListTasksRequest(), metadata=md, timeout=TIMEOUT)
    assert [t.id for t in listed.tasks] == [cpu_task.id, gpu_task.id] and list(listed.unavailable_shards) == []
    admin = admin_service_pb2_grpc.AdminServiceStub(standby.channel)
    snapshot = admin.GetSnapshot(apb.GetSnapshotRequest(), metadata=md, timeout=TIMEOUT)
    assert sorted(s.shard for s in snapshot.shards) == ["cpu", "gpu"] and list(snapshot.unavailable_shards) == []
    for task in (cpu_task, gpu_task):
        got = standby.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=md)  # no deadline
        assert got.task.id == task.id
        by_key = standby.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(key=task.key)), metadata=md)
        assert by_key.task.id == task.id
    waited = standby.tasks.WaitTask(
        tpb.WaitTaskRequest(task=task_pb2.TaskRef(id=cpu_task.id), timeout_ms=50), metadata=md, timeout=TIMEOUT
    )
    assert waited.task.id == cpu_task.id and not waited.done
    status, body = standby_srv.http("GET", "/v1/snapshot", token="full-token")
    assert status == 200 and sorted(s["shard"] for s in body["shards"]) == ["cpu", "gpu"]

    # Changes are the leader's: refused here, naming it.
    err = refusal(lambda: submit(standby, "default"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and trailers(err)["cronoq-leader"] == shards.cpu.endpoint  # type: ignore[attr-defined]
    err = refusal(
        lambda: standby.tasks.CancelTask(
            tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=cpu_task.id)), metadata=md, timeout=TIMEOUT
        )
    )
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "standby" in (err.details() or "")  # type: ignore[attr-defined]
    # A read marked cronoq-forwarded is answered here only: a standby sends it to its leader.
    err = refusal(
        lambda: standby.tasks.GetTask(
            tpb.GetTaskRequest(task=task_pb2.TaskRef(id=cpu_task.id)),
            metadata=[*md, ("cronoq-forwarded", "1")],
            timeout=TIMEOUT,
        )
    )
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "cronoq-leader" in trailers(err)  # type: ignore[attr-defined]
