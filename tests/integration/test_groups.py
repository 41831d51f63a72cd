"""A task's group_key end to end on SQLite and PostgreSQL: SubmitTask, SubmitBatch and HTTP store
it; GetTask, ListTasks and Watch return it; a schedule keeps its own and its fired tasks carry
it; a bad one is refused naming the field and the value, and nothing of its batch is admitted.
(What a group does in a pool with max_running_per_group is tested with that cap.)"""

from __future__ import annotations

import urllib.request
from typing import Any

import grpc
import pytest
from _helpers import Api, eventually, store_table
from test_schedules import Client

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb


@pytest.fixture(params=["sqlite", "postgres"])
def srv(request: pytest.FixtureRequest, start_server: Any, tmp_path: Any) -> Any:
    store = store_table(request.param, request, tmp_path / "cronoq.db")
    return start_server({"store": store, "pools": [{"name": "default", "lease_ttl": "30s"}]})


def metrics_text(srv: Any) -> str:
    with urllib.request.urlopen(srv.http_url + "/metrics", timeout=5) as r:
        return r.read().decode()


def refused(call: Any, *fragments: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    for fragment in fragments:
        assert fragment in (err.value.details() or ""), err.value.details()


def test_group_key_is_stored_returned_watched_and_fired(srv: Any) -> None:
    api, schedules = Api(srv.grpc_target), Client(srv)
    stream = api.tasks.Watch(tpb.WatchRequest(pool="default"))
    events = iter(stream)
    # The stream is live once the server counts it: a submission before that is not its to see.
    eventually(lambda: 'cronoq_watch_streams{kind="shard"} 1.0' in metrics_text(srv), what="the watch is live")
    one = api.submit(group_key="tenant-a")
    assert one.group_key == "tenant-a"
    batch = api.tasks.SubmitBatch(
        tpb.SubmitBatchRequest(
            tasks=[
                tpb.SubmitTaskRequest(pool="default", key="b1", group_key="tenant-b"),
                tpb.SubmitTaskRequest(pool="default", group_key="tenant-b"),
                tpb.SubmitTaskRequest(pool="default"),
            ]
        )
    )
    assert [t.group_key for t in batch.tasks] == ["tenant-b", "tenant-b", ""]
    assert api.get(one.id).group_key == "tenant-a"
    listed = api.tasks.ListTasks(tpb.ListTasksRequest(pool="default")).tasks
    assert [t.group_key for t in listed] == ["tenant-a", "tenant-b", "tenant-b", ""]
    first = next(events).event.task
    assert (first.id, first.group_key) == (one.id, "tenant-a")

    status, body = srv.http("POST", "/v1/tasks", {"pool": "default", "group_key": "tenant-http"})
    assert status == 200 and body["task"]["group_key"] == "tenant-http", body
    status, got = srv.http("GET", f"/v1/tasks/{body['task']['id']}")
    assert status == 200 and got["task"]["group_key"] == "tenant-http"
    # A leased and finished task keeps it in every event of its life.
    worker = api.register()
    (leased,) = [t for t in api.lease(worker, n=10) if t.id == one.id]
    assert leased.group_key == "tenant-a" and api.succeed(worker, leased).accepted
    states: dict[int, str] = {}
    while task_pb2.TASK_STATE_SUCCEEDED not in states:
        task = next(events).event.task
        if task.id == one.id:
            states[task.state] = task.group_key
    assert states == {task_pb2.TASK_STATE_RUNNING: "tenant-a", task_pb2.TASK_STATE_SUCCEEDED: "tenant-a"}
    stream.cancel()

    put = schedules.put("grouped", "* * * * * *", group_key="tenant-s")
    assert put.group_key == "tenant-s" and schedules.list()[0].group_key == "tenant-s"
    fired = eventually(lambda: next(iter(schedules.fired("grouped").values()), None), what="a fire")
    assert [t.group_key for t in fired] == ["tenant-s"]
    assert schedules.put("grouped", "* * * * * *", paused=True).group_key == ""


def test_a_bad_group_key_is_refused_naming_field_and_value(srv: Any) -> None:
    api, schedules = Api(srv.grpc_target), Client(srv)
    refused(lambda: api.submit(group_key="a\nb"), "group_key: control character", "'a\\nb'")
    refused(lambda: api.submit(group_key="x" * 257), "group_key: 257 bytes, more than 256", "'xxx")
    refused(lambda: api.submit(group_key="é" * 129), "group_key: 258 bytes, more than 256")
    assert api.submit(group_key="é" * 128).group_key == "é" * 128
    good = tpb.SubmitTaskRequest(pool="default", group_key="fine")
    bad = tpb.SubmitTaskRequest(pool="default", group_key="tab\there")
    refused(
        lambda: api.tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=[good, good, good, bad])),
        "tasks[3].group_key: control character",
        "'tab\\there'",
    )
    refused(lambda: schedules.put("s", "* * * * *", group_key="\x7f"), "schedule.group_key: control character")
    status, body = srv.http("POST", "/v1/tasks", {"pool": "default", "group_key": "y" * 300})
    assert status == 400 and "group_key: 300 bytes, more than 256" in str(body), body
    assert len(api.tasks.ListTasks(tpb.ListTasksRequest(pool="default")).tasks) == 1  # only the good one
    assert schedules.list() == []
