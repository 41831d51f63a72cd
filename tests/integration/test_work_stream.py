"""The Work stream on the wire (raw gRPC, no SDK), on both stores: tasks only as credits
allow, outcomes answered with the next tasks, tasks pushed when they arrive, heartbeats,
a malformed outcome refused alone, refusals that name the field (malformed messages too), the
end of the stream when the server drains; and the caps on what one worker call carries (a list
over its cap refused at once, a flood of messages answered in steps, other callers not held up)."""

from __future__ import annotations

import queue
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, store_table

from cronoq.v1 import task_pb2, task_service_pb2
from cronoq.v1 import worker_service_pb2 as wpb
from cronoq.v1 import worker_service_pb2_grpc as wpb_grpc

QUIET_S = 0.4  # no message within this: none is coming
LEASE_TTL_S = 30.0  # the default pool's lease_ttl


class Stream:
    """One Work stream: messages are sent from a queue, answers read by a thread of their own."""

    def __init__(self, api: Api, first: wpb.WorkRequest):
        self._out: queue.Queue[wpb.WorkRequest | None] = queue.Queue()
        self._in: queue.Queue[Any] = queue.Queue()
        self._out.put(first)
        self.call = api.workers.Work(iter(self._out.get, None), timeout=60)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for answer in self.call:
                self._in.put(answer)
            self._in.put("ended")
        except grpc.RpcError as err:
            self._in.put(err)

    def send(self, **fields: Any) -> None:
        self._out.put(wpb.WorkRequest(**fields))

    def close(self) -> None:
        self._out.put(None)

    def next(self, timeout: float = 10.0) -> Any:
        """The next answer, "ended" (OK), or the RpcError that ended the stream."""
        return self._in.get(timeout=timeout)

    def quiet(self, seconds: float = QUIET_S) -> bool:
        try:
            item = self._in.get(timeout=seconds)
        except queue.Empty:
            return True
        self._in.put(item)
        return False

    def collect(self, tasks: int = 0, results: int = 0, timeout: float = 10.0) -> tuple[list[Any], list[Any]]:
        """Answers until at least this many tasks and results came."""
        got_tasks: list[Any] = []
        got_results: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got_tasks) < tasks or len(got_results) < results:
            answer = self.next(max(deadline - time.monotonic(), 0.01))
            assert isinstance(answer, wpb.WorkResponse), answer
            got_tasks += answer.tasks
            got_results += answer.results
        return got_tasks, got_results


def open_streams(api: Api) -> float:
    """The server's cronoq_work_streams gauge."""
    with urllib.request.urlopen(f"{api.server.http_url}/metrics", timeout=10) as r:  # type: ignore[attr-defined]
        lines = r.read().decode().splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith("cronoq_work_streams ")))


def success(task: task_pb2.Task) -> wpb.TaskOutcome:
    return wpb.TaskOutcome(task_id=task.id, attempt=task.attempt, success=wpb.TaskSuccess(result=b"ok"))


@pytest.fixture(params=["sqlite", "postgres"])
def api(request: Any, start_server: Any, tmp_path: Path) -> Api:
    server = start_server(
        {"store": store_table(request.param, request, tmp_path / "cronoq.db"), "pools": [{"name": "default"}]}
    )
    api = Api(server.grpc_target)
    api.server = server  # type: ignore[attr-defined]
    return api


