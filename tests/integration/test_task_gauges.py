"""cronoq_tasks{pool,state} on a real server equals the store's unfinished tasks as they
change (submits, leases, outcomes, retries, cancels, a dependency chain), and on the standby
that takes over after the leader is killed."""

from __future__ import annotations

import asyncio
import sqlite3
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from _helpers import Api, eventually
from prometheus_client.parser import text_string_to_metric_families

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

STATES = {1: "pending", 2: "blocked", 3: "running"}
Counts = dict[tuple[str, str], int]


def gauges(srv: Any) -> Counts:
    """The server's cronoq_tasks samples that are not 0."""
    with urllib.request.urlopen(srv.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.labels["pool"], s.labels["state"]): int(s.value)
        for family in text_string_to_metric_families(text)
        if family.name == "cronoq_tasks"
        for s in family.samples
        if s.value
    }


SQL = "SELECT pool, state, count(*) FROM {}tasks WHERE state IN (1, 2, 3) GROUP BY pool, state"


class StoreCounts:
    """The store's actual counts, read beside the servers."""

    def __init__(self, kind: str, tmp_path: Path, pg: Any):
        self.kind = kind
        self.path = str(tmp_path / "shared.db")
        self.schema = f"gauges_{uuid.uuid4().hex[:10]}"
        self.url = pg.url if pg is not None else ""

    def config(self) -> dict[str, Any]:
        store: dict[str, Any] = {"path": self.path}
        if self.kind == "postgres":
            store = {"kind": "postgres", "url": self.url, "schema": self.schema}
        pools = [{"name": "default", "lease_ttl": "30s", "retry_backoff": "50ms"}, {"name": "other"}]
        return {"store": store, "pools": pools}

    def __call__(self) -> Counts:
        if self.kind == "sqlite":
            db = sqlite3.connect(self.path)
            try:
                rows = db.execute(SQL.format("")).fetchall()
            finally:
                db.close()
        else:

            async def read() -> list[Any]:
                conn = await asyncpg.connect(self.url)
                try:
                    return list(await conn.fetch(SQL.format(f'"{self.schema}".')))
                finally:
                    await conn.close()

            rows = asyncio.run(read())
        return {(pool, STATES[state]): n for pool, state, n in rows}


def assert_gauges_follow(srv: Any, actual: StoreCounts, what: str) -> None:
    last: list[Counts] = []

    def equal() -> bool:
        last[:] = [gauges(srv), actual()]
        return last[0] == last[1]

    try:
        eventually(equal, timeout=10, interval=0.05, what=what)
    except Exception:
        pytest.fail(f"{what}: gauges {last[0]} != store {last[1]}")


def cancel(api: Api, task_id: int) -> task_pb2.Task:
    return api.tasks.CancelTask(tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=task_id))).task


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_task_gauges_follow_every_change_and_a_failover(kind: str, start_server: Any, tmp_path: Path, request) -> None:
    actual = StoreCounts(kind, tmp_path, request.getfixturevalue("postgres") if kind == "postgres" else None)
    config = actual.config()
    leader = start_server(config, name="first")
    standby = start_server(config, name="second", wait_ready=False)
    standby.wait_ready(leader=False)
    api = Api(leader.grpc_target)

    plain = [api.submit("default", payload=b"x") for _ in range(5)]
    a = api.submit("other", key="a")
    b = api.submit("other", key="b", depends_on=["a"])
    api.submit("other", key="c", depends_on=["b"])
    api.submit("other", key="d", depends_on=["a"])
    assert_gauges_follow(leader, actual, "submitted, two BLOCKED on a")

    worker = api.register(("default", "other"))
    # Of default alone: a lease of a worker's pools deals them in turns, and a must stay PENDING here.
    leased = list(api.workers.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker, max_tasks=3, pools=["default"])).tasks)
    assert len(leased) == 3 and all(t.pool == "default" for t in leased)
    assert_gauges_follow(leader, actual, "three leased")

    assert api.succeed(worker, leased[0]).accepted
    assert api.fail(worker, leased[1], retryable=True).accepted  # PENDING again
    cancel(api, leased[2].id)  # RUNNING: a cancel request, still RUNNING
    waiting = next(t for t in plain if t.id not in {x.id for x in leased})
    cancel(api, waiting.id)  # PENDING -> CANCELLED
    assert_gauges_follow(leader, actual, "a success, a retry, cancels")

    assert api.finish(worker, leased[2], cancelled=wpb.TaskCancelled()).accepted
    rest = api.lease(worker, 10)  # the default pool's two, a, and perhaps the retried one
    for t in rest:
        if t.id == a.id:
            assert api.succeed(worker, t).accepted  # b and d unblocked
        else:
            assert api.finish(worker, t, released=wpb.TaskReleased()).accepted  # PENDING again
    assert a.id in {t.id for t in rest}
    assert_gauges_follow(leader, actual, "a succeeded, its dependents PENDING")
    cancel(api, b.id)  # b PENDING (or RUNNING if the lease above took it) and c with it
    assert_gauges_follow(leader, actual, "b cancelled")

    leader.kill()  # SIGKILL: the standby takes over and counts from the store
    standby.wait_ready(timeout=20)
    api = Api(standby.grpc_target)
    assert_gauges_follow(standby, actual, "after the failover")
    api.submit("other", key="e", depends_on=["c"])  # c was cancelled: e CANCELLED at once
    api.submit("default")
    assert_gauges_follow(standby, actual, "changes on the new leader")
