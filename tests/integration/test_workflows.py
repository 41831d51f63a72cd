"""Workflows through real cronoq-server processes, on the wire (no SDK), on SQLite and
PostgreSQL: dependency results reach a leased dependent (and GetTask); a finalizer runs after a
failure and sees it; a success spawns children and a join in its transaction, with parent_id,
GetTask's children, ListTasks' filter.parent_id and the HTTP form; a spawn the worker's principal
may not submit, or into another shard's pool, fails the attempt and creates nothing; a
cancel with include_descendants stops the workflow; dependency results over the limit are
refused at submit and fail a task unrun when they only grow later."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import grpc
import pytest
from _helpers import Api, store_table

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

JSON = "application/json"
S = task_pb2.TaskState
TOKENS = {
    "admin": (["*"], ["submit", "read", "cancel", "work", "admin"]),
    # A worker of pool a that may submit to a only: it may not spawn into b.
    "worker-a": (["a"], ["submit", "read", "work"]),
    "read-a": (["a"], ["read"]),
    "cancel-a": (["a"], ["read", "cancel"]),
}


def md(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(params=["sqlite", "postgres"])
def srv(request: pytest.FixtureRequest, start_server: Any, tmp_path: Any) -> Any:
    store = store_table(request.param, request, tmp_path / "cronoq.db")
    return start_server(
        {
            "store": store,
            "pools": [{"name": "a", "lease_ttl": "30s"}, {"name": "b", "lease_ttl": "30s"}],
            "limits": {"max_dependency_results_bytes": 1000},
            "tokens": [
                {"name": n, "sha256": hashlib.sha256(n.encode()).hexdigest(), "pools": p, "permissions": perms}
                for n, (p, perms) in TOKENS.items()
            ],
        }
    )


class Flow:
    """Raw calls as one principal."""

    def __init__(self, srv: Any, token: str = "admin"):
        self.api = Api(srv.grpc_target)
        self.md = md(token)

    def submit(self, pool: str = "a", **kw: Any) -> task_pb2.Task:
        deps = [task_pb2.TaskRef(id=d) if isinstance(d, int) else task_pb2.TaskRef(key=d) for d in kw.pop("deps", [])]
        req = tpb.SubmitTaskRequest(pool=pool, depends_on=deps, **kw)
        return self.api.tasks.SubmitTask(req, metadata=self.md, timeout=10).task

    def get(self, task_id: int, **kw: Any) -> tpb.GetTaskResponse:
        req = tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task_id), **kw)
        return self.api.tasks.GetTask(req, metadata=self.md, timeout=10)

    def register(self, pools: tuple[str, ...] = ("a",)) -> str:
        req = wpb.RegisterWorkerRequest(name="t", pools=list(pools), concurrency=100)
        return self.api.workers.RegisterWorker(req, metadata=self.md, timeout=10).worker_id

    def lease(self, worker: str, n: int = 100) -> list[task_pb2.Task]:
        req = wpb.LeaseTasksRequest(worker_id=worker, max_tasks=n, wait_ms=0)
        return list(self.api.workers.LeaseTasks(req, metadata=self.md, timeout=10).tasks)

    def succeed(self, worker: str, task: task_pb2.Task, result: Any = None, spawn: Any = ()) -> wpb.FinishTaskResult:
        success = wpb.TaskSuccess(spawn=list(spawn))
        if result is not None:
            success.result, success.content_type = json.dumps(result).encode(), JSON
        o = wpb.TaskOutcome(task_id=task.id, attempt=task.attempt, success=success)
        req = wpb.FinishTasksRequest(worker_id=worker, outcomes=[o])
        return self.api.workers.FinishTasks(req, metadata=self.md, timeout=10).results[0]

    def fail(self, worker: str, task: task_pb2.Task, error: str) -> None:
        o = wpb.TaskOutcome(task_id=task.id, attempt=task.attempt, failure=wpb.TaskFailure(error=error))
        self.api.workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=[o]), metadata=self.md)


def child(key: str, *deps: str | int, pool: str = "a", **kw: Any) -> tpb.SubmitTaskRequest:
    refs = [task_pb2.TaskRef(id=d) if isinstance(d, int) else task_pb2.TaskRef(key=d) for d in deps]
    return tpb.SubmitTaskRequest(pool=pool, key=key, depends_on=refs, **kw)


def values(task: task_pb2.Task) -> dict[int, Any]:
    return {d.id: json.loads(d.result) if d.content_type == JSON else d.result for d in task.dependency_results}


def test_results_reach_the_dependent_and_a_finalizer_sees_a_failure(srv: Any) -> None:
    f = Flow(srv)
    a, b = f.submit(key="A"), f.submit(key="B")
    c = f.submit(key="C", deps=["A", "B"])
    fin = f.submit(key="F", deps=["C"], run_when=task_pb2.RUN_WHEN_DEPENDENCIES_ENDED)
    assert fin.run_when == task_pb2.RUN_WHEN_DEPENDENCIES_ENDED and fin.state == S.TASK_STATE_BLOCKED
    w = f.register()
    first = {t.key: t for t in f.lease(w)}
    assert set(first) == {"A", "B"} and all(not t.dependency_results for t in first.values())
    f.succeed(w, first["A"], 2)
    f.succeed(w, first["B"], 3)
    (leased_c,) = f.lease(w)
    assert leased_c.id == c.id and values(leased_c) == {a.id: 2, b.id: 3}
    assert [(d.key, d.state) for d in leased_c.dependency_results] == [
        ("A", S.TASK_STATE_SUCCEEDED),
        ("B", S.TASK_STATE_SUCCEEDED),
    ]
    assert values(f.get(c.id, include_dependency_results=True).task) == {a.id: 2, b.id: 3}
    assert not f.get(c.id).task.dependency_results  # only when asked
    f.api.workers.FinishTasks(
        wpb.FinishTasksRequest(
            worker_id=w,
            outcomes=[
                wpb.TaskOutcome(task_id=c.id, attempt=1, failure=wpb.TaskFailure(error="C broke", retryable=True))
            ],
        ),
        metadata=f.md,
    )
    # A retryable failure with attempts left: the finalizer still waits.
    assert f.get(fin.id).task.state == S.TASK_STATE_BLOCKED
    f.api.tasks.CancelTask(tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=c.id)), metadata=f.md)
    (leased_fin,) = f.lease(w)
    assert leased_fin.id == fin.id
    (dep,) = leased_fin.dependency_results
    assert (dep.id, dep.state, dep.error) == (c.id, S.TASK_STATE_CANCELLED, "cancelled")
    status, body = srv.http("GET", f"/v1/tasks/{c.id}?include_dependency_results=true", token="admin")
    assert status == 200, body
    deps = body["task"]["dependency_results"]
    assert [(d["id"], d["state"], d["result_json"]) for d in deps] == [
        (str(a.id), "TASK_STATE_SUCCEEDED", 2),
        (str(b.id), "TASK_STATE_SUCCEEDED", 3),
    ]


def test_a_success_spawns_children_and_a_join_in_its_transaction(srv: Any) -> None:
    f = Flow(srv, "worker-a")
    root = f.submit(key="root")
    w = f.register()
    (leased,) = f.lease(w)
    spawn = [child(f"c{i}") for i in range(5)] + [child("join", *[f"c{i}" for i in range(5)])]
    spawn.append(child("after-root", root.id))  # depends on its parent, which succeeds with it
    assert f.succeed(w, leased, {"n": 5}, spawn).accepted
    got = f.get(root.id, include_children=True)
    assert got.task.state == S.TASK_STATE_SUCCEEDED
    kids = {t.key: t for t in got.children}
    assert set(kids) == {"c0", "c1", "c2", "c3", "c4", "join", "after-root"}
    assert {t.parent_id for t in got.children} == {root.id}
    assert kids["join"].state == S.TASK_STATE_BLOCKED and not kids["join"].payload
    listed = f.api.tasks.ListTasks(tpb.ListTasksRequest(filter=tpb.TaskFilter(parent_id=root.id)), metadata=f.md)
    assert [t.id for t in listed.tasks] == sorted(t.id for t in got.children)
    status, body = srv.http("GET", f"/v1/tasks?filter.parent_id={root.id}", token="admin")
    assert status == 200 and len(body["tasks"]) == 7, body
    status, body = srv.http("GET", f"/v1/tasks/{root.id}?include_children=true", token="admin")
    assert status == 200 and {t["parent_id"] for t in body["children"]} == {str(root.id)}, body
    running = {t.key: t for t in f.lease(w)}
    assert set(running) == {"c0", "c1", "c2", "c3", "c4", "after-root"}
    assert values(running["after-root"]) == {root.id: {"n": 5}}  # its parent's result
    for i in range(5):
        f.succeed(w, running[f"c{i}"], i + 1)
    (join,) = f.lease(w)
    assert join.key == "join" and sum(values(join).values()) == 15


def test_a_spawn_the_worker_may_not_submit_fails_the_attempt_and_creates_nothing(srv: Any) -> None:
    f = Flow(srv, "worker-a")
    root = f.submit(key="root", max_attempts=3)
    w = f.register()
    (leased,) = f.lease(w)
    result = f.succeed(w, leased, 1, [child("ok"), child("denied", pool="b")])
    assert result.accepted  # the outcome is applied: as the failure it became
    task = f.get(root.id).task
    assert task.state == S.TASK_STATE_FAILED, task
    assert "spawn" in task.error and "'b'" in task.error
    admin = Flow(srv)
    for key in ("ok", "denied"):
        with pytest.raises(grpc.RpcError) as err:
            admin.api.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(key=key)), metadata=admin.md)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_spawn_of_an_unknown_pool_or_a_stale_attempt_creates_nothing(srv: Any) -> None:
    f = Flow(srv)
    root = f.submit(key="root")
    w = f.register()
    (leased,) = f.lease(w)
    stale = wpb.TaskOutcome(task_id=root.id, attempt=2, success=wpb.TaskSuccess(spawn=[child("ghost")]))
    refused = f.api.workers.FinishTasks(wpb.FinishTasksRequest(worker_id=w, outcomes=[stale]), metadata=f.md)
    assert not refused.results[0].accepted and refused.results[0].code == "FAILED_PRECONDITION"
    assert f.succeed(w, leased, 1, [child("x", pool="nowhere")]).accepted
    task = f.get(root.id, include_children=True)
    assert task.task.state == S.TASK_STATE_FAILED and "nowhere" in task.task.error
    assert not task.children


def test_cancel_with_descendants_stops_the_workflow(srv: Any) -> None:
    f = Flow(srv)
    root = f.submit(key="root")
    w = f.register()
    (leased,) = f.lease(w)
    f.succeed(w, leased, 1, [child("c1"), child("c2"), child("join", "c1", "c2")])
    assert len(f.lease(w)) == 2  # c1 and c2 running: asked to stop
    req = tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=root.id), include_descendants=True)
    read_only = Flow(srv, "read-a")
    with pytest.raises(grpc.RpcError) as err:
        read_only.api.tasks.CancelTask(req, metadata=read_only.md)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    answer = f.api.tasks.CancelTask(req, metadata=f.md)
    assert answer.task.state == S.TASK_STATE_SUCCEEDED and answer.descendants_cancelled == 3
    kids = {t.key: t for t in f.get(root.id, include_children=True).children}
    assert kids["join"].state == S.TASK_STATE_CANCELLED
    assert kids["c1"].cancel_requested and kids["c2"].cancel_requested


def test_dependency_results_over_the_limit(srv: Any) -> None:
    f = Flow(srv)
    w = f.register()
    big = [f.submit(key=f"big{i}") for i in range(2)]
    waiting = f.submit(key="waiting", deps=["big0", "big1"])
    for t in f.lease(w):
        f.succeed(w, t, "x" * 600)
    with pytest.raises(grpc.RpcError) as err:
        f.submit(key="late", deps=["big0", "big1"])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_dependency_results_bytes 1000" in (err.value.details() or "")
    assert str(big[0].id) in (err.value.details() or "")
    assert f.lease(w) == []  # waiting's results grew past the limit: it fails unrun
    task = f.get(waiting.id).task
    assert task.state == S.TASK_STATE_FAILED and "max_dependency_results_bytes" in task.error, task


def test_a_spawn_names_only_dependencies_its_worker_may_read(srv: Any) -> None:
    admin, f = Flow(srv), Flow(srv, "worker-a")
    admin.submit("b", key="secret")
    root = f.submit(key="root")
    w = f.register()
    (leased,) = f.lease(w)
    assert f.succeed(w, leased, 1, [child("peek", "secret")]).accepted
    task = f.get(root.id).task
    assert task.state == S.TASK_STATE_FAILED and "no task with key 'secret'" in task.error, task


def test_cancel_with_descendants_leaves_the_pools_the_caller_may_not_cancel(srv: Any) -> None:
    f = Flow(srv)
    root = f.submit(key="root")
    w = f.register()
    (leased,) = f.lease(w)
    f.succeed(w, leased, 1, [child("in-a"), child("in-b", pool="b")])
    req = tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=root.id), include_descendants=True)
    answer = f.api.tasks.CancelTask(req, metadata=md("cancel-a"))
    assert answer.descendants_cancelled == 1
    kids = {t.key: t.state for t in f.get(root.id, include_children=True).children}
    assert kids == {"in-a": S.TASK_STATE_CANCELLED, "in-b": S.TASK_STATE_PENDING}