def test_tasks_come_only_as_credits_allow_and_outcomes_are_answered_with_the_next(api: Api) -> None:
    worker = api.register()
    submitted = {api.submit().id for _ in range(5)}
    stream = Stream(api, wpb.WorkRequest(worker_id=worker, credits=2))
    first, _ = stream.collect(tasks=2)
    assert len(first) == 2 and stream.quiet(), "more tasks than the 2 credits given"
    assert open_streams(api) == 1
    stream.send(outcomes=[success(t) for t in first], credits=1)
    second, results = stream.collect(tasks=1, results=2)
    assert [(r.task_id, r.accepted) for r in results] == [(t.id, True) for t in first]
    assert len(second) == 1 and stream.quiet(), "more tasks than the credit given back"
    assert all(api.get(t.id).state == task_pb2.TASK_STATE_SUCCEEDED for t in first)
    # Credits left over wait for work: a task submitted later is pushed at once.
    stream.send(outcomes=[success(second[0])], credits=10)
    rest, _ = stream.collect(tasks=2, results=1)
    assert {t.id for t in first + second + rest} == submitted
    late = api.submit().id
    pushed, _ = stream.collect(tasks=1, timeout=3)
    assert [t.id for t in pushed] == [late]
    stream.send(outcomes=[success(t) for t in rest + pushed])
    stream.collect(results=3)
    stream.close()
    assert stream.next() == "ended"
    assert all(api.get(i).state == task_pb2.TASK_STATE_SUCCEEDED for i in submitted | {late})
    assert open_streams(api) == 0


def test_a_malformed_outcome_is_refused_alone_and_the_stream_goes_on(api: Api) -> None:
    worker = api.register()
    api.submit()
    stream = Stream(api, wpb.WorkRequest(worker_id=worker, credits=1))
    (task,), _ = stream.collect(tasks=1)
    bad = wpb.TaskOutcome(task_id=task.id, attempt=task.attempt)  # no outcome given
    stream.send(outcomes=[bad, success(task)])
    _, results = stream.collect(results=2)
    assert (results[0].accepted, results[0].code) == (False, "INVALID_ARGUMENT")
    assert f"task {task.id}" in results[0].message and "give success, failure" in results[0].message
    assert results[1].accepted
    stream.send(heartbeat=wpb.WorkHeartbeat())
    assert isinstance(stream.next(), wpb.WorkResponse)  # still open
    stream.close()
    assert stream.next() == "ended"


def test_a_heartbeat_on_the_stream_reports_a_cancelled_task(api: Api) -> None:
    worker = api.register()
    api.submit()
    stream = Stream(api, wpb.WorkRequest(worker_id=worker, credits=1))
    (task,), _ = stream.collect(tasks=1)
    api.tasks.CancelTask(task_service_pb2.CancelTaskRequest(task=task_pb2.TaskRef(id=task.id)))
    stream.send(heartbeat=wpb.WorkHeartbeat(tasks=[wpb.TaskAttempt(task_id=task.id, attempt=task.attempt)]))
    answer = stream.next()
    assert list(answer.heartbeat.cancelled_task_ids) == [task.id]
    outcome = wpb.TaskOutcome(task_id=task.id, attempt=task.attempt, cancelled=wpb.TaskCancelled(reason="asked"))
    stream.send(outcomes=[outcome])
    _, (result,) = stream.collect(results=1)
    assert result.accepted and api.get(task.id).state == task_pb2.TASK_STATE_CANCELLED
    stream.close()


