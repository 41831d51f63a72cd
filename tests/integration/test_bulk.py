"""Bulk actions by filter (CancelTasks, RetryTasks, DeleteTasks) on one real server, on both
stores, over gRPC and HTTP: filters, dry runs, repeats, and filters refused whole."""

from __future__ import annotations

import hashlib
import time
import urllib.request
from typing import Any

import grpc
import pytest
from _helpers import Api, store_table  # type: ignore[import-not-found]
from conftest import ServerProcess  # type: ignore[import-not-found]
from google.protobuf.timestamp_pb2 import Timestamp

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

pytestmark = pytest.mark.timeout(120)

S = task_pb2
PENDING, RUNNING, FAILED, CANCELLED = (
    S.TASK_STATE_PENDING,
    S.TASK_STATE_RUNNING,
    S.TASK_STATE_FAILED,
    S.TASK_STATE_CANCELLED,
)


@pytest.fixture(params=["sqlite", "postgres"])
def srv(request: pytest.FixtureRequest, start_server: Any) -> ServerProcess:
    """forward_timeout 100 ms: a bulk call goes on 50 ms at most (the first batch of 100 always)."""
    return start_server(
        {
            "server": {"forward_timeout": "100ms"},
            "pools": [{"name": "default", "lease_ttl": "30s"}, {"name": "other", "lease_ttl": "30s"}],
            "store": store_table(request.param, request),
        }
    )


def states(api: Api, *tasks: task_pb2.Task) -> list[int]:
    return [api.get(t.id).state for t in tasks]


def cancel(api: Api, dry_run: bool = False, **f: Any) -> tpb.CancelTasksResponse:
    return api.tasks.CancelTasks(tpb.CancelTasksRequest(filter=tpb.TaskFilter(**f), dry_run=dry_run), timeout=30)


def counts(response: Any) -> tuple[int, int, list[tuple[str, int, int]]]:
    return response.matched, response.changed, [(s.shard, s.matched, s.changed) for s in response.shards]


def test_cancel_by_pool_dry_run_then_for_real_then_again(srv: ServerProcess) -> None:
    api = Api(srv.grpc_target)
    running = api.submit(payload=b"r")
    worker = api.register()
    assert [t.id for t in api.lease(worker, 1)] == [running.id]
    pending = [api.submit(payload=b"p") for _ in range(3)]
    blocked = api.submit(depends_on=[pending[0].id])
    elsewhere = api.submit("other")

    assert counts(cancel(api, dry_run=True, pool="default")) == (5, 0, [("unsharded", 5, 0)])
    assert states(api, running, *pending) == [RUNNING, PENDING, PENDING, PENDING]

    assert counts(cancel(api, pool="default")) == (5, 5, [("unsharded", 5, 0 + 5)])
    assert states(api, *pending, blocked, elsewhere) == [CANCELLED] * 4 + [PENDING]
    got = api.get(running.id)
    assert got.state == RUNNING and got.cancel_requested
    # Safe to repeat: the running task is still matched, nothing changes.
    assert counts(cancel(api, pool="default")) == (1, 0, [("unsharded", 1, 0)])


def test_a_long_bulk_call_answers_incomplete_and_the_same_call_continues(srv: ServerProcess) -> None:
    api = Api(srv.grpc_target)
    total = 3000
    for _ in range(total // 1000):
        api.tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="other")] * 1000))
    answers = []
    while not answers or answers[-1].incomplete:
        answers.append(cancel(api, pool="other"))
        assert len(answers) < 200
    assert len(answers) > 1 and answers[0].incomplete and answers[0].shards[0].incomplete
    assert 0 < answers[0].changed < total
    assert sum(a.changed for a in answers) == total and answers[-1].matched == answers[-1].changed


