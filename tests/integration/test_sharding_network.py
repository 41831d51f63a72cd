"""Sharding on the wire: what a shard sends to a peer on another host, and where workers of
another shard's pools are sent.

The first test runs a listener in a network namespace (a veth pair: a non-loopback address
only this machine reaches) as shard gpu's endpoint, and shows that a server that refuses to
send a token over plain http:// to it sends not one byte there, while one with
server.insecure_peer_http does connect (so the listener would have seen it). It needs root and
iproute2: in CI (CI=true) their absence fails the test; elsewhere it is skipped.

Workers are not forwarded: a worker for another shard's pool is refused with that shard's
endpoint, and the SDK worker follows up to three such redirects in a row.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import eventually, log_lines, start_worker
from conftest import free_port  # type: ignore[import-not-found]
from netns import NetNs, open_for_test  # type: ignore[import-not-found]
from test_sharding import TIMEOUT, Stubs, TwoShards, bearer, http, metric, refusal, sharded_config, submit, trailers

import cronoq
from cronoq.errors import TooManyRedirects
from cronoq.status import decode_details
from cronoq.v1 import schedule_service_pb2 as spb
from cronoq.v1 import task_pb2, worker_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

pytestmark = pytest.mark.timeout(60)

SUCCEEDED = task_pb2.TASK_STATE_SUCCEEDED
PEER_PORT = 7070  # inside the namespace: nothing else listens there


@pytest.fixture
def netns() -> Iterator[NetNs]:
    ns = open_for_test()
    try:
        yield ns
    finally:
        ns.close()


def test_plain_http_to_a_non_loopback_peer_sends_not_one_byte(netns: NetNs, tmp_path: Path, start_server: Any) -> None:
    listener = netns.listen(PEER_PORT, tmp_path / "listener.log")
    gpu_endpoint = f"http://{netns.peer_ip}:{PEER_PORT}"
    listen = f"127.0.0.1:{free_port()}"
    config = sharded_config(tmp_path, listen, gpu_endpoint)
    srv = start_server({**config, "server": {"listen": listen}}, "cpu", "cpu")
    cpu = Stubs(srv)
    gpu_id = (2 << 56) | 1
    schedule = spb.Schedule(pool="llm", name="nightly", cron="0 3 * * *")
    calls = {
        "SubmitTask": lambda: submit(cpu, "llm", payload=b"secret"),
        "SubmitBatch": lambda: cpu.tasks.SubmitBatch(
            tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="llm")]), metadata=bearer("full"), timeout=TIMEOUT
        ),
        "GetTask": lambda: cpu.tasks.GetTask(
            tpb.GetTaskRequest(task=task_pb2.TaskRef(id=gpu_id)), metadata=bearer("full"), timeout=TIMEOUT
        ),
        "PutSchedule": lambda: cpu.schedules.PutSchedule(
            spb.PutScheduleRequest(schedule=schedule), metadata=bearer("full"), timeout=TIMEOUT
        ),
    }
    for name, call in calls.items():
        started = time.monotonic()
        err = refusal(call)
        assert time.monotonic() - started < 1.0, name
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (name, err)  # type: ignore[attr-defined]
        assert trailers(err)["cronoq-shard"] == "gpu" and trailers(err)["cronoq-shard-endpoint"] == gpu_endpoint
        assert "insecure_peer_http" in err.details() and gpu_endpoint in err.details(), name  # type: ignore[attr-defined]
        details = decode_details(err.trailing_metadata())  # type: ignore[attr-defined]
        assert details is not None and details.reason == "NOT_FORWARDED", name
    for method, path, body in (("POST", "/v1/tasks", {"pool": "llm"}), ("GET", f"/v1/tasks/{gpu_id}", None)):
        status, headers, answer = http(srv, method, path, body)
        assert status == 409 and answer["shard"] == "gpu" and answer["shard_endpoint"] == gpu_endpoint, answer
        assert headers["cronoq-shard"] == "gpu" and headers["cronoq-shard-endpoint"] == gpu_endpoint
    assert submit(cpu, "default").task.id >> 56 == 1  # its own pools are served
    time.sleep(0.5)  # a connection made in the background would be recorded by now
    assert listener.lines() == ["ready"], listener.lines()  # no connection, not one byte
    assert listener.connections() == 0 and listener.bytes_received() == 0
    assert metric(srv, "cronoq_forwarded_calls_total", shard="gpu", code="OK") == 0

    # The control: with insecure_peer_http the same call goes there (the listener never answers).
    listen = f"127.0.0.1:{free_port()}"
    (tmp_path / "insecure").mkdir()
    config = sharded_config(tmp_path / "insecure", listen, gpu_endpoint)  # a store of its own
    insecure = Stubs(start_server({**config, "server": {"listen": listen, "insecure_peer_http": True}}, "cpu", "cpu2"))
    err = refusal(
        lambda: insecure.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="llm"), metadata=bearer("full"), timeout=1.5)
    )
    assert err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), err  # type: ignore[attr-defined]
    eventually(lambda: listener.bytes_received() > 0, timeout=5, what="bytes at the listener")
    assert listener.connections() >= 1
    assert f"accept 1 {netns.host_ip}" in listener.lines()
    assert listener.first_bytes().startswith(b"PRI * HTTP/2.0"), listener.first_bytes()


# -- workers of another shard's pools -----------------------------------------------------


def tokenless(config: dict[str, Any]) -> dict[str, Any]:
    """A config without [[tokens]] (all on loopback), for worker_proc and the SDK without a token."""
    return {k: v for k, v in config.items() if k != "tokens"}


def test_register_worker_for_another_shards_pool_is_refused_with_its_endpoint(
    tmp_path: Path, start_server: Any
) -> None:
    shards = TwoShards(tmp_path, start_server)
    endpoints = {s["name"]: s["endpoint"] for s in shards.config["shards"]}
    for via, pool, owner in (("cpu", "llm", "gpu"), ("gpu", "default", "cpu")):
        workers = worker_service_pb2_grpc.WorkerServiceStub(shards.stubs[via].channel)
        request = wpb.RegisterWorkerRequest(name="w", pools=[pool], concurrency=1)
        err = refusal(lambda workers=workers, request=request: workers.RegisterWorker(request, metadata=bearer("full")))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err  # type: ignore[attr-defined]
        assert trailers(err)["cronoq-shard"] == owner and trailers(err)["cronoq-shard-endpoint"] == endpoints[owner]
        details = decode_details(err.trailing_metadata())  # type: ignore[attr-defined]
        assert details is not None and details.reason == "WRONG_SHARD"
        # Credentials first: a caller without `work` on the pool learns nothing of its shard.
        err = refusal(
            lambda workers=workers, request=request: workers.RegisterWorker(request, metadata=bearer("default-only"))
        )
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "cronoq-shard" not in trailers(err)  # type: ignore[attr-defined]


def test_a_worker_for_llm_connected_to_cpu_ends_up_on_gpu_and_runs_each_task_once(
    tmp_path: Path, start_server: Any
) -> None:
    cpu_listen, gpu_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = tokenless(sharded_config(tmp_path, cpu_listen, f"http://{gpu_listen}"))
    cpu = start_server({**config, "server": {"listen": cpu_listen}}, "cpu", "cpu")
    gpu = start_server({**config, "server": {"listen": gpu_listen}}, "gpu", "gpu")
    logfile = tmp_path / "worker.log"
    worker = start_worker(cpu.endpoint, "llm", logfile, concurrency=4)
    try:
        with cronoq.SyncClient(cpu.endpoint) as client:
            ids = [client.submit("llm", {"n": n}).task.id for n in range(20)]

            def all_done() -> bool:
                assert worker.poll() is None, Path(str(logfile) + ".stderr").read_text()[-2000:]
                return len(log_lines(logfile, "done")) >= len(ids)

            eventually(all_done, timeout=20, what="the worker ran every task")
            results = [client.wait(i, timeout=10) for i in ids]
        listed = worker_service_pb2_grpc.WorkerServiceStub(Stubs(gpu).channel).ListWorkers(
            wpb.ListWorkersRequest(), timeout=TIMEOUT
        )
        assert [list(w.pools) for w in listed.workers] == [["llm"]]  # registered with gpu
    finally:
        worker.terminate()
        worker.wait(30)
    assert all(r.done and r.task.state == SUCCEEDED for r in results), results
    dones = collections.Counter(t for t, _, _ in log_lines(logfile, "done"))
    starts = collections.Counter(t for t, _, _ in log_lines(logfile, "start"))
    assert all(dones[i] == 1 and starts[i] == 1 for i in ids), (dones, starts)


def test_a_redirect_loop_stops_after_three_redirects_naming_the_chain(tmp_path: Path, start_server: Any) -> None:
    """Two servers whose [[shards]] disagree: A (shard cpu) has llm in gpu at B's address, B
    (shard gpu) has llm in cpu at A's. A worker for llm bounces between them."""
    a_listen, b_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    a_config = tokenless(sharded_config(tmp_path / "a", a_listen, f"http://{b_listen}"))
    b_config = tokenless(sharded_config(tmp_path / "b", a_listen, f"http://{b_listen}"))
    b_config["shards"] = [
        {**b_config["shards"][0], "pools": ["llm"]},
        {**b_config["shards"][1], "pools": ["default"]},
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = start_server({**a_config, "server": {"listen": a_listen}}, "cpu", "a")
    b = start_server({**b_config, "server": {"listen": b_listen}}, "gpu", "b")

    async def handle(task: cronoq.TaskContext) -> None:
        raise AssertionError("no task is leased")

    async def run() -> TooManyRedirects:
        worker = cronoq.Worker(a.endpoint, "llm", handle)
        with pytest.raises(TooManyRedirects) as err:
            await asyncio.wait_for(worker.run(), 15)
        return err.value

    started = time.monotonic()
    err = asyncio.run(run())
    assert time.monotonic() - started < 5.0
    chain = f"{a.endpoint} -> shard gpu at {b.endpoint} -> shard cpu at {a.endpoint} -> shard gpu at {b.endpoint} -> shard cpu at {a.endpoint}"
    assert "more than 3 times" in str(err) and chain in str(err), str(err)
    for srv in (a, b):  # every registration refused: no worker anywhere
        workers = worker_service_pb2_grpc.WorkerServiceStub(Stubs(srv).channel)
        assert list(workers.ListWorkers(wpb.ListWorkersRequest(), timeout=TIMEOUT).workers) == []


async def test_the_sdk_worker_stops_after_three_redirects_naming_the_chain() -> None:
    """The worker's half of the loop above, checked today: two in-process gRPC servers that
    refuse every RegisterWorker with the other's endpoint (as the router will)."""
    servers = [grpc.aio.server(), grpc.aio.server()]
    endpoints = [f"http://127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}" for srv in servers]
    calls = [0, 0]

    def refuse(me: int, shard: str) -> grpc.GenericRpcHandler:
        async def register(request: wpb.RegisterWorkerRequest, context: grpc.aio.ServicerContext) -> None:
            calls[me] += 1
            other = endpoints[1 - me]
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"served by shard {shard!r} at {other}",
                trailing_metadata=(("cronoq-shard", shard), ("cronoq-shard-endpoint", other)),
            )

        handler = grpc.unary_unary_rpc_method_handler(
            register,
            request_deserializer=wpb.RegisterWorkerRequest.FromString,
            response_serializer=wpb.RegisterWorkerResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler("cronoq.v1.WorkerService", {"RegisterWorker": handler})

    servers[0].add_generic_rpc_handlers((refuse(0, "gpu"),))
    servers[1].add_generic_rpc_handlers((refuse(1, "cpu"),))
    for srv in servers:
        await srv.start()
    try:

        async def handle(task: cronoq.TaskContext) -> None:
            raise AssertionError("no task is leased")

        worker = cronoq.Worker(endpoints[0], "llm", handle)
        started = asyncio.get_running_loop().time()
        with pytest.raises(TooManyRedirects) as err:
            await asyncio.wait_for(worker.run(), 10)
        assert asyncio.get_running_loop().time() - started < 5.0
    finally:
        for srv in servers:
            await srv.stop(None)
    a, b = endpoints
    chain = f"{a} -> shard gpu at {b} -> shard cpu at {a} -> shard gpu at {b} -> shard cpu at {a}"
    assert "more than 3 times" in str(err.value) and chain in str(err.value), str(err.value)
    assert calls == [2, 2]
