"""Sharding, first slice: forwarding by pool and by task id between two real shards on SQLite.

The deployment of the sharding page: shard `cpu` (number 1) owns pool `default`, shard `gpu`
(number 2) owns pool `llm`; each shard has its own SQLite file (store.path with {shard}) and
each server is started with --shard. Every server reads the same [[shards]] and [[tokens]].

A call that a client marks cronoq-forwarded itself is answered by the receiving shard only: for
another shard's pool or task id it gets FAILED_PRECONDITION naming that shard and its endpoint
(cronoq-shard, cronoq-shard-endpoint; reason WRONG_SHARD), after its credentials and its
permission on the pool were checked, and is never forwarded.
"""

from __future__ import annotations

import hashlib
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import ServerProcess, free_port  # type: ignore[import-not-found]

from cronoq.status import decode_details
from cronoq.v1 import schedule_service_pb2 as spb
from cronoq.v1 import schedule_service_pb2_grpc, task_pb2, task_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb

pytestmark = pytest.mark.timeout(120)

TOKENS = {"full": "full-token", "default-only": "default-only-token"}
TIMEOUT = 10.0


def bearer(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[name]}")]


def sharded_config(
    tmp_path: Path, cpu_listen: str, gpu_endpoint: str, *, cpu_endpoint: str | None = None, **server: Any
) -> dict[str, Any]:
    return {
        "server": server,
        "pools": [{"name": "default"}, {"name": "llm"}],
        "shards": [
            {"name": "cpu", "number": 1, "pools": ["default"], "endpoint": cpu_endpoint or f"http://{cpu_listen}"},
            {"name": "gpu", "number": 2, "pools": ["llm"], "endpoint": gpu_endpoint},
        ],
        "store": {"path": str(tmp_path / "cronoq-{shard}.db")},
        "tokens": [
            {
                "name": "full",
                "sha256": hashlib.sha256(TOKENS["full"].encode()).hexdigest(),
                "pools": ["*"],
                "permissions": ["submit", "read", "cancel", "work", "schedule", "admin"],
            },
            {
                "name": "default-only",
                "sha256": hashlib.sha256(TOKENS["default-only"].encode()).hexdigest(),
                "pools": ["default"],
                "permissions": ["submit", "read", "cancel"],
            },
        ],
    }


class Stubs:
    def __init__(self, srv: ServerProcess):
        self.channel = grpc.insecure_channel(srv.grpc_target)
        self.tasks = task_service_pb2_grpc.TaskServiceStub(self.channel)
        self.schedules = schedule_service_pb2_grpc.ScheduleServiceStub(self.channel)


class TwoShards:
    """cpu and gpu, one server each, both on loopback."""

    def __init__(self, tmp_path: Path, start_server: Any, **server: Any):
        cpu_listen, gpu_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.config = sharded_config(tmp_path, cpu_listen, f"http://{gpu_listen}", **server)
        self.cpu = start_server({**self.config, "server": {**server, "listen": cpu_listen}}, shard="cpu", name="cpu")
        self.gpu = start_server({**self.config, "server": {**server, "listen": gpu_listen}}, shard="gpu", name="gpu")
        self.stubs = {"cpu": Stubs(self.cpu), "gpu": Stubs(self.gpu)}


@pytest.fixture
def shards(tmp_path: Path, start_server: Any) -> TwoShards:
    return TwoShards(tmp_path, start_server)


def submit(stubs: Stubs, pool: str, token: str = "full", forwarded: bool = False, **kw: Any) -> tpb.SubmitTaskResponse:
    md = bearer(token) + ([("cronoq-forwarded", "1")] if forwarded else [])
    return stubs.tasks.SubmitTask(tpb.SubmitTaskRequest(pool=pool, **kw), metadata=md, timeout=TIMEOUT)


def refusal(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def trailers(err: grpc.RpcError) -> dict[str, Any]:
    return dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]


