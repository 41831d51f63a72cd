"""Every call this server makes to another shard has a deadline of its own (server.forward_timeout;
a WaitTask: that plus the wait it asks for), so a shard that hangs (SIGSTOP, or a peer that
accepts connections and never answers) costs a caller at most that long, even a caller with no
deadline of its own (HTTP, or gRPC without one): DEADLINE_EXCEEDED (504) or UNAVAILABLE (503)
naming the shard for a forwarded call, the shard named in unavailable_shards for a read that
asks every shard, and a Watch that opens without it.

The deployment of test_sharding (shard cpu owns pool `default`, shard gpu owns `llm`), with
server.forward_timeout = 1s so that the tests stay fast. Timing-sensitive: each call must end
within BOUND_S (a generous margin over the 1 s configured, for a busy machine).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from conftest import ServerProcess, free_port  # type: ignore[import-not-found]
from test_sharding import TOKENS, Stubs, TwoShards, bearer, sharded_config, submit

from cronoq.status import decode_details
from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb

pytestmark = pytest.mark.timeout(120)

FORWARD_TIMEOUT = "1s"
BOUND_S = 6.0  # the configured 1 s, plus a margin for a busy machine (before the fix: 120 s or more)
CLIENT_S = 20.0  # how long the test itself waits for an answer before it calls the server hung
GPU_TASK = (2 << 56) | 1  # an id of shard gpu (number 2)

T = TypeVar("T")


def timed(call: Callable[[], T]) -> tuple[T, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def http_call(srv: ServerProcess, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
    """An HTTP call with no deadline passed to the server; the test gives up after CLIENT_S."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(srv.http_url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {TOKENS['full']}")
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_S) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def watch_headers(srv: ServerProcess) -> dict[str, str]:
    """The response headers of an HTTP Watch (SSE) of every shard: it is open once they came."""
    req = urllib.request.Request(srv.http_url + "/v1/watch", headers={"Authorization": f"Bearer {TOKENS['full']}"})
    with urllib.request.urlopen(req, timeout=CLIENT_S) as r:
        assert r.status == 200
        return {k.lower(): v for k, v in r.headers.items()}


def grpc_refusal(call: Callable[..., Any], request: Any) -> grpc.RpcError:
    """The refusal of a gRPC call made with no deadline (the test gives up after CLIENT_S)."""
    future = call.future(request, metadata=bearer("full"))
    try:
        future.result(timeout=CLIENT_S)
    except grpc.RpcError as err:
        return err
    except grpc.FutureTimeoutError:
        future.cancel()
        pytest.fail(f"no answer within {CLIENT_S}s")
    pytest.fail("the call succeeded")


def assert_names_gpu(status: int, body: dict[str, Any]) -> None:
    assert (status, body["code"]) in ((504, "DEADLINE_EXCEEDED"), (503, "UNAVAILABLE")), body
    assert "'gpu'" in body["message"], body