def test_refusals_end_the_stream_naming_the_field(api: Api) -> None:
    worker = api.register()
    other = api.register()
    cases: list[tuple[str, list[wpb.WorkRequest], grpc.StatusCode, str]] = [
        ("unknown worker", [wpb.WorkRequest(worker_id="f" * 32, credits=1)], grpc.StatusCode.NOT_FOUND, "worker_id"),
        (
            "a pool the worker did not register for",
            [wpb.WorkRequest(worker_id=worker, credits=1, pools=["elsewhere"])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "pools",
        ),
        (
            "another worker's id later on",
            [wpb.WorkRequest(worker_id=worker), wpb.WorkRequest(worker_id=other)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "worker_id",
        ),
        (
            "pools after the first message",
            [wpb.WorkRequest(worker_id=worker), wpb.WorkRequest(pools=["default"])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "pools",
        ),
        (
            "more credits than any worker has slots",
            [wpb.WorkRequest(worker_id=worker, credits=100_001)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "credits",
        ),
    ]
    wrong = []
    for name, messages, code, field in cases:
        stream = Stream(api, messages[0])
        for m in messages[1:]:
            stream._out.put(m)
        ended = stream.next()
        while isinstance(ended, wpb.WorkResponse):
            ended = stream.next()
        if not isinstance(ended, grpc.RpcError) or ended.code() != code or field not in (ended.details() or ""):
            wrong.append(f"{name}: {ended!r}, want {code.name} naming {field!r}")
        stream.close()
    assert not wrong, "\n".join(wrong)
    # A stream closed before its first message is simply over.
    assert list(api.workers.Work(iter([]), timeout=10)) == []


def test_sigterm_ends_open_streams_promptly_after_answering_them(api: Api) -> None:
    worker = api.register()
    api.submit()
    stream = Stream(api, wpb.WorkRequest(worker_id=worker, credits=1))
    (task,), _ = stream.collect(tasks=1)
    idle = Stream(api, wpb.WorkRequest(worker_id=api.register(), credits=0))  # waits for its worker only
    stream.send(outcomes=[success(task)])
    stream.collect(results=1)
    started = time.monotonic()
    api.server.signal(signal.SIGTERM)  # type: ignore[attr-defined]
    for s in (stream, idle):
        ended = s.next(timeout=10)
        assert isinstance(ended, grpc.RpcError) and ended.code() == grpc.StatusCode.UNAVAILABLE, ended
        assert "shutting down" in (ended.details() or ""), ended  # the drain's answer, not a cut connection
    assert time.monotonic() - started < 5
    assert api.server.proc.wait(20) == 0  # type: ignore[attr-defined]


def test_tasks_submitted_while_steps_run_are_never_missed(api: Api) -> None:
    """Submissions racing the stream's leases (a wake can come while a lease is under way and
    find nothing new): every task is delivered, none waits for a later nudge."""
    worker = api.register()
    stream = Stream(api, wpb.WorkRequest(worker_id=worker, credits=4))
    total, got = 150, []

    def submit() -> None:
        for i in range(total):
            api.submit()
            time.sleep(0.002 * (i % 3))

    producer = threading.Thread(target=submit)
    producer.start()
    deadline = time.monotonic() + 30
    while len(got) < total and time.monotonic() < deadline:
        answer = stream.next(timeout=max(deadline - time.monotonic(), 0.01))
        assert isinstance(answer, wpb.WorkResponse), answer
        got += answer.tasks
        if answer.tasks:
            stream.send(outcomes=[success(t) for t in answer.tasks], credits=len(answer.tasks))
    producer.join()
    assert len(got) == total and len({t.id for t in got}) == total
    stream.close()


def test_a_stream_whose_lease_expired_gets_no_task_until_its_worker_speaks_again(api: Api) -> None:
    """A hung worker keeps its stream open: when its lease expires, the task goes to another
    worker (the hung one's long-standing wait would have been served first), and the hung
    stream gets nothing more until its worker sends something."""
    hung = Stream(api, wpb.WorkRequest(worker_id=api.register(), credits=5))
    first = api.submit(timeout_ms=500, max_attempts=3)
    (leased,), _ = hung.collect(tasks=1)
    assert leased.id == first.id
    healthy = Stream(api, wpb.WorkRequest(worker_id=api.register(), credits=5))
    (again,), _ = healthy.collect(tasks=1, timeout=10)  # after the 500 ms deadline
    assert (again.id, again.attempt) == (first.id, 2)
    other = api.submit()
    (pushed,), _ = healthy.collect(tasks=1)
    assert pushed.id == other.id and hung.quiet()
    # The hung worker comes back: a heartbeat, and it is served again.
    hung.send(heartbeat=wpb.WorkHeartbeat(tasks=[wpb.TaskAttempt(task_id=leased.id, attempt=leased.attempt)]))
    answer = hung.next()
    assert list(answer.heartbeat.lost_task_ids) == [leased.id]
    healthy.send(outcomes=[success(again), success(pushed)])
    healthy.collect(results=2)
    healthy.close()
    # Once its stream has ended: a task leased to it before the server read its close comes
    # back only as the stream ends (given back, as it was never reported).
    assert healthy.next() == "ended"
    late = api.submit()
    (served,), _ = hung.collect(tasks=1)
    assert served.id == late.id
    hung.close()


def test_a_task_sent_to_a_worker_that_closed_its_side_is_released_at_once(api: Api) -> None:
    """A task and the worker's closing cross on the wire: the worker never runs it, and the
    server gives it back as the stream ends, not at the lease's expiry (30 s), so another
    worker runs it once."""
    closing = Stream(api, wpb.WorkRequest(worker_id=api.register(), credits=1))
    task = api.submit()
    (sent,), _ = closing.collect(tasks=1)
    assert sent.id == task.id
    started = time.monotonic()
    closing.send(closing=True)  # without reporting it: the worker was closing when it arrived
    closing.close()
    assert closing.next() == "ended"
    assert api.get(task.id).state == task_pb2.TASK_STATE_PENDING  # once the stream has ended
    other = Stream(api, wpb.WorkRequest(worker_id=api.register(), credits=1))
    (again,), _ = other.collect(tasks=1)
    assert again.id == task.id and time.monotonic() - started < LEASE_TTL_S / 3
    other.send(outcomes=[success(again)])
    other.collect(results=1)
    assert api.get(task.id).state == task_pb2.TASK_STATE_SUCCEEDED and other.quiet()
    other.close()


def test_a_stream_that_closes_while_a_task_is_leased_to_it_strands_nothing(api: Api) -> None:
    """Each round, a worker closes its side just as a task is submitted, so the close races the
    lease (read before it, during it, or after the task was sent): however it falls, the task
    runs once on the other worker, promptly rather than after the lease's expiry."""
    runner = Stream(api, wpb.WorkRequest(worker_id=api.register(), credits=0))  # asks once the close is sent
    for _ in range(10):
        closing = Stream(api, wpb.WorkRequest(worker_id=api.register(), credits=1))
        time.sleep(0.05)  # mostly waiting for work by now; either way the lease races the close
        task = api.submit()
        closing.send(closing=True)
        closing.close()
        started = time.monotonic()
        runner.send(credits=1)
        (ran,), _ = runner.collect(tasks=1, timeout=LEASE_TTL_S / 3)
        assert ran.id == task.id and time.monotonic() - started < LEASE_TTL_S / 3
        runner.send(outcomes=[success(ran)])
        runner.collect(results=1)
        assert api.get(task.id).state == task_pb2.TASK_STATE_SUCCEEDED
        ended = closing.next()
        while isinstance(ended, wpb.WorkResponse):  # the task, sent before the close was read
            assert [t.id for t in ended.tasks] == [task.id], ended
            ended = closing.next()
        assert ended == "ended"
    assert runner.quiet()
    runner.close()


def test_a_stream_closed_without_its_workers_closing_keeps_its_leases(api: Api) -> None:
    """A worker that closes its side without WorkRequest.closing (one from before it) may still
    be running what it was sent: the tasks stay its own, and it reports them on a next stream."""
    worker = api.register()
    older = Stream(api, wpb.WorkRequest(worker_id=worker, credits=1))
    task = api.submit()
    (sent,), _ = older.collect(tasks=1)
    older.close()
    assert older.next() == "ended"
    assert api.get(task.id).state == task_pb2.TASK_STATE_RUNNING
    again = Stream(api, wpb.WorkRequest(worker_id=worker, outcomes=[success(sent)]))
    _, (result,) = again.collect(results=1)
    assert result.accepted and api.get(task.id).state == task_pb2.TASK_STATE_SUCCEEDED
    again.close()


def test_a_stream_cut_without_its_workers_close_keeps_its_leases(api: Api) -> None:
    """A stream that fails (a call cancelled, a connection lost) says nothing of the worker's
    tasks: it may run them still and report them on its next stream, so they stay its own."""
    worker = api.register()
    cut = Stream(api, wpb.WorkRequest(worker_id=worker, credits=1))
    task = api.submit()
    (sent,), _ = cut.collect(tasks=1)
    cut.call.cancel()
    deadline = time.monotonic() + 10
    while open_streams(api) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_streams(api) == 0
    assert api.get(task.id).state == task_pb2.TASK_STATE_RUNNING
    again = Stream(api, wpb.WorkRequest(worker_id=worker, outcomes=[success(sent)]))
    _, (result,) = again.collect(results=1)
    assert result.accepted and api.get(task.id).state == task_pb2.TASK_STATE_SUCCEEDED
    again.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_an_outcome_frees_its_resource_for_the_tasks_sent_with_its_result(
    kind: str, request: Any, start_server: Any, tmp_path: Path
) -> None:
    """Tasks that each take the whole resource: the answer to one's outcome brings the next."""
    server = start_server(
        {
            "store": store_table(kind, request, tmp_path / "cronoq.db"),
            "pools": [{"name": "default"}],
            "resources": [{"name": "slot", "concurrency": 1}],
        }
    )
    api = Api(server.grpc_target)
    ids = [api.submit(resources={"slot": 1}).id for _ in range(3)]
    stream = Stream(api, wpb.WorkRequest(worker_id=api.register(), credits=3))
    (task,), _ = stream.collect(tasks=1)
    for expected in ids[1:]:
        assert task.id != expected and stream.quiet()  # the slot is taken
        stream.send(outcomes=[success(task)], credits=1)
        answer = stream.next()
        assert [r.accepted for r in answer.results] == [True]
        assert [t.id for t in answer.tasks] == [expected], "the slot freed by the outcome was not used"
        (task,) = answer.tasks
    stream.close()


def _bad_utf8(message: Any) -> bytes:
    """The message's bytes with its text "éé" made invalid UTF-8 (same length)."""
    data = message.SerializeToString()
    assert b"\xc3\xa9\xc3\xa9" in data
    return data.replace(b"\xc3\xa9\xc3\xa9", b"\xff\xfe\xff\xfe")


def test_malformed_messages_are_invalid_argument_naming_the_field_without_a_traceback(api: Api) -> None:
    """Messages no worker of an SDK sends: each ends its Work stream (or call) with
    INVALID_ARGUMENT naming the field, never INTERNAL, and the server logs no traceback."""
    worker = api.register()
    first = wpb.WorkRequest(worker_id=worker).SerializeToString()
    outcome = wpb.TaskOutcome(task_id=1, attempt=1)
    truncated = wpb.WorkRequest(worker_id=worker, outcomes=[outcome]).SerializeToString()[:-3]
    work: list[tuple[str, list[bytes], str]] = [
        ("bytes that are no message", [b"\xff\xff\xff"], "WorkRequest"),
        ("worker_id not UTF-8", [_bad_utf8(wpb.WorkRequest(worker_id="éé"))], "worker_id"),
        ("no worker_id in the first message", [wpb.WorkRequest(credits=1).SerializeToString()], "worker_id"),
        ("a later message that is no message", [first, b"\xff\xff"], "WorkRequest"),
        ("a later message cut short", [first, truncated], "outcomes[0]"),
        (
            "an outcome's content_type not UTF-8",
            [first, _bad_utf8(wpb.WorkRequest(outcomes=[wpb.TaskOutcome(success=wpb.TaskSuccess(content_type="éé"))]))],
            "outcomes[0].success.content_type",
        ),
        (
            "a second outcome's error not UTF-8",
            [
                first,
                _bad_utf8(wpb.WorkRequest(outcomes=[outcome, wpb.TaskOutcome(failure=wpb.TaskFailure(error="éé"))])),
            ],
            "outcomes[1].failure.error",
        ),
    ]
    raw = api.channel.stream_stream(
        "/cronoq.v1.WorkerService/Work",
        request_serializer=lambda b: b,
        response_deserializer=wpb.WorkResponse.FromString,
    )
    wrong = []
    for name, messages, field in work:
        try:
            list(raw(iter(messages), timeout=10))
            wrong.append(f"{name}: the stream ended OK, want INVALID_ARGUMENT naming {field!r}")
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT or field not in (err.details() or ""):
                wrong.append(f"{name}: {err.code().name} {err.details()!r}, want INVALID_ARGUMENT naming {field!r}")
    # Unary and server-streaming calls parse their request the same way.
    for method, data, field in [
        ("/cronoq.v1.WorkerService/FinishTasks", b"\xff\xff", "FinishTasksRequest"),
        ("/cronoq.v1.WorkerService/Heartbeat", _bad_utf8(wpb.HeartbeatRequest(worker_id="éé")), "worker_id"),
        ("/cronoq.v1.TaskService/Watch", b"\xff\xff", "WatchRequest"),
    ]:
        call = (api.channel.unary_stream if method.endswith("Watch") else api.channel.unary_unary)(
            method, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        try:
            answer = call(data, timeout=10)
            list(answer) if method.endswith("Watch") else answer
            wrong.append(f"{method}: OK, want INVALID_ARGUMENT naming {field!r}")
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT or field not in (err.details() or ""):
                wrong.append(f"{method}: {err.code().name} {err.details()!r}, want INVALID_ARGUMENT naming {field!r}")
    assert not wrong, "\n".join(wrong)
    time.sleep(0.2)  # the log lines of the last call
    log = api.server.log()  # type: ignore[attr-defined]
    assert "Traceback" not in log, log[log.index("Traceback") - 300 :][:3000]
    assert log.count("malformed") >= len(work), "each refusal of a malformed message is logged"


# -- Caps on what one call carries ----------------------------------------------------------

HUGE = 500_000


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
            self.api.tasks.ListTasks(task_service_pb2.ListTasksRequest(pool="default", page_size=10), timeout=30)
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.calls += 1
            time.sleep(0.01)


def _raw(api: Api, method: str, streaming: bool = False) -> Any:
    """A call that sends bytes serialized beforehand: what is timed is the server's work."""
    make = api.channel.stream_stream if streaming else api.channel.unary_unary
    return make(f"/cronoq.v1.WorkerService/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)


def test_a_message_of_half_a_million_outcomes_is_refused_unparsed_and_others_stay_fast(api: Api) -> None:
    worker = api.register()
    api.submit()
    outcomes = [wpb.TaskOutcome(task_id=i + 1, attempt=1, released=wpb.TaskReleased()) for i in range(HUGE)]
    attempts = [wpb.TaskAttempt(task_id=i + 1, attempt=1) for i in range(HUGE)]
    # Lists over their cap are counted on the wire and refused unparsed, naming the cap; a
    # RegisterWorker or LeaseTasks of this size is over those methods' 1 MiB.
    over_cap, too_large = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    calls: list[tuple[str, Any, str, grpc.StatusCode, str]] = [
        ("FinishTasks", wpb.FinishTasksRequest(worker_id=worker, outcomes=outcomes), "outcomes", over_cap, "10000"),
        ("Heartbeat", wpb.HeartbeatRequest(worker_id=worker, tasks=attempts), "tasks", over_cap, "100000"),
        ("LeaseTasks", wpb.LeaseTasksRequest(worker_id=worker, max_tasks=1, done=attempts), "LeaseTasks", too_large,
         "the 1048576 bytes"),
        ("Work", wpb.WorkRequest(worker_id=worker, outcomes=outcomes), "outcomes", over_cap, "10000"),
        ("Work", wpb.WorkRequest(worker_id=worker, heartbeat=wpb.WorkHeartbeat(tasks=attempts)), "heartbeat.tasks",
         over_cap, "100000"),
        ("RegisterWorker", wpb.RegisterWorkerRequest(name="t", pools=["default"] * HUGE), "RegisterWorker", too_large,
         "the 1048576 bytes"),
        ("Work", wpb.WorkRequest(worker_id=worker, pools=["default"] * HUGE), "pools", over_cap, "1000"),
    ]  # fmt: skip
    lister = Lister(api.server.grpc_target)  # type: ignore[attr-defined]
    lister.start()
    time.sleep(0.3)
    wrong, took = [], []
    for method, request, field, code, limit in calls:
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
            if err.code() != code or field not in (err.details() or ""):
                wrong.append(f"{method} {field}: {err.code().name} {err.details()!r}")
            elif f"more than {limit}" not in (err.details() or ""):
                wrong.append(f"{method} {field}: the message does not name the limit: {err.details()!r}")
            if elapsed > 1.0:  # the refusal, before any parse: tens of milliseconds when idle
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
