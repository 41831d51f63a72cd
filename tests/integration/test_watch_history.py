"""A Watch event shows its task as that change left it, not as it is now: replayed after the
task moved on, the submission's PENDING event carries no worker, start or finish, and each
attempt's events carry that attempt's worker. Real servers, gRPC, SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from _helpers import Api, eventually, store_table
from test_watch import history, take, watch

from cronoq.v1 import task_pb2

PENDING, RUNNING, SUCCEEDED = (task_pb2.TaskState.Value(f"TASK_STATE_{s}") for s in ("PENDING", "RUNNING", "SUCCEEDED"))


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_replayed_event_shows_the_task_as_that_change_left_it(start_server: Any, request: Any, kind: str) -> None:
    srv = start_server({"store": store_table(kind, request), "pools": [{"name": "default", "retry_backoff": "50ms"}]})
    api = Api(srv.grpc_target)
    task = api.submit(payload=b"in")
    first, second = api.register(), api.register()
    (leased,) = api.lease(first)
    assert api.fail(first, leased).accepted  # attempt 1 fails: retried
    (leased,) = eventually(lambda: api.lease(second), what="the retry leased by the second worker")
    assert api.succeed(second, leased, b"out").accepted
    now = api.get(task.id)
    assert now.worker_id == second and now.HasField("finished_at")

    got = take(watch(api, "0:0", include_payloads=True), 5)  # everything, replayed from the store
    assert history(got) == [
        (task.id, PENDING, 0),
        (task.id, RUNNING, 1),
        (task.id, PENDING, 1),
        (task.id, RUNNING, 2),
        (task.id, SUCCEEDED, 2),
    ]
    submitted, started, retried, restarted, succeeded = (e.task for e in got)
    for t in got:
        assert t.task.payload == b"in" and t.task.created_at == now.created_at
    assert submitted.worker_id == "" and submitted.error == "" and submitted.result == b""
    for field in ("started_at", "finished_at", "lease_expires_at"):
        assert not submitted.HasField(field), (field, submitted)
    assert submitted.run_at == submitted.created_at  # not the retry's later run_at
    assert started.worker_id == first and started.HasField("started_at") and started.HasField("lease_expires_at")
    assert not started.HasField("finished_at") and started.error == ""
    assert retried.worker_id == "" and retried.error == "boom" and not retried.HasField("finished_at")
    assert retried.run_at.ToMicroseconds() > submitted.run_at.ToMicroseconds()
    assert restarted.worker_id == second and restarted.started_at.ToMicroseconds() > started.started_at.ToMicroseconds()
    assert not restarted.HasField("finished_at") and restarted.result == b""
    assert succeeded == now