def assert_forwarding_is_bounded(cpu: ServerProcess) -> None:
    """From cpu, with shard gpu hung: every kind of call that needs gpu ends within BOUND_S."""
    stubs = Stubs(cpu)
    by_id = task_pb2.TaskRef(id=GPU_TASK)
    # Forwarded by task id and by pool, over HTTP (no deadline to pass on).
    for method, path, body in (
        ("GET", f"/v1/tasks/{GPU_TASK}", None),
        ("POST", "/v1/tasks", {"pool": "llm"}),
        ("POST", f"/v1/tasks/{GPU_TASK}/cancel", None),
        ("GET", f"/v1/tasks/{GPU_TASK}/wait?timeout_ms=500", None),
    ):
        (status, _, answer), took = timed(lambda: http_call(cpu, method, path, body))  # noqa: B023 (called at once)
        assert_names_gpu(status, answer)
        assert took < BOUND_S, f"{method} {path}: {took:.1f}s"

    # The same over gRPC, without a client deadline.
    for call, request in (
        (stubs.tasks.GetTask, tpb.GetTaskRequest(task=by_id)),
        (stubs.tasks.SubmitTask, tpb.SubmitTaskRequest(pool="llm")),
        (stubs.tasks.WaitTask, tpb.WaitTaskRequest(task=by_id, timeout_ms=500)),
    ):
        err, took = timed(lambda: grpc_refusal(call, request))  # noqa: B023 (called at once)
        assert err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), err
        assert "'gpu'" in (err.details() or ""), err.details()
        details = decode_details(err.trailing_metadata())
        assert details is not None and details.reason == "SHARD_UNAVAILABLE"
        assert dict(err.trailing_metadata())["cronoq-unavailable-shards"] == "gpu"
        assert took < BOUND_S, f"{request.DESCRIPTOR.name}: {took:.1f}s"

    # A read of every shard answers without gpu, naming it; a key no reachable shard holds
    # names gpu as not asked.
    (status, headers, listing), took = timed(lambda: http_call(cpu, "GET", "/v1/tasks"))
    assert status == 200 and listing["unavailable_shards"] == ["gpu"] and took < BOUND_S, (listing, took)
    (status, headers, snapshot), took = timed(lambda: http_call(cpu, "GET", "/v1/snapshot"))
    assert status == 200 and snapshot["unavailable_shards"] == ["gpu"] and took < BOUND_S, (snapshot, took)
    (status, _, answer), took = timed(lambda: http_call(cpu, "GET", "/v1/keys/nowhere"))
    assert status == 503 and "'gpu'" in answer["message"] and took < BOUND_S, (answer, took)

    # A Watch of every shard opens without gpu.
    headers, took = timed(lambda: watch_headers(cpu))
    assert headers.get("cronoq-unavailable-shards") == "gpu" and took < BOUND_S, (headers, took)


@pytest.fixture(params=["sqlite", "postgres"])
def shards(request: pytest.FixtureRequest, tmp_path: Path, start_server: Any) -> TwoShards:
    return TwoShards.on_store_of(request, tmp_path, start_server, forward_timeout=FORWARD_TIMEOUT)


def test_a_forwarded_wait_gets_its_own_wait_on_top_of_the_forward_timeout(shards: TwoShards) -> None:
    """A WaitTask longer than server.forward_timeout is not cut short by it."""
    llm = submit(shards.stubs["cpu"], "llm").task
    stubs = shards.stubs["cpu"]
    waited, took = timed(
        lambda: stubs.tasks.WaitTask(
            tpb.WaitTaskRequest(task=task_pb2.TaskRef(id=llm.id), timeout_ms=2500), metadata=bearer("full")
        )
    )
    assert waited.task.id == llm.id and not waited.done and took >= 2.4
    status, _, body = http_call(shards.cpu, "GET", f"/v1/tasks/{llm.id}/wait?timeout_ms=2500")
    assert status == 200 and body["done"] is False


def test_calls_to_a_stopped_shard_end_within_the_forward_timeout(shards: TwoShards) -> None:
    shards.gpu.signal(signal.SIGSTOP)
    try:
        assert_forwarding_is_bounded(shards.cpu)
    finally:
        shards.gpu.signal(signal.SIGCONT)
    # gpu answers again once it runs.
    assert submit(shards.stubs["cpu"], "llm").task.id >> 56 == 2


@pytest.fixture
def silent_peer() -> Iterator[str]:
    """A TCP listener on loopback that accepts every connection and never sends a byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        for conn in held:
            conn.close()


def test_calls_to_a_peer_that_never_answers_end_within_the_forward_timeout(
    tmp_path: Path, start_server: Any, silent_peer: str
) -> None:
    cpu_listen = f"127.0.0.1:{free_port()}"
    config = sharded_config(tmp_path, cpu_listen, f"http://{silent_peer}", forward_timeout=FORWARD_TIMEOUT)
    cpu = start_server({**config, "server": {**config["server"], "listen": cpu_listen}}, shard="cpu", name="cpu")
    assert_forwarding_is_bounded(cpu)
