"""What handlers report, on the wire (raw gRPC, no SDK), on both stores: a snooze is PENDING
later and not an attempt; progress and checkpoints ride heartbeats (unary and on the Work
stream) and outcomes, show in GetTask and in Watch (one event per report, marked progress),
and reach the next attempt's lease; a snooze frees its resource slot; a bad report is refused
naming its field, changing nothing."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, store_table
from test_work_stream import Stream

from cronoq.v1 import task_pb2, task_service_pb2
from cronoq.v1 import worker_service_pb2 as wpb


@pytest.fixture(params=["sqlite", "postgres"])
def api(request: Any, start_server: Any, tmp_path: Path) -> Api:
    server = start_server(
        {
            "store": store_table(request.param, request, tmp_path / "cronoq.db"),
            "pools": [{"name": "default", "retry_backoff": 0.01, "max_snoozes": 2}],
        }
    )
    return Api(server.grpc_target)


def attempts(api: Api, task_id: int) -> list[tuple[int, str, str]]:
    got = api.tasks.GetTask(task_service_pb2.GetTaskRequest(task=task_pb2.TaskRef(id=task_id), include_attempts=True))
    return [(a.attempt, task_pb2.AttemptOutcome.Name(a.outcome), a.error) for a in got.attempts]


def report(task: task_pb2.Task, value: float | None = None, message: str = "", checkpoint: bytes | None = None) -> Any:
    r = wpb.TaskReport(task_id=task.id, attempt=task.attempt)
    if value is not None:
        r.progress.value, r.progress.message = value, message
    if checkpoint is not None:
        r.checkpoint = checkpoint
    return r


def test_register_tells_the_checkpoint_cap(api: Api) -> None:
    answer = api.workers.RegisterWorker(wpb.RegisterWorkerRequest(name="t", pools=["default"]))
    assert answer.max_checkpoint_bytes == 256 << 10


def test_snoozes_are_not_attempts_up_to_max_snoozes(api: Api) -> None:
    worker = api.register()
    task = api.submit(max_attempts=2)
    for n in (1, 2, 3):
        (leased,) = api.lease(worker, wait_ms=5000)
        assert (leased.attempt, leased.snoozes) == (1, n - 1)
        result = api.finish(worker, leased, snoozed=wpb.TaskSnoozed(snooze_ms=10, reason="not yet"))
        assert result.accepted, result
    # Two snoozes (not counted), then the third taken as a failed attempt: attempt 2 is next.
    got = api.get(task.id)
    assert (got.state, got.attempt, got.snoozes) == (task_pb2.TASK_STATE_PENDING, 1, 2)
    assert got.error == "snoozed 2 times, the pool's max_snoozes"
    assert attempts(api, task.id) == [
        (1, "ATTEMPT_OUTCOME_SNOOZED", "snoozed for 10 ms: not yet"),
        (1, "ATTEMPT_OUTCOME_SNOOZED", "snoozed for 10 ms: not yet"),
        (1, "ATTEMPT_OUTCOME_FAILED", "snoozed 2 times, the pool's max_snoozes"),
    ]


def test_progress_and_checkpoint_show_in_get_task_and_reach_the_next_attempt(api: Api) -> None:
    worker = api.register()
    task = api.submit(max_attempts=3)
    stream = Stream(api, wpb.WorkRequest(worker_id=worker, credits=1))
    (leased,), _ = stream.collect(tasks=1)
    beat = wpb.WorkHeartbeat(
        tasks=[wpb.TaskAttempt(task_id=leased.id, attempt=1)],
        reports=[report(leased, 0.25, "page 1 of 4", b"page-1")],
    )
    stream.send(heartbeat=beat)
    assert stream.next().HasField("heartbeat")
    got = api.get(task.id)
    assert (got.progress.value, got.progress.message, got.checkpoint) == (0.25, "page 1 of 4", b"page-1")
    assert abs(got.progress.updated_at.ToMicroseconds() / 1e6 - time.time()) < 60
    # The last report rides the failure; the next attempt is leased with its checkpoint.
    failed = wpb.TaskOutcome(
        task_id=leased.id, attempt=1, failure=wpb.TaskFailure(error="crash", retryable=True),
        report=report(leased, 0.5, "page 2 of 4", b"page-2"),
    )  # fmt: skip
    stream.send(outcomes=[failed], credits=1)
    (again,), (result,) = stream.collect(tasks=1, results=1, timeout=15)
    assert result.accepted
    assert (again.attempt, again.checkpoint, again.progress.message) == (2, b"page-2", "page 2 of 4")
    stream.close()


def test_a_progress_is_one_watch_event_marked_progress(api: Api) -> None:
    worker = api.register()
    api.submit()
    watch = api.tasks.Watch(task_service_pb2.WatchRequest(), timeout=30)
    (leased,) = api.lease(worker, wait_ms=5000)
    beat = wpb.HeartbeatRequest(
        worker_id=worker, tasks=[wpb.TaskAttempt(task_id=leased.id, attempt=1)], reports=[report(leased, 0.5, "half")]
    )
    api.workers.Heartbeat(beat)
    api.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=worker, reports=[report(leased, checkpoint=b"c")]))
    api.finish(worker, leased, success=wpb.TaskSuccess(result=b"ok"))
    seen = []
    for answer in watch:
        e = answer.event
        seen.append((task_pb2.TaskState.Name(e.task.state), e.progress))
        if e.progress:
            assert (e.task.progress.value, e.task.progress.message) == (0.5, "half")
        if e.task.state == task_pb2.TASK_STATE_SUCCEEDED:
            break
    watch.cancel()
    # The checkpoint alone is no event.
    assert seen[-3:] == [("TASK_STATE_RUNNING", False), ("TASK_STATE_RUNNING", True), ("TASK_STATE_SUCCEEDED", False)]


@pytest.mark.parametrize(
    ("bad", "field", "shows"),
    [
        ({"value": math.nan}, "progress.value", "nan, not a finite number"),
        ({"value": math.inf}, "progress.value", "inf, not a finite number"),
        ({"value": 0.5, "message": "x" * 1025}, "progress.message", "1025 bytes, more than 1024"),
        ({"value": 0.5, "message": "a\\nforged line"}, "progress.message", "control character"),
        ({"value": 0.5, "message": "a\u2028forged line"}, "progress.message", "control character '\\u2028'"),
        ({"value": 0.5, "message": "report\u202efdp.exe"}, "progress.message", "control character '\\u202e'"),
        ({"checkpoint": b"x" * ((256 << 10) + 1)}, "checkpoint", f"{(256 << 10) + 1} bytes, more than {256 << 10}"),
    ],
)
def test_a_bad_report_is_refused_naming_its_field_and_changes_nothing(
    api: Api, bad: dict[str, Any], field: str, shows: str
) -> None:
    worker = api.register()
    task = api.submit()
    (leased,) = api.lease(worker, wait_ms=5000)
    before = api.get(task.id).lease_expires_at
    message = bad.get("message", "").replace("\\n", "\n")
    bad_report = report(leased, bad.get("value"), message, bad.get("checkpoint"))
    with pytest.raises(grpc.RpcError) as err:
        api.workers.Heartbeat(
            wpb.HeartbeatRequest(
                worker_id=worker, tasks=[wpb.TaskAttempt(task_id=leased.id, attempt=1)], reports=[bad_report]
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"reports (task {leased.id}).{field}" in err.value.details() and shows in err.value.details()
    got = api.get(task.id)
    assert (got.HasField("progress"), got.checkpoint, got.lease_expires_at) == (False, b"", before)
    # On the Work stream, the same report ends the stream; with an outcome, the call is refused.
    stream = Stream(api, wpb.WorkRequest(worker_id=worker, heartbeat=wpb.WorkHeartbeat(reports=[bad_report])))
    ended = stream.next()
    assert isinstance(ended, grpc.RpcError) and ended.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"heartbeat.reports (task {leased.id}).{field}" in ended.details()
    outcome = wpb.TaskOutcome(task_id=leased.id, attempt=1, success=wpb.TaskSuccess(), report=bad_report)
    with pytest.raises(grpc.RpcError) as err:
        api.workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=[outcome]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"outcomes[0].report.{field}" in err.value.details()
    got = api.get(task.id)
    assert (got.state, got.HasField("progress"), got.checkpoint) == (task_pb2.TASK_STATE_RUNNING, False, b"")


def test_a_snooze_frees_the_resource_slot_at_once(start_server: Any, tmp_path: Path) -> None:
    srv = start_server(
        {
            "store": {"path": str(tmp_path / "r.db")},
            "pools": [{"name": "default"}],
            "resources": [{"name": "gpu", "concurrency": 1}],
        }
    )
    api = Api(srv.grpc_target)
    worker = api.register()
    first = api.submit(resources={"gpu": 1}, priority=1)
    second = api.submit(resources={"gpu": 1})
    (leased,) = api.lease(worker, wait_ms=5000)
    assert leased.id == first.id and api.lease(worker) == []  # the one slot is held
    assert api.finish(worker, leased, snoozed=wpb.TaskSnoozed(snooze_ms=60_000)).accepted
    assert [t.id for t in api.lease(worker, wait_ms=5000)] == [second.id]  # freed by the snooze
