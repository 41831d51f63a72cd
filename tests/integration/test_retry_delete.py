"""RetryTask, DeleteTask and the attempt history (GetTask include_attempts), against real
servers on both stores, over gRPC and HTTP; and forwarded between two shards."""

from __future__ import annotations

import re
import sqlite3
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import eventually, store_table  # type: ignore[import-not-found]
from google.protobuf.timestamp_pb2 import Timestamp
from test_sharding import TOKENS, TwoShards, sharded_config  # type: ignore[import-not-found]
from test_sharding_faults import pg_fetch  # type: ignore[import-not-found]

from cronoq.v1 import task_pb2, task_service_pb2_grpc, worker_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

pytestmark = pytest.mark.timeout(120)
S = task_pb2
TIMEOUT = 10.0
MISSING_ID = 987654321


# The tokens of the sharding tests: "full" (everything, every pool) and "default-only".
TOKEN_ENTRIES = sharded_config(Path("."), "", "")["tokens"]


class Client:
    """Raw gRPC and HTTP calls to one server as one token."""

    def __init__(self, srv: Any, token: str = "full"):
        self.srv = srv
        self.token = token
        channel = grpc.insecure_channel(srv.grpc_target)
        self.tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        self.workers = worker_service_pb2_grpc.WorkerServiceStub(channel)
        self.md = [("authorization", f"Bearer {TOKENS[token]}")]

    def submit(self, pool: str = "default", **kw: Any) -> task_pb2.Task:
        deps = [task_pb2.TaskRef(key=k) for k in kw.pop("depends_on", [])]
        req = tpb.SubmitTaskRequest(pool=pool, depends_on=deps, **kw)
        return self.tasks.SubmitTask(req, metadata=self.md, timeout=TIMEOUT).task

    def get(self, task_id: int, **kw: Any) -> tpb.GetTaskResponse:
        req = tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task_id), **kw)
        return self.tasks.GetTask(req, metadata=self.md, timeout=TIMEOUT)

    def retry(self, ref: int | str, **kw: Any) -> tpb.RetryTaskResponse:
        req = tpb.RetryTaskRequest(task=_ref(ref), **kw)
        return self.tasks.RetryTask(req, metadata=self.md, timeout=TIMEOUT)

    def delete(self, ref: int | str) -> tpb.DeleteTaskResponse:
        return self.tasks.DeleteTask(tpb.DeleteTaskRequest(task=_ref(ref)), metadata=self.md, timeout=TIMEOUT)

    def cancel(self, task_id: int) -> task_pb2.Task:
        req = tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=task_id))
        return self.tasks.CancelTask(req, metadata=self.md, timeout=TIMEOUT).task

    def register(self, name: str, pools: tuple[str, ...] = ("default",)) -> str:
        req = wpb.RegisterWorkerRequest(name=name, pools=list(pools), concurrency=10)
        return self.workers.RegisterWorker(req, metadata=self.md, timeout=TIMEOUT).worker_id

    def lease_one(self, worker: str, task_id: int) -> task_pb2.Task:
        """Leases until it gets task_id (it must be the only one due in the worker's pools)."""

        def lease() -> list[task_pb2.Task]:
            req = wpb.LeaseTasksRequest(worker_id=worker, max_tasks=1, wait_ms=200)
            return list(self.workers.LeaseTasks(req, metadata=self.md, timeout=TIMEOUT).tasks)

        (task,) = eventually(lease, what=f"a lease of task {task_id}")
        assert task.id == task_id, (task.id, task_id)
        return task

    def finish(self, worker: str, task: task_pb2.Task, **outcome: Any) -> None:
        o = wpb.TaskOutcome(task_id=task.id, attempt=task.attempt, **outcome)
        req = wpb.FinishTasksRequest(worker_id=worker, outcomes=[o])
        result = self.workers.FinishTasks(req, metadata=self.md, timeout=TIMEOUT).results[0]
        assert not result.code, result

    def fail(self, worker: str, task: task_pb2.Task, error: str = "boom", retryable: bool = False) -> None:
        self.finish(worker, task, failure=wpb.TaskFailure(error=error, retryable=retryable))

    def succeed(self, worker: str, task: task_pb2.Task) -> None:
        self.finish(worker, task, success=wpb.TaskSuccess(result=b"ok"))

    def http(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return self.srv.http(method, path, body, token=TOKENS[self.token])  # type: ignore[no-any-return]

    def metric(self, name: str, **labels: str) -> float:
        req = urllib.request.Request(
            self.srv.http_url + "/metrics", headers={"Authorization": f"Bearer {TOKENS['full']}"}
        )
        for line in urllib.request.urlopen(req, timeout=5).read().decode().splitlines():
            m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
            if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == labels:
                return float(m.group(2))
        return 0.0


def _ref(ref: int | str) -> task_pb2.TaskRef:
    return task_pb2.TaskRef(id=ref) if isinstance(ref, int) else task_pb2.TaskRef(key=ref)


def refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


@pytest.fixture(params=["sqlite", "postgres"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    return store_table(kind, request, tmp_path / "retry.db")


def config(store: dict[str, Any]) -> dict[str, Any]:
    return {
        "store": store,
        "tokens": TOKEN_ENTRIES,
        "pools": [
            {"name": "default", "lease_ttl": "1s", "retry_backoff": "10ms", "retry_backoff_max": "10ms"},
            {"name": "other"},
            {"name": "short", "retention": "1s", "retry_backoff": "10ms", "retry_backoff_max": "10ms"},
        ],
    }


@pytest.fixture
def srv(start_server: Any, store: dict[str, Any]) -> Any:
    return start_server(config(store))


@pytest.fixture
def c(srv: Any) -> Client:
    return Client(srv)


def failed_task(c: Client, worker: str, **kw: Any) -> task_pb2.Task:
    task = c.submit(**kw)
    c.fail(worker, c.lease_one(worker, task.id))
    return c.get(task.id).task


# -- RetryTask ----------------------------------------------------------------------


def test_failed_and_cancelled_tasks_are_retried_over_grpc_and_http(c: Client) -> None:
    worker = c.register("alpha")
    failed = failed_task(c, worker, max_attempts=3)
    assert (failed.state, failed.attempt) == (S.TASK_STATE_FAILED, 1)
    before = c.metric("cronoq_task_retries_total", pool="default", reason="manual")
    got = c.retry(failed.id)
    assert (got.task.state, got.task.attempt, got.task.max_attempts, got.task.error) == (S.TASK_STATE_PENDING, 1, 3, "")
    assert got.dependents_restored == 0
    assert c.metric("cronoq_task_retries_total", pool="default", reason="manual") == before + 1
    again = c.lease_one(worker, failed.id)
    assert again.attempt == 2
    c.succeed(worker, again)

    by_key = c.submit(key="kb", run_at=Timestamp(seconds=int(time.time()) + 3600))
    c.cancel(by_key.id)
    status, body = c.http("POST", "/v1/keys/kb/retry", {})
    assert status == 200 and body["task"]["state"] == "TASK_STATE_PENDING", body
    by_id = c.submit(run_at=Timestamp(seconds=int(time.time()) + 3600))
    c.cancel(by_id.id)
    later = Timestamp(seconds=int(time.time()) + 7200)
    status, body = c.http("POST", f"/v1/tasks/{by_id.id}/retry", {"run_at": later.ToJsonString(), "extra_attempts": 2})
    assert status == 200 and body["task"]["run_at"] == later.ToJsonString(), body


def test_only_failed_or_cancelled_tasks_are_retried_and_bad_input_is_refused(c: Client, srv: Any) -> None:
    worker = c.register("alpha")
    running = c.lease_one(worker, c.submit().id)
    pending = c.submit(run_at=Timestamp(seconds=int(time.time()) + 3600))
    done = c.submit(pool="other")
    other_worker = c.register("beta", ("other",))
    c.succeed(other_worker, c.lease_one(other_worker, done.id))
    for task, state in ((running, "RUNNING"), (pending, "PENDING"), (done, "SUCCEEDED")):
        before = c.get(task.id).task
        want = f"task {task.id} is {state}; only a FAILED or CANCELLED task can be retried"
        err = refused(lambda task=task: c.retry(task.id))
        assert (err.code(), err.details()) == (grpc.StatusCode.FAILED_PRECONDITION, want)  # type: ignore[attr-defined]
        status, body = c.http("POST", f"/v1/tasks/{task.id}/retry", {})
        assert (status, body["code"], body["message"]) == (409, "FAILED_PRECONDITION", want)
        assert c.get(task.id).task == before  # nothing changed
    err = refused(lambda: c.retry(MISSING_ID))
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, f"task {MISSING_ID} not found")  # type: ignore[attr-defined]
    # A task of a pool the caller may not read is, to it, a missing task.
    hidden = c.submit(pool="other")
    c.cancel(hidden.id)
    status, body = Client(srv, "default-only").http("POST", f"/v1/tasks/{hidden.id}/retry", {})
    assert (status, body["message"]) == (404, f"task {hidden.id} not found")
    assert c.get(hidden.id).task.state == S.TASK_STATE_CANCELLED
    status, body = c.http("POST", f"/v1/tasks/{hidden.id}/retry", {"extra_attempts": 1001})
    assert status == 400 and body["message"].startswith("extra_attempts: 1001 is not between 0 and 1000"), body
    err = refused(lambda: c.retry(hidden.id, run_at=Timestamp(seconds=253_402_300_800)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("run_at:")  # type: ignore[attr-defined]
    assert c.get(hidden.id).task.state == S.TASK_STATE_CANCELLED


def test_an_exhausted_task_runs_again_and_its_attempts_continue(c: Client) -> None:
    worker = c.register("alpha")
    task = c.submit(max_attempts=3)
    for _ in range(3):
        c.fail(worker, c.lease_one(worker, task.id), retryable=True)
    ended = c.get(task.id).task
    assert (ended.state, ended.attempt, ended.max_attempts) == (S.TASK_STATE_FAILED, 3, 3)
    got = c.retry(task.id).task
    assert (got.state, got.attempt, got.max_attempts) == (S.TASK_STATE_PENDING, 3, 4)
    fourth = c.lease_one(worker, task.id)
    assert (fourth.attempt, fourth.max_attempts) == (4, 4)
    c.succeed(worker, fourth)
    attempts = c.get(task.id, include_attempts=True).attempts
    assert [(a.attempt, a.outcome) for a in attempts] == [
        (1, S.ATTEMPT_OUTCOME_FAILED),
        (2, S.ATTEMPT_OUTCOME_FAILED),
        (3, S.ATTEMPT_OUTCOME_FAILED),
        (4, S.ATTEMPT_OUTCOME_SUCCEEDED),
    ]


def test_dependents_ended_by_a_task_wait_for_it_again_then_run(c: Client) -> None:
    worker = c.register("alpha")
    a = c.submit(key="a")
    b = c.submit(key="b", depends_on=["a"])
    cc = c.submit(key="c", depends_on=["b"])
    c.fail(worker, c.lease_one(worker, a.id))
    assert [c.get(t.id).task.state for t in (b, cc)] == [S.TASK_STATE_FAILED] * 2
    err = refused(lambda: c.retry(b.id))  # alone: it would wait for a task that will not run
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert err.details() == (  # type: ignore[attr-defined]
        f"task {b.id} depends on task {a.id}, which is FAILED: retry that one (the tasks it ended wait for it again)"
    )
    got = c.retry("a")
    assert got.dependents_restored == 2
    assert [c.get(t.id).task.state for t in (b, cc)] == [S.TASK_STATE_BLOCKED] * 2
    for task in (a, b, cc):
        c.succeed(worker, c.lease_one(worker, task.id))
    assert c.get(cc.id).task.state == S.TASK_STATE_SUCCEEDED


def test_a_retry_restores_only_the_dependents_the_caller_may_retry(c: Client, srv: Any) -> None:
    """A caller who may not submit to a dependent's pool does not bring it back, nor count it
    (RetryTask and RetryTasks); a cancel ends it all the same, and its answer shows none of it."""
    worker = c.register("alpha")
    mine = Client(srv, "default-only")
    dep = c.submit(key="dep")
    other = c.submit(pool="other", key="other", depends_on=["dep"])

    def fail_dep() -> None:
        c.fail(worker, c.lease_one(worker, dep.id))

    def bulk_retry(client: Client) -> tpb.RetryTasksResponse:
        req = tpb.RetryTasksRequest(filter=tpb.TaskFilter(ids=[dep.id]))
        return client.tasks.RetryTasks(req, metadata=client.md, timeout=TIMEOUT)

    def state() -> int:
        return c.get(other.id).task.state

    fail_dep()
    ended = c.get(other.id).task
    assert ended.state == S.TASK_STATE_FAILED
    assert list(mine.get(dep.id, include_dependents=True).dependents) == []
    got = mine.retry(dep.id)
    assert (got.task.state, got.dependents_restored) == (S.TASK_STATE_PENDING, 0)
    assert c.get(other.id).task == ended
    fail_dep()
    assert (bulk_retry(mine).changed, c.get(other.id).task) == (1, ended)
    fail_dep()
    status, body = mine.http("POST", f"/v1/tasks/{dep.id}/retry", {})
    assert status == 200 and int(body.get("dependents_restored", 0)) == 0, body
    assert c.get(other.id).task == ended
    # Who may submit to both pools brings it back.
    fail_dep()
    assert c.retry(dep.id).dependents_restored == 1 and state() == S.TASK_STATE_BLOCKED
    fail_dep()
    assert state() == S.TASK_STATE_FAILED
    assert bulk_retry(c).changed == 1 and state() == S.TASK_STATE_BLOCKED
    # A cancel ends the dependents of every pool (what a dependency means); the answer names only its task.
    cancelled = mine.cancel(dep.id)
    assert (cancelled.id, cancelled.state, state()) == (dep.id, S.TASK_STATE_CANCELLED, S.TASK_STATE_CANCELLED)
    assert c.retry(dep.id).dependents_restored == 1 and state() == S.TASK_STATE_BLOCKED
    req = tpb.CancelTasksRequest(filter=tpb.TaskFilter(ids=[dep.id]))
    answer = mine.tasks.CancelTasks(req, metadata=mine.md, timeout=TIMEOUT)
    assert (answer.matched, answer.changed, state()) == (1, 1, S.TASK_STATE_CANCELLED)


# -- DeleteTask -----------------------------------------------------------------------


def test_delete_removes_an_ended_task_and_refuses_an_unfinished_one(c: Client) -> None:
    worker = c.register("alpha")
    done = c.submit(key="done")
    c.succeed(worker, c.lease_one(worker, done.id))
    assert c.delete(done.id).id == done.id
    err = refused(lambda: c.get(done.id))
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, f"task {done.id} not found")  # type: ignore[attr-defined]
    failed = failed_task(c, worker, key="failed")
    status, body = c.http("DELETE", "/v1/keys/failed")
    assert (status, body) == (200, {"id": str(failed.id)})
    assert c.http("GET", f"/v1/tasks/{failed.id}")[0] == 404
    pending = c.submit(run_at=Timestamp(seconds=int(time.time()) + 3600))
    status, body = c.http("DELETE", f"/v1/tasks/{pending.id}")
    assert (status, body["code"]) == (409, "FAILED_PRECONDITION")
    assert body["message"].startswith(f"task {pending.id} is PENDING; only an ended task"), body
    assert c.get(pending.id).task.state == S.TASK_STATE_PENDING
    assert c.http("DELETE", f"/v1/tasks/{MISSING_ID}")[0] == 404


def test_a_watch_resumes_past_the_events_of_a_deleted_task(c: Client) -> None:
    pending = lambda: c.metric("cronoq_tasks", pool="default", state="pending")  # noqa: E731
    gone = c.submit(run_at=Timestamp(seconds=int(time.time()) + 3600))
    eventually(lambda: pending() == 1, what="the submission counted")
    c.cancel(gone.id)
    # Once the leader has counted the task's events, they are deleted with it.
    eventually(lambda: pending() == 0, what="the cancel counted")
    c.delete(gone.id)
    kept = c.submit(run_at=Timestamp(seconds=int(time.time()) + 3600))
    stream = c.tasks.Watch(tpb.WatchRequest(cursor="0:0"), metadata=c.md, timeout=TIMEOUT)
    first = next(iter(stream))
    assert first.event.task.id == kept.id
    stream.cancel()


# -- attempt history ----------------------------------------------------------------


def test_attempts_show_their_workers_outcomes_errors_and_durations(c: Client) -> None:
    alpha, beta = c.register("alpha"), c.register("beta")
    task = c.submit(max_attempts=5)
    c.fail(alpha, c.lease_one(alpha, task.id), "first", retryable=True)
    c.fail(beta, c.lease_one(beta, task.id), "second", retryable=True)
    third = c.lease_one(alpha, task.id)
    running = c.get(task.id, include_attempts=True).attempts
    assert [(a.attempt, a.worker_name, a.outcome, a.error) for a in running] == [
        (1, "alpha", S.ATTEMPT_OUTCOME_FAILED, "first"),
        (2, "beta", S.ATTEMPT_OUTCOME_FAILED, "second"),
        (3, "alpha", S.ATTEMPT_OUTCOME_RUNNING, ""),
    ]
    assert not running[2].HasField("ended_at") and running[2].HasField("started_at")
    c.succeed(alpha, third)
    status, body = c.http("GET", f"/v1/tasks/{task.id}?include_attempts=true")
    assert status == 200
    attempts = body["attempts"]
    assert [(a["attempt"], a["worker_id"], a["outcome"]) for a in attempts] == [
        (1, alpha, "ATTEMPT_OUTCOME_FAILED"),
        (2, beta, "ATTEMPT_OUTCOME_FAILED"),
        (3, alpha, "ATTEMPT_OUTCOME_SUCCEEDED"),
    ]
    for a in attempts:
        started, ended = Timestamp(), Timestamp()
        started.FromJsonString(a["started_at"])
        ended.FromJsonString(a["ended_at"])
        assert int(a.get("duration_ms", "0")) == (ended.ToMicroseconds() - started.ToMicroseconds()) // 1000
    # A worker the shard no longer knows is shown by its id only.
    c.workers.DeregisterWorker(wpb.DeregisterWorkerRequest(worker_id=beta), metadata=c.md, timeout=TIMEOUT)
    assert [a.worker_name for a in c.get(task.id, include_attempts=True).attempts] == ["alpha", "", "alpha"]
    assert list(c.get(task.id).attempts) == []  # only when asked


def test_a_lost_attempt_shows_lost(c: Client) -> None:
    worker = c.register("alpha")
    task = c.submit(max_attempts=1)
    c.lease_one(worker, task.id)  # and never heard of again: the lease (1 s) expires
    eventually(lambda: c.get(task.id).task.state == S.TASK_STATE_FAILED, what="the lease expired")
    (attempt,) = c.get(task.id, include_attempts=True).attempts
    assert (attempt.outcome, attempt.error, attempt.worker_name) == (S.ATTEMPT_OUTCOME_LOST, "lease expired", "alpha")


def test_retention_purge_removes_attempts(start_server: Any, store: dict[str, Any], kind: str, tmp_path: Path) -> None:
    srv = start_server(config(store))
    c = Client(srv)
    worker = c.register("alpha", ("short",))
    task = failed_task(c, worker, pool="short")
    assert len(c.get(task.id, include_attempts=True).attempts) == 1
    time.sleep(1.1)  # past the pool's retention (1 s)
    srv.stop()
    srv.start()  # the leader purges when it takes over
    eventually(lambda: c.http("GET", f"/v1/tasks/{task.id}")[0] == 404, what="the purge")
    seq = task.id & ((1 << 56) - 1)
    if kind == "postgres":
        rows = pg_fetch(store["url"], f"SELECT count(*) FROM {store['schema']}.attempts WHERE task_seq = {seq}")
        assert rows[0][0] == 0
    else:
        with sqlite3.connect(store["path"]) as db:
            assert db.execute("SELECT count(*) FROM attempts WHERE task_seq = ?", (seq,)).fetchone()[0] == 0


# -- two shards -----------------------------------------------------------------------


def test_retry_and_delete_are_forwarded_to_the_tasks_shard(tmp_path: Path, start_server: Any) -> None:
    shards = TwoShards(tmp_path, start_server)
    cpu = shards.stubs["cpu"]
    md = [("authorization", "Bearer full-token")]
    llm = cpu.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="llm", key="llm-1"), metadata=md, timeout=TIMEOUT).task
    assert llm.id >> 56 == 2
    cpu.tasks.CancelTask(tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=llm.id)), metadata=md, timeout=TIMEOUT)
    by_id = cpu.tasks.RetryTask(tpb.RetryTaskRequest(task=task_pb2.TaskRef(id=llm.id)), metadata=md, timeout=TIMEOUT)
    assert (by_id.task.id, by_id.task.state) == (llm.id, S.TASK_STATE_PENDING)
    cpu.tasks.CancelTask(tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=llm.id)), metadata=md, timeout=TIMEOUT)
    req = tpb.RetryTaskRequest(task=task_pb2.TaskRef(key="llm-1"))
    by_key = cpu.tasks.RetryTask(req, metadata=md, timeout=TIMEOUT)
    assert (by_key.task.id, by_key.task.state) == (llm.id, S.TASK_STATE_PENDING)
    gpu = shards.stubs["gpu"]
    got = gpu.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=llm.id)), metadata=md, timeout=TIMEOUT)
    assert got.task.state == S.TASK_STATE_PENDING
    cpu.tasks.CancelTask(tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=llm.id)), metadata=md, timeout=TIMEOUT)
    deleted = cpu.tasks.DeleteTask(
        tpb.DeleteTaskRequest(task=task_pb2.TaskRef(id=llm.id)), metadata=md, timeout=TIMEOUT
    )
    assert deleted.id == llm.id
    err = refused(lambda: gpu.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=llm.id)), metadata=md))
    assert err.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