def metric(srv: ServerProcess, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 when absent); servers here have no metrics_public,
    so the full token is sent."""
    req = urllib.request.Request(srv.http_url + "/metrics", headers={"Authorization": f"Bearer {TOKENS['full']}"})
    text = urllib.request.urlopen(req, timeout=5).read().decode()
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == labels:
            return float(m.group(2))
    return 0.0


def http(srv: ServerProcess, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any, Any]:
    import json
    import urllib.error

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(srv.http_url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {TOKENS['full']}")
    for k, v in headers.items():
        req.add_header(k.replace("_", "-"), v)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


def test_calls_for_another_shard_are_forwarded_and_ids_name_their_shard(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    llm = submit(cpu, "llm", payload=b"x").task
    assert llm.id >> 56 == 2 and llm.pool == "llm"
    dflt = submit(gpu, "default").task
    assert dflt.id >> 56 == 1

    for stubs in (cpu, gpu):
        for task in (llm, dflt):
            got = stubs.tasks.GetTask(
                tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=bearer("full"), timeout=TIMEOUT
            ).task
            assert (got.id, got.pool, got.state) == (task.id, task.pool, task_pb2.TASK_STATE_PENDING)
    waited = cpu.tasks.WaitTask(
        tpb.WaitTaskRequest(task=task_pb2.TaskRef(id=llm.id), timeout_ms=100), metadata=bearer("full"), timeout=TIMEOUT
    )
    assert waited.task.id == llm.id and not waited.done
    cancelled = cpu.tasks.CancelTask(
        tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=llm.id)), metadata=bearer("full"), timeout=TIMEOUT
    ).task
    assert cancelled.state == task_pb2.TASK_STATE_CANCELLED
    got = gpu.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=llm.id)), metadata=bearer("full")).task
    assert got.state == task_pb2.TASK_STATE_CANCELLED

    # A batch for one shard's pools goes there whole.
    batch = cpu.tasks.SubmitBatch(
        tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="llm"), tpb.SubmitTaskRequest(pool="llm")]),
        metadata=bearer("full"),
        timeout=TIMEOUT,
    )
    assert [t.id >> 56 for t in batch.tasks] == [2, 2]

    # Schedules for another shard's pool are kept by that shard.
    schedule = spb.Schedule(pool="llm", name="nightly", cron="0 3 * * *")
    cpu.schedules.PutSchedule(spb.PutScheduleRequest(schedule=schedule), metadata=bearer("full"), timeout=TIMEOUT)
    listed = gpu.schedules.ListSchedules(spb.ListSchedulesRequest(), metadata=bearer("full"), timeout=TIMEOUT)
    assert [(s.pool, s.name) for s in listed.schedules] == [("llm", "nightly")]
    cpu.schedules.DeleteSchedule(
        spb.DeleteScheduleRequest(pool="llm", name="nightly"), metadata=bearer("full"), timeout=TIMEOUT
    )
    listed = gpu.schedules.ListSchedules(spb.ListSchedulesRequest(), metadata=bearer("full"), timeout=TIMEOUT)
    assert list(listed.schedules) == []

    # The same over HTTP.
    status, _, body = http(shards.cpu, "POST", "/v1/tasks", {"pool": "llm", "payload_json": {"n": 1}})
    assert status == 200 and int(body["task"]["id"]) >> 56 == 2, body
    status, _, body = http(shards.cpu, "GET", f"/v1/tasks/{body['task']['id']}")
    assert status == 200 and body["task"]["pool"] == "llm" and body["task"]["payload_json"] == {"n": 1}

    assert metric(shards.cpu, "cronoq_forwarded_calls_total", shard="gpu", code="OK") >= 9
    assert metric(shards.gpu, "cronoq_forwarded_calls_total", shard="cpu", code="OK") >= 1


def test_a_batch_across_shards_is_refused(shards: TwoShards) -> None:
    batch = tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default"), tpb.SubmitTaskRequest(pool="llm")])
    for stubs in shards.stubs.values():
        err = refusal(lambda stubs=stubs: stubs.tasks.SubmitBatch(batch, metadata=bearer("full"), timeout=TIMEOUT))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "'cpu'" in err.details() and "'gpu'" in err.details(), err.details()  # type: ignore[attr-defined]
    # A caller that may not use one of the pools learns nothing about where they are served.
    err = refusal(lambda: shards.stubs["cpu"].tasks.SubmitBatch(batch, metadata=bearer("default-only")))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert "gpu" not in err.details()  # type: ignore[attr-defined]


def test_forwarding_reauthorizes_and_answers_as_a_direct_call(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    direct = refusal(lambda: submit(gpu, "llm", token="default-only"))
    forwarded = refusal(lambda: submit(cpu, "llm", token="default-only"))
    for err in (direct, forwarded):
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert forwarded.details() == direct.details()  # type: ignore[attr-defined]
    assert trailers(forwarded) == trailers(direct)
    assert decode_details(forwarded.trailing_metadata()) == decode_details(direct.trailing_metadata())  # type: ignore[attr-defined]
    # Refused by the gpu server: the forwarder passed it on, and gpu refused it twice.
    assert metric(shards.gpu, "cronoq_api_calls_total", method="SubmitTask", code="PERMISSION_DENIED") == 2
    assert metric(shards.cpu, "cronoq_api_calls_total", method="SubmitTask", code="PERMISSION_DENIED") == 0
    assert metric(shards.cpu, "cronoq_forwarded_calls_total", shard="gpu", code="PERMISSION_DENIED") == 1

    # Bad credentials are refused where they arrive, and never forwarded.
    err = refusal(
        lambda: cpu.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="llm"), metadata=[("authorization", "Bearer nope")])
    )
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert metric(shards.cpu, "cronoq_forwarded_calls_total", shard="gpu", code="UNAUTHENTICATED") == 0

    # A task of a pool the caller may not read is a missing task, through either server.
    task = submit(gpu, "llm").task
    for stubs in (cpu, gpu):
        err = refusal(
            lambda stubs=stubs: stubs.tasks.GetTask(
                tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=bearer("default-only")
            )
        )
        assert err.code() == grpc.StatusCode.NOT_FOUND, err  # type: ignore[attr-defined]


def test_a_call_marked_forwarded_is_answered_by_the_receiving_shard_only(shards: TwoShards) -> None:
    cpu = shards.stubs["cpu"]
    gpu_endpoint = shards.config["shards"][1]["endpoint"]
    assert submit(cpu, "default", forwarded=True).task.id >> 56 == 1  # its own shard: answered

    err = refusal(lambda: submit(cpu, "llm", forwarded=True))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert trailers(err)["cronoq-shard"] == "gpu" and trailers(err)["cronoq-shard-endpoint"] == gpu_endpoint
    assert "gpu" in err.details() and gpu_endpoint in err.details()  # type: ignore[attr-defined]
    details = decode_details(err.trailing_metadata())  # type: ignore[attr-defined]
    assert details is not None and details.reason == "WRONG_SHARD"

    task = submit(shards.stubs["gpu"], "llm").task
    err = refusal(
        lambda: cpu.tasks.GetTask(
            tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)),
            metadata=[*bearer("full"), ("cronoq-forwarded", "1")],
        )
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and trailers(err)["cronoq-shard"] == "gpu"  # type: ignore[attr-defined]

    # Credentials first: a caller that may not use the pool learns nothing of its shard.
    err = refusal(lambda: submit(cpu, "llm", token="default-only", forwarded=True))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "cronoq-shard" not in trailers(err)  # type: ignore[attr-defined]

    # Over HTTP: 409 with the shard and its endpoint, in the body and the headers.
    status, headers, body = http(shards.cpu, "POST", "/v1/tasks", {"pool": "llm"}, cronoq_forwarded="1")
    assert status == 409 and body["shard"] == "gpu" and body["shard_endpoint"] == gpu_endpoint, body
    assert headers["cronoq-shard"] == "gpu" and headers["cronoq-shard-endpoint"] == gpu_endpoint
    assert metric(shards.cpu, "cronoq_forwarded_calls_total", shard="gpu", code="OK") == 0


def test_a_shard_that_is_down_is_unavailable_by_name_quickly(shards: TwoShards) -> None:
    cpu = shards.stubs["cpu"]
    task = submit(cpu, "llm").task
    shards.gpu.kill()
    for _ in range(3):
        started = time.monotonic()
        err = refusal(lambda: submit(cpu, "llm"))
        assert time.monotonic() - started < 2.0
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err  # type: ignore[attr-defined]
        assert "'gpu'" in err.details() and trailers(err)["cronoq-unavailable-shards"] == "gpu"  # type: ignore[attr-defined]
    err = refusal(
        lambda: cpu.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=bearer("full"))
    )
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "'gpu'" in err.details()  # type: ignore[attr-defined]
    # A caller without rights on llm learns nothing about where it is served, even now.
    err = refusal(lambda: submit(cpu, "llm", token="default-only"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "gpu" not in err.details()  # type: ignore[attr-defined]
    # The live shard keeps serving its own pools.
    assert submit(cpu, "default").task.id >> 56 == 1
    status, _, body = http(shards.cpu, "POST", "/v1/tasks", {"pool": "llm"})
    assert status == 503 and "'gpu'" in body["message"], body
    assert metric(shards.cpu, "cronoq_forwarded_calls_total", shard="gpu", code="UNAVAILABLE") >= 4


def test_plain_http_to_another_host_is_refused_with_the_endpoint(tmp_path: Path, start_server: Any) -> None:
    """gpu's endpoint is http:// on a TEST-NET address: nothing is sent there (no shard runs)."""
    listen = f"127.0.0.1:{free_port()}"
    gpu_endpoint = "http://192.0.2.10:7070"
    cpu = Stubs(start_server({**sharded_config(tmp_path, listen, gpu_endpoint), "server": {"listen": listen}}, "cpu"))
    started = time.monotonic()
    err = refusal(lambda: submit(cpu, "llm"))
    assert time.monotonic() - started < 1.0
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert trailers(err)["cronoq-shard"] == "gpu" and trailers(err)["cronoq-shard-endpoint"] == gpu_endpoint
    assert "insecure_peer_http" in err.details()  # type: ignore[attr-defined]
    err = refusal(lambda: submit(cpu, "llm", token="default-only"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]


def test_insecure_peer_http_sends_it_with_the_callers_deadline(tmp_path: Path, start_server: Any) -> None:
    listen = f"127.0.0.1:{free_port()}"
    config = sharded_config(tmp_path, listen, "http://192.0.2.10:7070")
    cpu = Stubs(start_server({**config, "server": {"listen": listen, "insecure_peer_http": True}}, "cpu"))
    started = time.monotonic()
    err = refusal(lambda: cpu.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="llm"), metadata=bearer("full"), timeout=1.0))
    assert err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)  # type: ignore[attr-defined]
    assert time.monotonic() - started < 3.0


def test_a_standby_endpoint_is_followed_to_its_leader(tmp_path: Path, start_server: Any) -> None:
    """gpu's endpoint is its standby: the forwarder follows the standby's cronoq-leader once."""
    cpu_listen, leader_listen, standby_listen = (f"127.0.0.1:{free_port()}" for _ in range(3))
    config = sharded_config(tmp_path, cpu_listen, f"http://{standby_listen}")
    start_server({**config, "server": {"listen": leader_listen}}, shard="gpu", name="gpu-leader")
    standby = start_server({**config, "server": {"listen": standby_listen}}, "gpu", "gpu-standby", wait_ready=False)
    standby.wait_ready(leader=False)
    cpu = Stubs(start_server({**config, "server": {"listen": cpu_listen}}, shard="cpu", name="cpu"))
    err = refusal(lambda: submit(Stubs(standby), "llm"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "cronoq-leader" in trailers(err)  # type: ignore[attr-defined]
    assert submit(cpu, "llm").task.id >> 56 == 2
