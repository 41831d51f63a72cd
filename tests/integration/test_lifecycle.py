"""The task lifecycle against a real server, through the gRPC API."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from _helpers import Api, eventually

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

S = task_pb2


@pytest.fixture
def api(server) -> Api:
    return Api(server.grpc_target)


def test_ids_carry_shard_zero_and_count_up(api):
    a, b = api.submit(), api.submit()
    assert (a.id >> 56, b.id >> 56) == (0, 0)
    assert b.id == a.id + 1


def test_key_deduplicates(api):
    first = api.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="default", key="k", payload=b"1"))
    again = api.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="default", key="k", payload=b"2"))
    assert not first.deduplicated and again.deduplicated
    assert again.task.id == first.task.id and again.task.payload == b"1"


def test_priority_then_fifo(api):
    low1 = api.submit(priority=0)
    high = api.submit(priority=5)
    low2 = api.submit(priority=0)
    mid = api.submit(priority=1)
    w = api.register()
    assert [t.id for t in api.lease(w)] == [high.id, mid.id, low1.id, low2.id]


def test_run_at_delays_the_lease(api):
    req = tpb.SubmitTaskRequest(pool="default")
    req.run_at.FromMicroseconds(int((time.time() + 0.6) * 1e6))
    task = api.tasks.SubmitTask(req).task
    w = api.register()
    assert api.lease(w) == []
    started = time.monotonic()
    leased = api.lease(w, wait_ms=3000)
    assert [t.id for t in leased] == [task.id]
    assert 0.3 < time.monotonic() - started < 2.0


def test_lease_long_poll_wakes_on_submit(api):
    w = api.register()
    result: list[list[S.Task]] = []
    poll = threading.Thread(target=lambda: result.append(api.lease(w, wait_ms=10_000)))
    poll.start()
    time.sleep(0.3)
    submitted_at = time.monotonic()
    task = api.submit()
    poll.join(5)
    assert [t.id for t in result[0]] == [task.id]
    assert time.monotonic() - submitted_at < 0.5, "the long poll must wake on submit, not on a timer"


def test_dependencies_block_until_success(api):
    a = api.submit(key="a")
    b = api.submit(key="b", depends_on=["a"])
    c = api.submit(depends_on=[a.id, b.id])
    assert (b.state, c.state) == (S.TASK_STATE_BLOCKED, S.TASK_STATE_BLOCKED)
    w = api.register()
    (la,) = api.lease(w)
    assert la.id == a.id
    assert api.succeed(w, la).accepted
    assert api.get(b.id).state == S.TASK_STATE_PENDING
    assert api.get(c.id).state == S.TASK_STATE_BLOCKED
    (lb,) = api.lease(w)
    api.succeed(w, lb)
    assert api.get(c.id).state == S.TASK_STATE_PENDING


def test_failed_dependency_fails_dependents_naming_it(api):
    a = api.submit(max_attempts=1)
    b = api.submit(depends_on=[a.id])
    c = api.submit(depends_on=[b.id])
    w = api.register()
    (la,) = api.lease(w)
    api.fail(w, la)
    for dependent, dep in ((b, a), (c, b)):
        got = api.get(dependent.id)
        assert got.state == S.TASK_STATE_FAILED
        assert str(dep.id) in got.error


def test_batch_may_depend_on_its_own_keys(api):
    resp = api.tasks.SubmitBatch(
        tpb.SubmitBatchRequest(
            tasks=[
                tpb.SubmitTaskRequest(pool="default", key="load", depends_on=[S.TaskRef(key="extract")]),
                tpb.SubmitTaskRequest(pool="default", key="extract"),
            ]
        )
    )
    load, extract = resp.tasks
    assert load.depends_on == [extract.id]
    assert (load.state, extract.state) == (S.TASK_STATE_BLOCKED, S.TASK_STATE_PENDING)


def test_retry_backs_off_then_fails_after_max_attempts(api):
    task = api.submit(max_attempts=2)
    w = api.register()
    (first,) = api.lease(w)
    api.fail(w, first)
    retried = api.get(task.id)
    assert retried.state == S.TASK_STATE_PENDING and retried.error == "boom"
    assert retried.run_at.ToMicroseconds() > retried.created_at.ToMicroseconds()
    (second,) = api.lease(w, wait_ms=3000)
    assert second.attempt == 2
    api.fail(w, second)
    assert api.get(task.id).state == S.TASK_STATE_FAILED


def test_non_retryable_failure_ends_at_once(api):
    task = api.submit(max_attempts=5)
    w = api.register()
    (leased,) = api.lease(w)
    api.fail(w, leased, retryable=False)
    assert api.get(task.id).state == S.TASK_STATE_FAILED


def test_heartbeat_extends_lease_and_expiry_retries(api):
    task = api.submit(max_attempts=2)  # pool 'default' has lease_ttl 2s
    w = api.register()
    (leased,) = api.lease(w)
    for _ in range(4):  # 3 s of heartbeats keeps it beyond its 2 s ttl
        time.sleep(0.75)
        hb = api.workers.Heartbeat(
            wpb.HeartbeatRequest(worker_id=w, tasks=[wpb.TaskAttempt(task_id=task.id, attempt=1)])
        )
        assert list(hb.lost_task_ids) == []
    assert api.get(task.id).state == S.TASK_STATE_RUNNING
    deadline = time.monotonic() + 6
    while api.get(task.id).attempt == 1 and api.get(task.id).state == S.TASK_STATE_RUNNING:
        assert time.monotonic() < deadline, "lease never expired"
        time.sleep(0.1)
    expired = api.get(task.id)
    assert expired.state == S.TASK_STATE_PENDING and expired.error == "lease expired"
    hb = api.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=w, tasks=[wpb.TaskAttempt(task_id=task.id, attempt=1)]))
    assert list(hb.lost_task_ids) == [task.id]
    assert not api.succeed(w, leased).accepted


def test_cancel_pending_blocked_and_running(api):
    pending = api.submit()
    blocked = api.submit(depends_on=[pending.id])
    cancelled = api.tasks.CancelTask(tpb.CancelTaskRequest(task=S.TaskRef(id=pending.id))).task
    assert cancelled.state == S.TASK_STATE_CANCELLED
    assert api.get(blocked.id).state == S.TASK_STATE_CANCELLED

    running = api.submit()
    w = api.register()
    (leased,) = api.lease(w)
    resp = api.tasks.CancelTask(tpb.CancelTaskRequest(task=S.TaskRef(id=running.id))).task
    assert resp.state == S.TASK_STATE_RUNNING and resp.cancel_requested
    hb = api.workers.Heartbeat(
        wpb.HeartbeatRequest(worker_id=w, tasks=[wpb.TaskAttempt(task_id=running.id, attempt=1)])
    )
    assert list(hb.cancelled_task_ids) == [running.id]
    api.finish(w, leased, cancelled=wpb.TaskCancelled(reason="asked to"))
    assert api.get(running.id).state == S.TASK_STATE_CANCELLED


def test_wait_times_out_then_sees_the_end(api):
    task = api.submit()
    started = time.monotonic()
    resp = api.tasks.WaitTask(tpb.WaitTaskRequest(task=S.TaskRef(id=task.id), timeout_ms=300))
    assert not resp.done and 0.25 < time.monotonic() - started < 2
    w = api.register()
    (leased,) = api.lease(w)
    waiting = api.tasks.WaitTask.future(tpb.WaitTaskRequest(task=S.TaskRef(id=task.id), timeout_ms=10_000))
    time.sleep(0.2)
    api.succeed(w, leased, b"answer")
    done = waiting.result(timeout=5)
    assert done.done and done.task.state == S.TASK_STATE_SUCCEEDED and done.task.result == b"answer"


def test_list_pages_in_id_order(api):
    ids = [api.submit().id for _ in range(7)] + [api.submit("other").id]
    seen, token = [], ""
    while True:
        page = api.tasks.ListTasks(tpb.ListTasksRequest(pool="default", page_size=3, page_token=token))
        seen += [t.id for t in page.tasks]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids[:7]
    pending = api.tasks.ListTasks(tpb.ListTasksRequest(state=S.TASK_STATE_PENDING, page_size=100)).tasks
    assert len(pending) == 8


def test_watch_streams_changes(api):
    stream = api.tasks.Watch(tpb.WatchRequest(pool="default"))
    time.sleep(0.2)
    task = api.submit()
    event = next(iter(stream))
    assert event.event.task.id == task.id and event.event.task.state == S.TASK_STATE_PENDING
    stream.cancel()


def test_http_routes_by_key_and_wait(server):
    status, body = server.http("POST", "/v1/tasks", {"pool": "default", "key": "invoice-42", "payload_json": {"n": 1}})
    assert status == 200 and body["deduplicated"] is False
    task_id = body["task"]["id"]
    assert isinstance(task_id, str)
    status, got = server.http("GET", "/v1/keys/invoice-42")
    assert status == 200 and got["task"]["id"] == task_id and got["task"]["payload_json"] == {"n": 1}
    status, waited = server.http("GET", f"/v1/tasks/{task_id}/wait?timeout_ms=100")
    assert status == 200 and waited["done"] is False
    status, cancelled = server.http("POST", "/v1/keys/invoice-42/cancel")
    assert status == 200 and cancelled["task"]["state"] == "TASK_STATE_CANCELLED"
    status, listing = server.http("GET", "/v1/tasks?pool=default&state=cancelled")
    assert status == 200 and [t["id"] for t in listing["tasks"]] == [task_id]
    status, snap = server.http("GET", "/v1/snapshot")
    assert status == 200 and snap["shards"][0]["pools"][0]["cancelled"] == "1"


def test_health_ready_and_metrics(server):
    assert server.http("GET", "/healthz")[0] == 200
    assert server.http("GET", "/readyz")[0] == 200
    import urllib.request

    server.http("POST", "/v1/tasks", {"pool": "default"})

    def scrape() -> str:
        return urllib.request.urlopen(server.http_url + "/metrics").read().decode()

    text = scrape()
    assert 'cronoq_tasks_submitted_total{pool="default"} 1.0' in text
    assert "cronoq_leader 1.0" in text
    # Task gauges are kept by the leader from the events, well under a second behind.
    eventually(lambda: 'cronoq_tasks{pool="default",state="pending"} 1.0' in scrape(), timeout=5, interval=0.1)


def test_sigterm_drains_and_exits_cleanly(server, api):
    w = api.register()
    poll = api.workers.LeaseTasks.future(wpb.LeaseTasksRequest(worker_id=w, max_tasks=1, wait_ms=30_000))
    time.sleep(0.2)
    server.signal(signal.SIGTERM)
    assert list(poll.result(timeout=10).tasks) == []  # the long poll is answered, not dropped
    assert server.proc.wait(15) == 0
    assert "leadership released" in server.log()


def test_sharded_ids_carry_the_shard_number(start_server, tmp_path):
    srv = start_server(
        {
            "pools": [{"name": "a"}, {"name": "b"}],
            "store": {"path": str(tmp_path / "shard-{shard}.db")},
            "shards": [
                {"name": "one", "number": 1, "pools": ["a"], "endpoint": "http://127.0.0.1:1"},
                {"name": "two", "number": 200, "pools": ["b"], "endpoint": "http://127.0.0.1:2"},
            ],
        },
        shard="two",
    )
    task = Api(srv.grpc_target).submit("b")
    assert task.id >> 56 == 200 and task.id & ((1 << 56) - 1) == 1
    status, body = srv.http("GET", f"/v1/tasks/{task.id}")
    assert status == 200 and body["task"]["id"] == str(task.id)


def test_refusals_carry_standard_error_details_and_a_reason(server, api):
    from cronoq.status import decode_details

    with pytest.raises(grpc.RpcError) as err:
        api.get(987654321)
    details = decode_details(err.value.trailing_metadata())
    assert details is not None and details.reason == "NOT_FOUND"
    status, body = server.http("GET", "/v1/tasks/987654321")
    assert status == 404 and body["reason"] == "NOT_FOUND" and body["code"] == "NOT_FOUND"


def test_the_sdk_exposes_the_reason_of_a_refusal(server):
    import cronoq

    with cronoq.SyncClient(server.endpoint) as client, pytest.raises(cronoq.errors.NotFound) as err:
        client.get(987654321)
    assert err.value.reason == "NOT_FOUND" and err.value.retry_delay is None


def test_a_json_result_reads_as_json_over_http_beside_its_base64(server, api):
    worker = api.register()
    status, body = server.http("POST", "/v1/tasks", {"pool": "default", "payload_json": {"n": 2}})
    (task,) = api.lease(worker, 1)
    assert api.finish(
        worker, task, success=wpb.TaskSuccess(result=b'{"doubled": 4}', content_type="application/json")
    ).accepted
    status, got = server.http("GET", f"/v1/tasks/{body['task']['id']}")
    assert status == 200 and got["task"]["result_json"] == {"doubled": 4}
    assert got["task"]["result"] == "eyJkb3VibGVkIjogNH0="  # the bytes, as proto3 JSON has them