def test_retry_failed_by_error_and_finished_bounds_then_delete_ended(srv: ServerProcess) -> None:
    api = Api(srv.grpc_target)
    worker = api.register()
    done = api.submit(payload=b"ok")
    api.succeed(worker, api.lease(worker, 1)[0])
    failing = [api.submit(max_attempts=1) for _ in range(3)]
    leased = {t.id: t for t in api.lease(worker, 3)}
    errors = ["HTTP 503 from api", "100% _bad_ input", "timeout"]
    cut = Timestamp()
    for i, (task, error) in enumerate(zip(failing, errors, strict=True)):
        if i == 1:
            time.sleep(0.01)
            cut.GetCurrentTime()
            time.sleep(0.01)
        api.finish(worker, leased[task.id], failure=wpb.TaskFailure(error=error, retryable=False))
    assert states(api, *failing) == [FAILED] * 3

    def retry(dry_run: bool = False, **f: Any) -> tpb.RetryTasksResponse:
        req = tpb.RetryTasksRequest(filter=tpb.TaskFilter(**f), dry_run=dry_run)
        return api.tasks.RetryTasks(req, timeout=30)

    assert counts(retry(dry_run=True, error_contains="503")) == (1, 0, [("unsharded", 1, 0)])
    assert counts(retry(error_contains="% _")) == (1, 1, [("unsharded", 1, 1)])
    assert counts(retry(finished_before=cut)) == (1, 1, [("unsharded", 1, 1)])
    assert states(api, *failing) == [PENDING, PENDING, FAILED]
    assert counts(retry(finished_before=cut)) == (0, 0, [("unsharded", 0, 0)])  # done already
    status, answer = srv.http("POST", "/v1/tasks/bulk-retry", {"filter": {"finished_after": cut.ToJsonString()}})
    assert status == 200 and (int(answer["matched"]), int(answer["changed"])) == (1, 1), answer
    assert states(api, *failing) == [PENDING] * 3 and api.get(failing[2].id).attempt == 1
    with pytest.raises(grpc.RpcError) as err:
        retry(states=[PENDING])
    assert "filter.states[0]: PENDING is not a state retry applies to (FAILED, CANCELLED)" in err.value.details()  # type: ignore[attr-defined]
    assert _metric(srv, 'cronoq_task_retries_total{pool="default",reason="manual"}') == 3

    def delete(dry_run: bool = False, **f: Any) -> tpb.DeleteTasksResponse:
        req = tpb.DeleteTasksRequest(filter=tpb.TaskFilter(**f), dry_run=dry_run)
        return api.tasks.DeleteTasks(req, timeout=30)

    assert counts(delete(dry_run=True, pool="default")) == (1, 0, [("unsharded", 1, 0)])  # the one ended
    status, answer = srv.http("POST", "/v1/tasks/bulk-delete", {"filter": {"pool": "default"}})
    assert status == 200 and int(answer["changed"]) == 1, answer
    with pytest.raises(grpc.RpcError) as err:
        api.get(done.id)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert counts(cancel(api, pool="default")) == (3, 3, [("unsharded", 3, 3)])
    assert counts(delete(states=[CANCELLED])) == (3, 3, [("unsharded", 3, 3)])
    assert counts(delete(states=[CANCELLED])) == (0, 0, [("unsharded", 0, 0)])


