"""A task's W3C trace context end to end on SQLite and PostgreSQL: SubmitTask, SubmitBatch and
HTTP store it; GetTask, a lease and a retry's lease return it; a schedule keeps the context it
was put in and its fired tasks carry it marked link; a task submitted through another shard
keeps it; a malformed one is refused naming the field and value, and nothing is admitted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, eventually, store_table
from test_schedules import Client
from test_sharding import TwoShards, submit

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def trace(traceparent: str = PARENT, tracestate: str = "") -> task_pb2.TraceContext:
    return task_pb2.TraceContext(traceparent=traceparent, tracestate=tracestate)


@pytest.fixture(params=["sqlite", "postgres"])
def srv(request: pytest.FixtureRequest, start_server: Any, tmp_path: Path) -> Any:
    store = store_table(request.param, request, tmp_path / "cronoq.db")
    return start_server({"store": store, "pools": [{"name": "default", "retry_backoff": "10ms"}]})


def test_trace_context_is_stored_leased_kept_by_retries_and_fired_as_a_link(srv: Any) -> None:
    api, schedules = Api(srv.grpc_target), Client(srv)
    one = api.submit(trace=trace(tracestate="vendor=abc"))
    assert (one.trace.traceparent, one.trace.tracestate, one.trace.link) == (PARENT, "vendor=abc", False)
    batch = api.tasks.SubmitBatch(
        tpb.SubmitBatchRequest(
            tasks=[
                tpb.SubmitTaskRequest(pool="default", key="k1", trace=trace()),
                tpb.SubmitTaskRequest(pool="default"),
            ]
        )
    ).tasks
    assert [t.trace.traceparent for t in batch] == [PARENT, ""] and not batch[1].HasField("trace")
    status, body = srv.http("POST", "/v1/tasks", {"pool": "default", "trace": {"traceparent": PARENT}})
    assert status == 200 and body["task"]["trace"]["traceparent"] == PARENT, body
    assert api.get(one.id).trace.traceparent == PARENT
    worker = api.register()
    leased = {t.id: t for t in api.lease(worker, n=10)}
    assert leased[one.id].trace.tracestate == "vendor=abc"
    api.finish(worker, leased[one.id], failure=wpb.TaskFailure(error="again", retryable=True))
    again = eventually(lambda: next((t for t in api.lease(worker, n=10) if t.id == one.id), None), what="the retry")
    assert (again.attempt, again.trace.traceparent) == (2, PARENT)

    put = schedules.put("traced", "* * * * * *", trace=trace())
    assert (put.trace.traceparent, put.trace.link) == (PARENT, True)
    fired = eventually(lambda: next(iter(schedules.fired("traced").values()), None), what="a fire")
    assert [(t.trace.traceparent, t.trace.link) for t in fired] == [(PARENT, True)]


@pytest.mark.parametrize(
    ("given", "shows"),
    [
        (trace("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"), "trace.traceparent: '00-0af7"),
        (trace("00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01"), "not a W3C traceparent"),
        (trace("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), "not a W3C traceparent"),
        (trace("00-00000000000000000000000000000000-b7ad6b7169203331-01"), "not a W3C traceparent"),
        (trace("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"), "not a W3C traceparent"),
        (trace(tracestate="k=" + "v" * 511), "trace.tracestate: 513 bytes, more than 512"),
        (trace(tracestate="k=v\nforged"), "trace.tracestate: control character"),
    ],
)
def test_a_bad_trace_context_is_refused_naming_the_field(srv: Any, given: Any, shows: str) -> None:
    api = Api(srv.grpc_target)
    good = tpb.SubmitTaskRequest(pool="default")
    with pytest.raises(grpc.RpcError) as err:
        api.tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=[good, tpb.SubmitTaskRequest(pool="default", trace=given)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tasks[1].trace." in (err.value.details() or "") and shows in (err.value.details() or ""), (
        err.value.details()
    )
    assert api.tasks.ListTasks(tpb.ListTasksRequest(pool="default")).tasks == []


@pytest.fixture(params=["sqlite"])
def shards(request: pytest.FixtureRequest, tmp_path: Path, start_server: Any) -> TwoShards:
    return TwoShards.on_store_of(request, tmp_path, start_server)


def test_a_task_submitted_through_another_shard_keeps_its_trace_context(shards: TwoShards) -> None:
    task = submit(shards.stubs["cpu"], "llm", trace=trace()).task
    assert task.trace.traceparent == PARENT
    got = shards.stubs["gpu"].tasks.GetTask(
        tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=[("authorization", "Bearer full-token")]
    )
    assert got.task.trace.traceparent == PARENT
