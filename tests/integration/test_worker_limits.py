"""Caps on what one worker call carries (outcomes, heartbeat entries, done attempts, pools), on
both stores: a message over a cap is refused with INVALID_ARGUMENT naming the field at once,
before any of it is worked on, and other callers are not kept waiting meanwhile; a Work stream
flooded with messages is answered in steps that leave room for other callers."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, store_table

from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb
from cronoq.v1 import worker_service_pb2_grpc as wpb_grpc

HUGE = 500_000


@pytest.fixture(params=["sqlite", "postgres"])
def api(request: Any, start_server: Any, tmp_path: Path) -> Api:
    server = start_server(
        {"store": store_table(request.param, request, tmp_path / "cronoq.db"), "pools": [{"name": "default"}]}
    )
    api = Api(server.grpc_target)
    api.server = server  # type: ignore[attr-defined]
    return api


class Lister(threading.Thread):
    """Another caller: ListTasks in a loop, on a channel of its own, the slowest answer kept."""

    def __init__(self, target: str):
        super().__init__(daemon=True)
        self.api = Api(target)
        self.slowest = 0.0
        self.calls = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            self.api.tasks.ListTasks(tpb.ListTasksRequest(pool="default", page_size=10), timeout=30)
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.calls += 1
            time.sleep(0.01)


def _raw(api: Api, method: str, streaming: bool = False) -> Any:
    """A call that sends bytes serialized beforehand: what is timed is the server's work."""
    make = api.channel.stream_stream if streaming else api.channel.unary_unary
    return make(f"/cronoq.v1.WorkerService/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)


def test_a_message_of_half_a_million_outcomes_is_refused_at_once_and_others_stay_fast(api: Api) -> None:
    worker = api.register()
    api.submit()
    outcomes = [wpb.TaskOutcome(task_id=i + 1, attempt=1, released=wpb.TaskReleased()) for i in range(HUGE)]
    attempts = [wpb.TaskAttempt(task_id=i + 1, attempt=1) for i in range(HUGE)]
    calls: list[tuple[str, Any, str]] = [
        ("FinishTasks", wpb.FinishTasksRequest(worker_id=worker, outcomes=outcomes), "outcomes"),
        ("Heartbeat", wpb.HeartbeatRequest(worker_id=worker, tasks=attempts), "tasks"),
        ("LeaseTasks", wpb.LeaseTasksRequest(worker_id=worker, max_tasks=1, done=attempts), "done"),
        ("Work", wpb.WorkRequest(worker_id=worker, outcomes=outcomes), "outcomes"),
        ("Work", wpb.WorkRequest(worker_id=worker, heartbeat=wpb.WorkHeartbeat(tasks=attempts)), "heartbeat.tasks"),
        ("RegisterWorker", wpb.RegisterWorkerRequest(name="t", pools=["default"] * HUGE), "pools"),
        ("Work", wpb.WorkRequest(worker_id=worker, pools=["default"] * HUGE), "pools"),
    ]
    lister = Lister(api.server.grpc_target)  # type: ignore[attr-defined]
    lister.start()
    time.sleep(0.3)
    wrong, took = [], []
    for method, request, field in calls:
        data = request.SerializeToString()
        streaming = method == "Work"
        started = time.monotonic()
        try:
            answer = _raw(api, method, streaming)(iter([data]) if streaming else data, timeout=60)
            list(answer) if streaming else answer
            wrong.append(f"{method} {field}: answered OK")
        except grpc.RpcError as err:
            elapsed = time.monotonic() - started
            took.append(f"{method} {field} {elapsed:.2f}s")
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT or field not in (err.details() or ""):
                wrong.append(f"{method} {field}: {err.code().name} {err.details()!r}")
            elif str(HUGE) not in (err.details() or ""):
                wrong.append(f"{method} {field}: the message does not say how many: {err.details()!r}")
            if elapsed > 1.0:  # the parse of ~5 MB and the refusal: tens of milliseconds when idle
                wrong.append(f"{method} {field}: refused after {elapsed:.2f}s")
    lister.stop.set()
    lister.join()
    print("refused in", ", ".join(took), f"; ListTasks slowest {lister.slowest:.3f}s of {lister.calls}")
    assert not wrong, "\n".join(wrong)
    assert lister.calls > 5 and lister.slowest < 1.0, (lister.calls, lister.slowest)


def test_a_flood_of_work_messages_is_answered_in_steps_and_others_stay_fast(api: Api) -> None:
    """Many messages, each within the caps (5,000 outcomes for tasks this worker does not hold):
    every outcome is answered, and another caller's ListTasks is not held up by them."""
    worker = api.register()
    messages, per = 40, 5_000
    lister = Lister(api.server.grpc_target)  # type: ignore[attr-defined]
    lister.start()
    time.sleep(0.3)
    sent = [
        wpb.WorkRequest(
            worker_id=worker,
            outcomes=[
                wpb.TaskOutcome(task_id=m * per + i + 1, attempt=1, released=wpb.TaskReleased()) for i in range(per)
            ],
        )
        for m in range(messages)
    ]
    results = []
    channel = grpc.insecure_channel(api.server.grpc_target, options=[("grpc.max_receive_message_length", 64 << 20)])  # type: ignore[attr-defined]
    for answer in wpb_grpc.WorkerServiceStub(channel).Work(iter(sent), timeout=120):
        results += answer.results
    channel.close()
    lister.stop.set()
    lister.join()
    print(f"ListTasks slowest {lister.slowest:.3f}s of {lister.calls}")
    assert sorted(r.task_id for r in results) == list(range(1, messages * per + 1))
    assert not any(r.accepted for r in results)
    assert lister.calls > 5 and lister.slowest < 1.0, (lister.calls, lister.slowest)