def _metric(srv: ServerProcess, sample: str) -> float:
    with urllib.request.urlopen(srv.http_url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    return 0.0


def test_filters_by_state_created_key_prefix_and_ids_over_http(srv: ServerProcess) -> None:
    api = Api(srv.grpc_target)
    old = api.submit(key="50%_off/old")
    time.sleep(0.01)
    cut = Timestamp()
    cut.GetCurrentTime()
    time.sleep(0.01)
    pct = api.submit(key="50%_off/new")
    lookalike = api.submit(key="50xyoff/new")
    plain = [api.submit() for _ in range(3)]

    def bulk(body: dict[str, Any]) -> dict[str, Any]:
        status, answer = srv.http("POST", "/v1/tasks/bulk-cancel", body)
        assert status == 200, answer
        return answer

    answer = bulk({"filter": {"key_prefix": "50%_off", "created_after": cut.ToJsonString()}, "dry_run": True})
    assert (int(answer["matched"]), int(answer.get("changed", 0))) == (1, 0)
    answer = bulk({"filter": {"key_prefix": "50%_off", "created_before": cut.ToJsonString()}})
    assert (int(answer["matched"]), int(answer["changed"])) == (1, 1)
    assert states(api, old, pct, lookalike) == [CANCELLED, PENDING, PENDING]
    answer = bulk({"filter": {"ids": [str(plain[0].id), str(plain[2].id)], "states": ["TASK_STATE_PENDING"]}})
    assert int(answer["changed"]) == 2 and answer["shards"][0]["shard"] == "unsharded"
    assert states(api, *plain) == [CANCELLED, PENDING, CANCELLED]
    bulk({"filter": {"states": ["TASK_STATE_PENDING", "TASK_STATE_BLOCKED", "TASK_STATE_RUNNING"]}})
    assert states(api, pct, lookalike, plain[1]) == [CANCELLED] * 3


BAD_FILTERS: list[tuple[dict[str, Any], str]] = [
    ({}, "filter: nothing set"),
    ({"pool": "nope"}, "filter.pool: unknown pool 'nope'"),
    ({"states": [S.TASK_STATE_FAILED]}, "filter.states[0]: FAILED is not a state cancel applies to"),
    ({"key_prefix": "k" * 257}, "filter.key_prefix: 257 bytes, more than 256"),
    ({"error_contains": "é" * 513}, "filter.error_contains: 1026 bytes, more than 1024"),
    ({"ids": list(range(1, 1002))}, "filter.ids: 1001 ids, more than 1000"),
    ({"ids": [0]}, "filter.ids[0]: 0 is not a task id"),
    ({"created_after": Timestamp(seconds=-62_135_596_801)}, "filter.created_after: seconds -62135596801"),
]


def test_a_bad_filter_is_refused_and_changes_nothing(srv: ServerProcess) -> None:
    api = Api(srv.grpc_target)
    task = api.submit()
    for f, message in BAD_FILTERS:
        with pytest.raises(grpc.RpcError) as err:
            cancel(api, **f)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f  # type: ignore[attr-defined]
        assert message in err.value.details(), err.value.details()  # type: ignore[attr-defined]
    assert states(api, task) == [PENDING]


TOKENS = {
    "a-cancel-read": (["a"], ["cancel", "read"]),
    "a-cancel": (["a"], ["cancel"]),
    "all-cancel": (["*"], ["cancel"]),
    "admin": (["*"], ["submit", "read", "cancel", "admin"]),
}


def test_a_bulk_call_covers_only_pools_the_caller_may_act_on_and_read(start_server: Any) -> None:
    """A pool named without the permission or read on it: refused, nothing changed; no pool
    named: only the pools where the caller holds both are covered."""
    srv = start_server(
        {
            "pools": [{"name": "a"}, {"name": "b"}],
            "tokens": [
                {"name": n, "sha256": hashlib.sha256(n.encode()).hexdigest(), "pools": p, "permissions": perms}
                for n, (p, perms) in TOKENS.items()
            ],
        }
    )
    api = Api(srv.grpc_target)
    admin = [("authorization", "Bearer admin")]
    a = api.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="a"), metadata=admin).task
    b = api.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="b"), metadata=admin).task

    def as_(token: str, **f: Any) -> Any:
        req = tpb.CancelTasksRequest(filter=tpb.TaskFilter(**f))
        return api.tasks.CancelTasks(req, metadata=[("authorization", f"Bearer {token}")], timeout=30)

    for token, pool in (("a-cancel", "a"), ("a-cancel-read", "b"), ("all-cancel", "a")):
        with pytest.raises(grpc.RpcError) as err:
            as_(token, pool=pool)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (token, pool)  # type: ignore[attr-defined]
    for token in ("a-cancel", "all-cancel"):  # may cancel but not read: nothing is theirs to see
        assert counts(as_(token, states=[PENDING])) == (0, 0, [("unsharded", 0, 0)])

    def state(task: task_pb2.Task) -> int:
        return api.tasks.GetTask(tpb.GetTaskRequest(task=S.TaskRef(id=task.id)), metadata=admin).task.state

    assert [state(a), state(b)] == [PENDING, PENDING]
    assert counts(as_("a-cancel-read", states=[PENDING])) == (1, 1, [("unsharded", 1, 1)])
    assert [state(a), state(b)] == [CANCELLED, PENDING]
