"""What a hostile or careless caller, a slow reader and a shutdown can do to a real server:
size caps, result caps, idempotent submissions, stalled watchers, and the drain."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, eventually

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

RUNNING = task_pb2.TASK_STATE_RUNNING
PENDING = task_pb2.TASK_STATE_PENDING
FAILED = task_pb2.TASK_STATE_FAILED


def refused(call: Any, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    for fragment in fragments:
        assert fragment in err.value.details(), err.value.details()
    return err.value.details()


def count_tasks(api: Api) -> int:
    return len(api.tasks.ListTasks(tpb.ListTasksRequest(page_size=1000)).tasks)


# -- size caps on every string a caller controls --------------------------------------


def test_strings_a_caller_controls_are_capped_and_control_characters_refused(server):
    api = Api(server.grpc_target)
    big = "x" * 200_000  # within the bytes a request may hold: the field's own cap refuses it
    submit = api.tasks.SubmitTask
    refused(lambda: submit(tpb.SubmitTaskRequest(pool="default", content_type=big)), grpc.StatusCode.INVALID_ARGUMENT,
            "content_type: 200000 characters, more than 256")  # fmt: skip
    refused(lambda: submit(tpb.SubmitTaskRequest(pool="default", key="k" * 257)), grpc.StatusCode.INVALID_ARGUMENT,
            "key: 257 characters")  # fmt: skip
    refused(lambda: submit(tpb.SubmitTaskRequest(pool="default", key="a\nb")), grpc.StatusCode.INVALID_ARGUMENT,
            "key: control character")  # fmt: skip
    register = api.workers.RegisterWorker
    for request, fragment in (
        (wpb.RegisterWorkerRequest(name=big, pools=["default"]), "name: 200000 characters, more than 256"),
        (wpb.RegisterWorkerRequest(name="w\n2026 INFO forged", pools=["default"]), "name: control character"),
        (wpb.RegisterWorkerRequest(name="w", pools=["default"], labels={"k": big}), "labels['k']: 200000"),
        (wpb.RegisterWorkerRequest(name="w", pools=["default"], labels={"k\r": "v"}), "labels key: control"),
        (
            wpb.RegisterWorkerRequest(name="w", pools=["default"], labels={str(i): "v" for i in range(65)}),
            "labels: 65 labels, more than 64",
        ),
    ):
        refused(lambda r=request: register(r), grpc.StatusCode.INVALID_ARGUMENT, fragment)
    # Larger than a request of its method may be: refused before it is parsed, naming the limit.
    refused(lambda: submit(tpb.SubmitTaskRequest(pool="default", content_type="x" * (10 << 20))),
            grpc.StatusCode.RESOURCE_EXHAUSTED, "more than the 266240 bytes this server reads for SubmitTask")  # fmt: skip
    assert count_tasks(api) == 0
    assert "forged" not in server.log() and len(server.log()) < 1 << 20


def test_error_texts_are_truncated_with_a_marker_and_results_over_the_cap_fail(start_server):
    srv = start_server({"limits": {"max_result_bytes": 1000}})
    api = Api(srv.grpc_target)
    worker = api.register()
    first, second = api.submit(), api.submit()
    (t1,) = api.lease(worker, 1)
    result = api.finish(worker, t1, failure=wpb.TaskFailure(error="E" * (1 << 20), retryable=False))
    assert result.accepted
    error = api.get(t1.id).error
    assert len(error.encode()) <= 16 << 10 and error.endswith("bytes]") and "[truncated " in error
    (t2,) = api.lease(worker, 1)
    assert api.succeed(worker, t2, result=b"r" * 1001).accepted
    ended = api.get(second.id)
    assert ended.state == FAILED and ended.result == b""
    assert ended.error == "result of 1001 bytes exceeds max_result_bytes 1000"
    assert ended.attempt == 1 and first.id != second.id


# -- idempotent submissions --------------------------------------------------------------


def test_a_repeated_request_id_returns_the_first_calls_tasks_and_creates_nothing(server):
    api = Api(server.grpc_target)
    req = tpb.SubmitTaskRequest(pool="default", payload=b"once", request_id="r-1")
    first = api.tasks.SubmitTask(req).task
    assert api.tasks.SubmitTask(req).task.id == first.id
    batch = tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default")] * 3, request_id="r-2")
    ids = [t.id for t in api.tasks.SubmitBatch(batch).tasks]
    assert [t.id for t in api.tasks.SubmitBatch(batch).tasks] == ids
    status, body = server.http("POST", "/v1/tasks", {"pool": "default", "request_id": "r-3"})
    assert status == 200
    assert (
        server.http("POST", "/v1/tasks", {"pool": "default", "request_id": "r-3"})[1]["task"]["id"]
        == (body["task"]["id"])
    )
    assert count_tasks(api) == 5


# -- slow watchers ---------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_two_watchers_that_never_read_keep_the_server_within_100_mb(start_server):
    srv = start_server({"limits": {"max_payload_bytes": 256 << 10, "max_batch_size": 100}})
    api = Api(srv.grpc_target)
    api.submit()  # warm up every path once before measuring
    before = rss_bytes(srv.proc.pid)
    # An SSE watcher asking for payloads and a gRPC watcher: neither ever reads.
    sse = socket.create_connection(("127.0.0.1", srv.http_port))
    sse.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sse.sendall(b"GET /v1/watch?include_payloads=true HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    stalled = api.tasks.Watch(tpb.WatchRequest(include_payloads=True))
    time.sleep(0.3)
    payload = b"p" * (195 << 10)
    for _ in range(200):  # 3,000 tasks of 195 KB, in batches under the 4 MiB reply limit
        api.tasks.SubmitBatch(
            tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default", payload=payload)] * 15)
        )
    grown = rss_bytes(srv.proc.pid) - before
    print(f"\nRSS grew {grown / 2**20:.0f} MB over 3,000 submissions of 195 KB with 2 stalled watchers")
    assert grown < 100 << 20
    stalled.cancel()
    sse.close()
    # The server still serves, and a fresh watcher gets events.
    fresh = api.tasks.Watch(tpb.WatchRequest())
    api.submit()
    assert next(iter(fresh)).event.task.pool == "default"
    fresh.cancel()


def test_a_watcher_that_falls_behind_is_ended_with_a_clear_last_message(start_server):
    srv = start_server({"limits": {"max_payload_bytes": 1 << 20, "max_batch_size": 100}})
    api = Api(srv.grpc_target)
    stalled = api.tasks.Watch(tpb.WatchRequest(include_payloads=True))
    payload = b"p" * (1 << 20)
    for _ in range(40):  # 40 MiB of events with payloads, over the 8 MiB a stream may hold
        api.tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default", payload=payload)]))
    with pytest.raises(grpc.RpcError) as err:
        for _ in stalled:
            pass
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "watch fell behind" in err.value.details() and "reconnect" in err.value.details()


# -- the drain -------------------------------------------------------------------------


def _http_wait(url: str, out: dict[str, Any]) -> None:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            out["status"], out["body"] = r.status, json.loads(r.read())
    except Exception as err:  # surfaced by the test
        out["error"] = err
    out["took"] = time.monotonic() - started


def test_sigterm_answers_open_waits_at_once_and_a_standby_leads_within_2s(start_server, tmp_path):
    config = {"store": {"path": str(tmp_path / "shared.db")}}
    leader = start_server(config, name="leader")
    standby = start_server(config, name="standby", wait_ready=False)
    standby.wait_ready(leader=False)
    api = Api(leader.grpc_target)
    task = api.submit()
    waits = [dict[str, Any]() for _ in range(2)]
    threads = [
        threading.Thread(target=_http_wait, args=(f"{leader.http_url}/v1/tasks/{task.id}/wait?timeout_ms={ms}", out))
        for ms, out in zip((90_000, 400_000), waits, strict=True)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    stopped_at = time.monotonic()
    leader.signal(signal.SIGTERM)
    for t in threads:
        t.join(15)
    for out in waits:
        assert out.get("status") == 200, out
        assert out["body"]["done"] is False and out["body"]["task"]["state"] == "TASK_STATE_PENDING"
        assert out["took"] < 5, out
    assert leader.proc.wait(12) == 0
    eventually(lambda: standby.http("GET", "/readyz")[0] == 200, timeout=15, interval=0.02, what="standby leads")
    took = time.monotonic() - stopped_at
    print(f"\nstandby leads {took:.2f}s after SIGTERM")
    assert took < 2.0 + 1.0  # the drain's own second, then the 2 s a standby may take
