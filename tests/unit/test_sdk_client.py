"""Client submissions carry a request_id that every transport retry of the call reuses; the
workflow options reach the server and the answers come back whole."""

from __future__ import annotations

import datetime as dt
from typing import Any

import grpc
import pytest

import cronoq
from cronoq.client import task_spec
from cronoq.v1 import schedule_service_pb2, task_pb2
from cronoq.v1 import task_service_pb2 as pb

FAST = cronoq.RetryConfig(initial_backoff=0.001, max_backoff=0.01, max_elapsed=5)


def unavailable(code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "stopping")


class FakeTaskStub:
    """Fails the first `failures` calls with UNAVAILABLE and records every request it sees."""

    def __init__(self, failures: int = 1, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.failures = failures
        self.code = code
        self.requests: list[Any] = []

    async def _answer(self, req: Any, resp: Any) -> Any:
        seen = type(req)()
        seen.CopyFrom(req)
        self.requests.append(seen)
        if self.failures:
            self.failures -= 1
            raise unavailable(self.code)
        return resp

    def SubmitTask(self, req: pb.SubmitTaskRequest, metadata: Any = None, timeout: Any = None) -> Any:
        return self._answer(req, pb.SubmitTaskResponse(task=task_pb2.Task(id=7, pool=req.pool)))

    def SubmitBatch(self, req: pb.SubmitBatchRequest, metadata: Any = None, timeout: Any = None) -> Any:
        tasks = [task_pb2.Task(id=10 + i, pool=t.pool) for i, t in enumerate(req.tasks)]
        return self._answer(req, pb.SubmitBatchResponse(tasks=tasks))

    def GetTask(self, req: pb.GetTaskRequest, metadata: Any = None, timeout: Any = None) -> Any:
        children = [task_pb2.Task(id=8, parent_id=7)] if req.include_children else []
        return self._answer(req, pb.GetTaskResponse(task=task_pb2.Task(id=7), children=children))

    def CancelTask(self, req: pb.CancelTaskRequest, metadata: Any = None, timeout: Any = None) -> Any:
        cancelled = 3 if req.include_descendants else 0
        return self._answer(req, pb.CancelTaskResponse(task=task_pb2.Task(id=7), descendants_cancelled=cancelled))

    def ListTasks(self, req: pb.ListTasksRequest, metadata: Any = None, timeout: Any = None) -> Any:
        return self._answer(req, pb.ListTasksResponse(tasks=[task_pb2.Task(id=8, parent_id=req.filter.parent_id)]))

    def PutSchedule(
        self, req: schedule_service_pb2.PutScheduleRequest, metadata: Any = None, timeout: Any = None
    ) -> Any:
        return self._answer(req, schedule_service_pb2.PutScheduleResponse(schedule=req.schedule))


def client_with(stub: FakeTaskStub) -> cronoq.Client:
    client = cronoq.Client("http://127.0.0.1:1", retry=FAST)
    client._conn._stub = stub  # no channel: every call goes to the fake
    return client


def is_uuid_hex(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


async def test_submit_sets_a_request_id_and_keeps_it_across_a_retry() -> None:
    stub = FakeTaskStub(failures=1)
    client = client_with(stub)
    sub = await client.submit("default", {"n": 1}, key="k")
    assert sub.task.id == 7
    first, retry = stub.requests
    assert is_uuid_hex(first.request_id)
    assert retry.request_id == first.request_id  # the retry is the same logical call
    assert retry == first and first.key == "k"

    await client.submit("default", {"n": 1}, key="k")  # another call: another id
    assert is_uuid_hex(stub.requests[2].request_id) and stub.requests[2].request_id != first.request_id


async def test_submit_takes_the_callers_request_id() -> None:
    stub = FakeTaskStub(failures=2)
    await client_with(stub).submit("default", b"x", request_id="order-42-submit")
    assert [r.request_id for r in stub.requests] == ["order-42-submit"] * 3


async def test_submit_batch_sets_one_request_id_for_the_batch_not_for_its_tasks() -> None:
    stub = FakeTaskStub(failures=1)
    client = client_with(stub)
    spec = cronoq.task_spec("default", {"n": 2}, key="b")
    spec.request_id = "set-by-hand"  # meaningless inside a batch: cleared on the wire
    resp = await client.submit_batch([cronoq.task_spec("default", {"n": 1}), spec])
    assert [t.id for t in resp.tasks] == [10, 11]
    first, retry = stub.requests
    assert is_uuid_hex(first.request_id) and retry.request_id == first.request_id
    assert [t.request_id for t in first.tasks] == ["", ""]
    assert spec.request_id == "set-by-hand"  # the caller's spec is not modified

    await client.submit_batch([cronoq.task_spec("default")], request_id="batch-1")
    assert stub.requests[-1].request_id == "batch-1"


def test_task_spec_leaves_request_id_empty() -> None:
    assert cronoq.task_spec("default", {"n": 1}).request_id == ""


def test_sync_client_passes_request_ids() -> None:
    stub = FakeTaskStub(failures=1)
    with cronoq.SyncClient("http://127.0.0.1:1", retry=FAST) as client:
        client._client._conn._stub = stub
        client.submit("default", request_id="s-1")
        client.submit_batch([cronoq.task_spec("default")], request_id="b-1")
    assert [r.request_id for r in stub.requests] == ["s-1", "s-1", "b-1"]


@pytest.mark.parametrize("failures", [0, 3])
async def test_every_attempt_of_one_submit_sends_the_same_request(failures: int) -> None:
    stub = FakeTaskStub(failures=failures)
    await client_with(stub).submit("default", {"n": 1}, priority=3)
    assert len(stub.requests) == failures + 1
    assert len({r.SerializeToString(deterministic=True) for r in stub.requests}) == 1


async def test_a_call_a_closing_server_cancelled_is_retried_with_the_same_request_id() -> None:
    """A gRPC server that stops cancels calls it received but had not handed to a handler."""
    stub = FakeTaskStub(failures=2, code=grpc.StatusCode.CANCELLED)
    sub = await client_with(stub).submit("default", {"n": 1})
    assert sub.task.id == 7
    assert len({r.request_id for r in stub.requests}) == 1 and len(stub.requests) == 3


async def test_group_key_reaches_the_server_on_submit_batch_and_schedule() -> None:
    stub = FakeTaskStub(failures=0)
    client = client_with(stub)
    await client.submit("default", {"n": 1}, group_key="tenant-a")
    await client.submit_batch([cronoq.task_spec("default", group_key="tenant-b"), cronoq.task_spec("default")])
    schedule = await client.put_schedule("default", "nightly", "0 2 * * *", group_key="tenant-c")
    one, batch, put = stub.requests
    assert one.group_key == "tenant-a"
    assert [t.group_key for t in batch.tasks] == ["tenant-b", ""]  # none given: no group
    assert put.schedule.group_key == "tenant-c" and schedule.group_key == "tenant-c"


async def test_workflow_options_reach_the_server_and_their_answers_are_returned() -> None:
    stub = FakeTaskStub(failures=0)
    client = client_with(stub)
    await client.submit("default", {}, depends_on=[5, "wf-a"], run_when="ended")
    await client.submit("default", {}, run_when=cronoq.RunWhen.RUN_WHEN_DEPENDENCIES_SUCCEEDED)
    await client.submit("default", {})
    assert [r.run_when for r in stub.requests] == [
        task_pb2.RUN_WHEN_DEPENDENCIES_ENDED,
        task_pb2.RUN_WHEN_DEPENDENCIES_SUCCEEDED,
        task_pb2.RUN_WHEN_UNSPECIFIED,
    ]
    assert list(stub.requests[0].depends_on) == [task_pb2.TaskRef(id=5), task_pb2.TaskRef(key="wf-a")]
    with pytest.raises(ValueError, match="run_when: 'sometimes' is not"):
        await client.submit("default", {}, run_when="sometimes")
    assert len(stub.requests) == 3  # refused before any call

    task = await client.get(7, include_dependency_results=True)
    assert task.id == 7 and stub.requests[-1].include_dependency_results
    got = await client.get(7, include_children=True)
    assert [c.id for c in got.children] == [8] and stub.requests[-1].include_children

    assert (await client.cancel(7)).id == 7 and not stub.requests[-1].include_descendants
    resp = await client.cancel(7, include_descendants=True)
    assert resp.task.id == 7 and resp.descendants_cancelled == 3

    page = await client.list(filter=cronoq.task_filter(parent_id=7))
    assert stub.requests[-1].filter.parent_id == 7 and page.tasks[0].parent_id == 7
    assert cronoq.task_filter("default").parent_id == 0  # none given: any parent


def test_sync_client_takes_the_workflow_options() -> None:
    stub = FakeTaskStub(failures=0)
    with cronoq.SyncClient("http://127.0.0.1:1", retry=FAST) as client:
        client._client._conn._stub = stub
        assert [c.id for c in client.get(7, include_children=True).children] == [8]
        assert client.cancel(7, include_descendants=True).descendants_cancelled == 3
        assert client.list(filter=cronoq.task_filter(parent_id=7)).tasks[0].parent_id == 7


def test_dependencies_of_decodes_a_tasks_dependency_results() -> None:
    task = task_pb2.Task(
        id=9,
        dependency_results=[
            task_pb2.DependencyResult(
                id=1, key="a", state=task_pb2.TASK_STATE_SUCCEEDED, result=b"6", content_type="application/json"
            ),
            task_pb2.DependencyResult(id=2, state=task_pb2.TASK_STATE_CANCELLED, error="cancelled"),
        ],
    )
    assert cronoq.dependencies_of(task) == [
        cronoq.DependencyResult(1, "a", task_pb2.TASK_STATE_SUCCEEDED, 6, ""),
        cronoq.DependencyResult(2, "", task_pb2.TASK_STATE_CANCELLED, None, "cancelled"),
    ]


def test_task_spec_carries_the_key_options() -> None:
    start_by = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    spec = task_spec(
        "p", key="k", key_mode="debounce", debounce_ms=200, max_debounce_ms=900, key_ttl_ms=60_000, start_by=start_by
    )
    assert (spec.key_mode, spec.debounce_ms, spec.max_debounce_ms, spec.key_ttl_ms) == (
        task_pb2.KEY_MODE_DEBOUNCE, 200, 900, 60_000,
    )  # fmt: skip
    assert spec.start_by.ToDatetime(dt.UTC) == start_by
    assert task_spec("p", key="k", key_mode="KEY_MODE_REPLACE_PENDING").key_mode == task_pb2.KEY_MODE_REPLACE_PENDING
    assert task_spec("p", key_mode=task_pb2.KEY_MODE_RETURN_EXISTING).key_mode == task_pb2.KEY_MODE_RETURN_EXISTING
    assert not task_spec("p").HasField("start_by") and task_spec("p").key_mode == task_pb2.KEY_MODE_UNSPECIFIED
    with pytest.raises(ValueError, match="key_mode: 'sometimes'"):
        task_spec("p", key_mode="sometimes")
    with pytest.raises(ValueError, match="start_by: give a timezone-aware datetime"):
        task_spec("p", start_by=dt.datetime(2030, 1, 1))
