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
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import eventually, store_table  # type: ignore[import-not-found]
from conftest import ServerProcess, free_port, to_toml  # type: ignore[import-not-found]

from cronoq.status import decode_details
from cronoq.v1 import schedule_service_pb2 as spb
from cronoq.v1 import schedule_service_pb2_grpc, task_pb2, task_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb

pytestmark = pytest.mark.timeout(120)

TOKENS = {"full": "full-token", "default-only": "default-only-token", "default-worker": "default-worker-token"}
TIMEOUT = 10.0


def bearer(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[name]}")]


def sharded_config(
    tmp_path: Path,
    cpu_listen: str,
    gpu_endpoint: str,
    *,
    cpu_endpoint: str | None = None,
    llm: dict[str, Any] | None = None,
    **server: Any,
) -> dict[str, Any]:
    """llm: more settings of the pool llm (gpu's)."""
    return {
        "server": server,
        "pools": [{"name": "default"}, {"name": "llm", **(llm or {})}],
        "shards": [
            {"name": "cpu", "number": 1, "pools": ["default"], "endpoint": cpu_endpoint or f"http://{cpu_listen}"},
            {"name": "gpu", "number": 2, "pools": ["llm"], "endpoint": gpu_endpoint},
        ],
        "resources": [
            {"name": "gpu_slots", "shard": "gpu", "concurrency": 2},
            {"name": "api_cpu", "shard": "cpu", "rate": 6.0},
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
            {
                "name": "default-worker",
                "sha256": hashlib.sha256(TOKENS["default-worker"].encode()).hexdigest(),
                "pools": ["default"],
                "permissions": ["work"],
            },
        ],
    }


class Stubs:
    def __init__(self, srv: ServerProcess):
        self.channel = grpc.insecure_channel(srv.grpc_target)
        self.tasks = task_service_pb2_grpc.TaskServiceStub(self.channel)
        self.schedules = schedule_service_pb2_grpc.ScheduleServiceStub(self.channel)


class TwoShards:
    """cpu and gpu on loopback, each a leader and `replicas - 1` standbys, on `store` (a
    [store] table whose names contain {shard}; default: a SQLite file per shard)."""

    def __init__(
        self,
        tmp_path: Path,
        start_server: Any,
        store: dict[str, Any] | None = None,
        replicas: int = 1,
        llm: dict[str, Any] | None = None,
        **server: Any,
    ):
        cpu_listen, gpu_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.config = sharded_config(tmp_path, cpu_listen, f"http://{gpu_listen}", llm=llm, **server)
        if store is not None:
            self.config["store"] = store
        self.cpu = start_server({**self.config, "server": {**server, "listen": cpu_listen}}, shard="cpu", name="cpu")
        self.gpu = start_server({**self.config, "server": {**server, "listen": gpu_listen}}, shard="gpu", name="gpu")
        self.servers: dict[str, list[ServerProcess]] = {"cpu": [self.cpu], "gpu": [self.gpu]}
        for name, replicas_of in self.servers.items():
            for i in range(1, replicas):
                standby = start_server({**self.config, "server": server}, name, f"{name}-standby{i}", wait_ready=False)
                replicas_of.append(standby)
        for standby in (s for replicas_of in self.servers.values() for s in replicas_of[1:]):
            standby.wait_ready(leader=False)
        self.stubs = {"cpu": Stubs(self.cpu), "gpu": Stubs(self.gpu)}

    @classmethod
    def on_store_of(cls, request: pytest.FixtureRequest, tmp_path: Path, start_server: Any, **kw: Any) -> TwoShards:
        """For a fixture with params ["sqlite", "postgres"]: on a SQLite file per shard, or on a
        schema per shard of one PostgreSQL."""
        store = None
        if request.param == "postgres":
            store = store_table("postgres", request)
            store["schema"] += "_{shard}"
        return cls(tmp_path, start_server, store, **kw)

    def kill(self, shard: str) -> None:
        """Every server of the shard: SIGKILL."""
        for srv in self.servers[shard]:
            srv.kill()


@pytest.fixture(params=["sqlite", "postgres"])
def shards(request: pytest.FixtureRequest, tmp_path: Path, start_server: Any) -> TwoShards:
    """The page's deployment, each shard with a standby: on a SQLite file per shard, or on a
    schema per shard of one PostgreSQL."""
    return TwoShards.on_store_of(request, tmp_path, start_server, replicas=2)


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


def http(
    srv: ServerProcess, method: str, path: str, body: Any = None, token: str = "full", **headers: str
) -> tuple[int, Any, Any]:
    import json
    import urllib.error

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(srv.http_url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {TOKENS[token]}")
    for k, v in headers.items():
        req.add_header(k.replace("_", "-"), v)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


def test_calls_for_another_shard_are_forwarded_and_ids_name_their_shard(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    llm = submit(cpu, "llm", payload=b"x", group_key="tenant-1").task
    assert llm.id >> 56 == 2 and llm.pool == "llm" and llm.group_key == "tenant-1"
    dflt = submit(gpu, "default").task
    assert dflt.id >> 56 == 1
    assert submit(Stubs(shards.servers["gpu"][1]), "default").task.id >> 56 == 1  # a standby forwards too

    for stubs in (cpu, gpu):
        for task in (llm, dflt):
            got = stubs.tasks.GetTask(
                tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=bearer("full"), timeout=TIMEOUT
            ).task
            assert (got.id, got.pool, got.state, got.group_key) == (
                task.id, task.pool, task_pb2.TASK_STATE_PENDING, task.group_key
            )  # fmt: skip
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
    # Refused by the gpu server: the forwarder passed it on, and gpu refused it twice; cpu
    # answered one call with gpu's refusal.
    assert metric(shards.gpu, "cronoq_api_calls_total", method="SubmitTask", code="PERMISSION_DENIED") == 2
    assert metric(shards.cpu, "cronoq_api_calls_total", method="SubmitTask", code="PERMISSION_DENIED") == 1
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


def test_a_caller_learns_nothing_of_a_shard_it_may_read_no_pool_of(shards: TwoShards) -> None:
    """default-only reads pool default (cpu) only: gpu is left out of its snapshots, and a gpu
    task id is, to it, a missing task, even in a call it marks cronoq-forwarded itself (which
    would otherwise be refused naming gpu's endpoint)."""
    from cronoq.v1 import admin_service_pb2 as apb
    from cronoq.v1 import admin_service_pb2_grpc

    gpu_endpoint = shards.config["shards"][1]["endpoint"]
    task = submit(shards.stubs["gpu"], "llm").task
    never = (2 << 56) + 999_999  # a gpu id no task has: what a missing task looks like
    for stubs in shards.stubs.values():
        snap = admin_service_pb2_grpc.AdminServiceStub(stubs.channel).GetSnapshot(
            apb.GetSnapshotRequest(), metadata=bearer("default-only"), timeout=TIMEOUT
        )
        assert [s.shard for s in snap.shards] == ["cpu"], snap
        assert "gpu" not in str(snap) and gpu_endpoint not in str(snap)
    # Asked of gpu alone (a call marked cronoq-forwarded): nothing of it, not its standbys.
    snap = admin_service_pb2_grpc.AdminServiceStub(shards.stubs["gpu"].channel).GetSnapshot(
        apb.GetSnapshotRequest(), metadata=[*bearer("default-only"), ("cronoq-forwarded", "1")], timeout=TIMEOUT
    )
    assert not snap.shards, snap
    status, headers, body = http(shards.cpu, "GET", "/v1/snapshot", token="default-only")
    assert status == 200 and [s["shard"] for s in body["shards"]] == ["cpu"], body

    cpu = shards.stubs["cpu"]
    md = [*bearer("default-only"), ("cronoq-forwarded", "1")]
    calls = {
        "GetTask": lambda ref: cpu.tasks.GetTask(tpb.GetTaskRequest(task=ref), metadata=md, timeout=TIMEOUT),
        "WaitTask": lambda ref: cpu.tasks.WaitTask(tpb.WaitTaskRequest(task=ref), metadata=md, timeout=TIMEOUT),
        "CancelTask": lambda ref: cpu.tasks.CancelTask(tpb.CancelTaskRequest(task=ref), metadata=md, timeout=TIMEOUT),
    }
    for name, call in calls.items():
        for task_id in (task.id, never):
            err = refusal(lambda call=call, task_id=task_id: call(task_pb2.TaskRef(id=task_id)))
            assert err.code() == grpc.StatusCode.NOT_FOUND, (name, err)  # type: ignore[attr-defined]
            assert err.details() == f"task {task_id} not found", (name, err.details())  # type: ignore[attr-defined]
            assert not {"cronoq-shard", "cronoq-shard-endpoint"} & set(trailers(err)), (name, trailers(err))
    for method, path in (("GET", f"/v1/tasks/{task.id}"), ("POST", f"/v1/tasks/{task.id}/cancel")):
        status, headers, body = http(shards.cpu, method, path, token="default-only", cronoq_forwarded="1")
        assert status == 404 and "shard" not in body and "shard_endpoint" not in body, body
        assert "cronoq-shard" not in headers and "cronoq-shard-endpoint" not in headers
    got = shards.stubs["gpu"].tasks.GetTask(
        tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=bearer("full")
    )
    assert got.task.state == task_pb2.TASK_STATE_PENDING  # nothing was cancelled


def test_a_shard_that_is_down_is_unavailable_by_name_quickly(shards: TwoShards) -> None:
    cpu = shards.stubs["cpu"]
    task = submit(cpu, "llm").task
    shards.kill("gpu")
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


# -- lookups by key, fan-out reads, workers --------------------------------------------


def by_key(stubs: Stubs, method: str, key: str, token: str = "full", **kw: Any) -> tuple[Any, dict[str, Any]]:
    """A Get/Wait/Cancel by key, with its trailing metadata."""
    request = getattr(tpb, f"{method}Request")(task=task_pb2.TaskRef(key=key), **kw)
    response, call = getattr(stubs.tasks, method).with_call(request, metadata=bearer(token), timeout=TIMEOUT)
    return response, dict(call.trailing_metadata() or ())


def list_all(stubs: Stubs, page_size: int, **kw: Any) -> list[list[int]]:
    """Every page of ListTasks, as lists of ids."""
    pages, token = [], ""
    while True:
        page = stubs.tasks.ListTasks(
            tpb.ListTasksRequest(page_size=page_size, page_token=token, **kw), metadata=bearer("full"), timeout=TIMEOUT
        )
        assert list(page.unavailable_shards) == []
        pages.append([t.id for t in page.tasks])
        token = page.next_page_token
        if not token:
            return pages


def test_lookups_by_key_ask_every_shard(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    only_llm = submit(cpu, "llm", key="only-llm").task
    both = [submit(cpu, "default", key="both").task, submit(cpu, "llm", key="both").task]
    assert [t.id >> 56 for t in both] == [1, 2]  # keys deduplicate per shard

    for stubs in (cpu, gpu):
        got, meta = by_key(stubs, "GetTask", "only-llm")
        assert (
            got.task.id == only_llm.id
            and list(got.unavailable_shards) == []
            and "cronoq-unavailable-shards" not in meta
        )
        waited, _ = by_key(stubs, "WaitTask", "only-llm", timeout_ms=50)
        assert waited.task.id == only_llm.id and not waited.done
        for method in ("GetTask", "WaitTask", "CancelTask"):
            err = refusal(lambda stubs=stubs, method=method: by_key(stubs, method, "both"))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err  # type: ignore[attr-defined]
            assert "use the task id" in err.details() and str(both[1].id) in err.details()  # type: ignore[attr-defined]
        err = refusal(lambda stubs=stubs: by_key(stubs, "GetTask", "nobody"))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "'nobody'" in err.details()  # type: ignore[attr-defined]
        # A caller that may not read llm does not find its tasks by key, from either server.
        err = refusal(lambda stubs=stubs: by_key(stubs, "GetTask", "only-llm", token="default-only"))
        assert err.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        got, _ = by_key(stubs, "GetTask", "both", token="default-only")  # only its cpu task is visible
        assert got.task.id == both[0].id
    for stubs, task in ((cpu, both[0]), (gpu, both[1])):  # by id, the same key is no problem
        got = stubs.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=bearer("full"))
        assert got.task.key == "both"

    cancelled, _ = by_key(gpu, "CancelTask", "only-llm")
    assert cancelled.task.id == only_llm.id and cancelled.task.state == task_pb2.TASK_STATE_CANCELLED
    waited, _ = by_key(cpu, "WaitTask", "only-llm", timeout_ms=50)
    assert waited.done
    status, _, body = http(shards.gpu, "GET", "/v1/keys/only-llm")
    assert status == 200 and body["task"]["id"] == str(only_llm.id), body
    status, _, body = http(shards.gpu, "GET", "/v1/keys/both")
    assert status == 409 and "use the task id" in body["message"], body
    # A listing by key shows each shard's task with that key (what a key names in several shards).
    status, _, body = http(shards.gpu, "GET", "/v1/tasks?key=both")
    assert status == 200 and [t["id"] for t in body["tasks"]] == [str(t.id) for t in both], body
    listed = cpu.tasks.ListTasks(tpb.ListTasksRequest(key="both"), metadata=bearer("default-only"))
    assert [t.id for t in listed.tasks] == [both[0].id]
    listed = cpu.tasks.ListTasks(tpb.ListTasksRequest(key="both", pool="llm"), metadata=bearer("full"))
    assert [t.id for t in listed.tasks] == [both[1].id]


def test_listings_page_across_shards_in_id_order(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    ids = [submit(cpu, "default" if i % 3 else "llm").task.id for i in range(10)]  # 6 default, 4 llm
    expected = sorted(ids)
    assert [i >> 56 for i in expected] == [1] * 6 + [2] * 4
    for stubs in (cpu, gpu):
        pages = list_all(stubs, 4)  # the second page holds tasks of both shards
        assert pages == [expected[0:4], expected[4:8], expected[8:10]]
        assert list_all(stubs, 100) == [expected]
        assert list_all(stubs, 3, pool="llm") == [expected[6:9], expected[9:]]
        assert list_all(stubs, 5, state=task_pb2.TASK_STATE_PENDING) == [expected[0:5], expected[5:10]]
    # A token of one server continues on the other.
    first = cpu.tasks.ListTasks(tpb.ListTasksRequest(page_size=5), metadata=bearer("full"))
    rest = gpu.tasks.ListTasks(tpb.ListTasksRequest(page_token=first.next_page_token), metadata=bearer("full"))
    assert [t.id for t in rest.tasks] == expected[5:] and not rest.next_page_token
    # Over HTTP, and a caller that may read only default sees only default's tasks.
    status, _, body = http(shards.gpu, "GET", "/v1/tasks?page_size=7")
    assert status == 200 and [int(t["id"]) for t in body["tasks"]] == expected[:7] and body["next_page_token"]
    page = gpu.tasks.ListTasks(tpb.ListTasksRequest(), metadata=bearer("default-only"))
    assert [t.id for t in page.tasks] == expected[:6]
    err = refusal(lambda: gpu.tasks.ListTasks(tpb.ListTasksRequest(page_token="x1"), metadata=bearer("full")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in err.details()  # type: ignore[attr-defined]
    # Newest first: by creation time (the order submitted here) whatever the shard, pages mixing shards.
    newest = ids[::-1]
    for stubs in (cpu, gpu):
        assert list_all(stubs, 3, newest_first=True) == [newest[0:3], newest[3:6], newest[6:9], newest[9:]]
        assert list_all(stubs, 100, newest_first=True, pool="default") == [[i for i in newest if i >> 56 == 1]]
    status, _, body = http(shards.cpu, "GET", "/v1/tasks?page_size=5&newest_first=true")
    assert status == 200 and [int(t["id"]) for t in body["tasks"]] == newest[:5], body
    err = refusal(lambda: cpu.tasks.ListTasks(tpb.ListTasksRequest(pool="llm"), metadata=bearer("default-only")))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "gpu" not in err.details()  # type: ignore[attr-defined]


def test_workers_schedules_and_snapshots_cover_every_shard(shards: TwoShards) -> None:
    from cronoq.v1 import admin_service_pb2 as apb
    from cronoq.v1 import admin_service_pb2_grpc, worker_service_pb2_grpc
    from cronoq.v1 import worker_service_pb2 as wpb

    workers = {name: worker_service_pb2_grpc.WorkerServiceStub(stubs.channel) for name, stubs in shards.stubs.items()}
    workers["cpu"].RegisterWorker(wpb.RegisterWorkerRequest(pools=["default"], name="w-cpu"), metadata=bearer("full"))
    workers["gpu"].RegisterWorker(wpb.RegisterWorkerRequest(pools=["llm"], name="w-gpu"), metadata=bearer("full"))
    for pool, name in (("default", "a"), ("llm", "b")):
        shards.stubs["gpu"].schedules.PutSchedule(
            spb.PutScheduleRequest(schedule=spb.Schedule(pool=pool, name=name, cron="0 3 * * *")),
            metadata=bearer("full"),
        )
    for name, stubs in shards.stubs.items():
        listed = workers[name].ListWorkers(wpb.ListWorkersRequest(), metadata=bearer("full"))
        assert sorted(w.name for w in listed.workers) == ["w-cpu", "w-gpu"] and not listed.unavailable_shards
        listed = workers[name].ListWorkers(wpb.ListWorkersRequest(pool="llm"), metadata=bearer("full"))
        assert [w.name for w in listed.workers] == ["w-gpu"]
        schedules = stubs.schedules.ListSchedules(spb.ListSchedulesRequest(), metadata=bearer("full"))
        assert [(s.pool, s.name) for s in schedules.schedules] == [("default", "a"), ("llm", "b")]
        snap = admin_service_pb2_grpc.AdminServiceStub(stubs.channel).GetSnapshot(
            apb.GetSnapshotRequest(), metadata=bearer("full")
        )
        assert [(s.shard, s.number, [p.pool for p in s.pools]) for s in snap.shards] == [
            ("cpu", 1, ["default"]),
            ("gpu", 2, ["llm"]),
        ]
        assert [s.leader for s in snap.shards] == [shards.cpu.endpoint, shards.gpu.endpoint]


def test_a_worker_is_sent_to_the_shard_of_its_pools(shards: TwoShards) -> None:
    from cronoq.v1 import worker_service_pb2 as wpb
    from cronoq.v1 import worker_service_pb2_grpc

    cpu = worker_service_pb2_grpc.WorkerServiceStub(shards.stubs["cpu"].channel)
    gpu_endpoint = shards.config["shards"][1]["endpoint"]
    err = refusal(lambda: cpu.RegisterWorker(wpb.RegisterWorkerRequest(pools=["llm"]), metadata=bearer("full")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert trailers(err)["cronoq-shard"] == "gpu" and trailers(err)["cronoq-shard-endpoint"] == gpu_endpoint
    assert decode_details(err.trailing_metadata()).reason == "WRONG_SHARD"  # type: ignore[attr-defined,union-attr]
    err = refusal(
        lambda: cpu.RegisterWorker(wpb.RegisterWorkerRequest(pools=["default", "llm"]), metadata=bearer("full"))
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "one worker per shard" in err.details()  # type: ignore[attr-defined]
    # Credentials first: no 'work' on llm, nothing learnt about its shard.
    err = refusal(lambda: cpu.RegisterWorker(wpb.RegisterWorkerRequest(pools=["llm"]), metadata=bearer("default-only")))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "cronoq-shard" not in trailers(err)  # type: ignore[attr-defined]
    # Nor with 'work' on another pool only: the pool's permission is checked before its shard is named.
    err = refusal(
        lambda: cpu.RegisterWorker(wpb.RegisterWorkerRequest(pools=["llm"]), metadata=bearer("default-worker"))
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "cronoq-shard" not in trailers(err)  # type: ignore[attr-defined]
    assert "gpu" not in err.details()  # type: ignore[attr-defined]
    assert cpu.RegisterWorker(wpb.RegisterWorkerRequest(pools=["default"]), metadata=bearer("full")).shard == "cpu"


def test_with_a_shard_down_reads_answer_and_name_it(shards: TwoShards) -> None:
    from cronoq.v1 import admin_service_pb2 as apb
    from cronoq.v1 import admin_service_pb2_grpc

    cpu = shards.stubs["cpu"]
    mine = submit(cpu, "default", key="mine").task
    submit(cpu, "default", key="both")
    submit(cpu, "llm", key="both")
    shards.kill("gpu")

    page, call = cpu.tasks.ListTasks.with_call(tpb.ListTasksRequest(), metadata=bearer("full"), timeout=TIMEOUT)
    assert [t.id >> 56 for t in page.tasks] == [1, 1] and list(page.unavailable_shards) == ["gpu"]
    assert dict(call.trailing_metadata())["cronoq-unavailable-shards"] == "gpu"
    # A page that cpu's tasks fill does not wait for gpu (its tasks would come later).
    pages = []
    token = ""
    for _ in range(3):
        page = cpu.tasks.ListTasks(tpb.ListTasksRequest(page_size=1, page_token=token), metadata=bearer("full"))
        pages.append(([t.id >> 56 for t in page.tasks], list(page.unavailable_shards), bool(page.next_page_token)))
        token = page.next_page_token
    assert pages == [([1], [], True), ([1], [], True), ([], ["gpu"], False)]
    snap = admin_service_pb2_grpc.AdminServiceStub(cpu.channel).GetSnapshot(
        apb.GetSnapshotRequest(), metadata=bearer("full")
    )
    assert [s.shard for s in snap.shards] == ["cpu"] and list(snap.unavailable_shards) == ["gpu"]
    status, headers, body = http(shards.cpu, "GET", "/v1/tasks")
    assert status == 200 and body["unavailable_shards"] == ["gpu"] and headers["cronoq-unavailable-shards"] == "gpu"

    for method, extra in (("GetTask", {}), ("WaitTask", {"timeout_ms": 10})):
        got, meta = by_key(cpu, method, "mine", **extra)
        assert got.task.id == mine.id and list(got.unavailable_shards) == ["gpu"], method
        assert meta["cronoq-unavailable-shards"] == "gpu"
    status, headers, body = http(shards.cpu, "GET", "/v1/keys/mine")
    assert status == 200 and body["unavailable_shards"] == ["gpu"], body
    # Cancel by key needs every shard: gpu might hold the key too.
    err = refusal(lambda: by_key(cpu, "CancelTask", "mine"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "'gpu'" in err.details()  # type: ignore[attr-defined]
    assert trailers(err)["cronoq-unavailable-shards"] == "gpu"
    # A key no reachable shard holds might be on gpu: unavailable, not "not found".
    err = refusal(lambda: by_key(cpu, "GetTask", "elsewhere"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    got, _ = by_key(cpu, "GetTask", "both")  # only cpu's answers now
    assert got.task.id >> 56 == 1 and list(got.unavailable_shards) == ["gpu"]
    assert (
        cpu.tasks.CancelTask(
            tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=mine.id)), metadata=bearer("full")
        ).task.state
        == task_pb2.TASK_STATE_CANCELLED
    )


def test_a_certificate_caller_reads_only_the_receiving_shard(tmp_path: Path, start_server: Any) -> None:
    """mTLS on both shards; a caller by client certificate has no token to forward: its reads
    name the other shard unavailable, and calls for the other shard are refused with its
    endpoint. A token caller on the same channels is forwarded (peer_tls with a certificate)."""
    from tls_pki import Pki  # type: ignore[import-not-found]

    from cronoq.v1 import admin_service_pb2 as apb
    from cronoq.v1 import admin_service_pb2_grpc

    pki = Pki(tmp_path)
    leaf, peer, reader = pki.server(), pki.client("CN=cronoq-peer", "peer"), pki.client("CN=reader", "reader")
    cpu_listen, gpu_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = sharded_config(tmp_path, cpu_listen, f"https://{gpu_listen}", cpu_endpoint=f"https://{cpu_listen}")
    config["clients"] = [{"subject": "CN=reader", "pools": ["*"], "permissions": ["submit", "read", "admin"]}]
    server = {
        "tls": {"cert": leaf.cert, "key": leaf.key, "client_ca": pki.ca_path},
        "peer_tls": {"ca": pki.ca_path, "cert": peer.cert, "key": peer.key},
    }
    procs = [
        start_server({**config, "server": {**server, "listen": listen}}, shard=name, name=name, wait_ready=False)
        for name, listen in (("cpu", cpu_listen), ("gpu", gpu_listen))
    ]
    creds = grpc.ssl_channel_credentials(
        Path(pki.ca_path).read_bytes(), Path(reader.key).read_bytes(), Path(reader.cert).read_bytes()
    )
    cpu, gpu = (Stubs.__new__(Stubs) for _ in range(2))
    for stubs, listen in ((cpu, cpu_listen), (gpu, gpu_listen)):
        stubs.channel = grpc.secure_channel(listen, creds)
        stubs.tasks = task_service_pb2_grpc.TaskServiceStub(stubs.channel)
    deadline = time.monotonic() + 20
    for proc, stubs in zip(procs, (cpu, gpu), strict=True):
        while True:  # ready: the leader answers a read
            try:
                stubs.tasks.ListTasks(tpb.ListTasksRequest(), metadata=bearer("full"), timeout=1)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()  # type: ignore[union-attr]
                time.sleep(0.1)
    # cpu's first read above may have tried gpu before gpu listened: its channel retries within 2 s.
    eventually(
        lambda: not cpu.tasks.ListTasks(tpb.ListTasksRequest(), metadata=bearer("full"), timeout=TIMEOUT).unavailable_shards,
        what="cpu reaching gpu",
    )

    mine = cpu.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="default", key="k"), timeout=TIMEOUT).task  # by certificate
    theirs = submit(cpu, "llm", key="k").task  # by token: forwarded over mTLS
    assert theirs.id >> 56 == 2

    page = cpu.tasks.ListTasks(tpb.ListTasksRequest(), timeout=TIMEOUT)
    assert [t.id for t in page.tasks] == [mine.id] and list(page.unavailable_shards) == ["gpu"]
    page = cpu.tasks.ListTasks(tpb.ListTasksRequest(), metadata=bearer("full"), timeout=TIMEOUT)
    assert [t.id for t in page.tasks] == [mine.id, theirs.id] and not page.unavailable_shards
    snap = admin_service_pb2_grpc.AdminServiceStub(gpu.channel).GetSnapshot(apb.GetSnapshotRequest(), timeout=TIMEOUT)
    assert [s.shard for s in snap.shards] == ["gpu"] and list(snap.unavailable_shards) == ["cpu"]
    got = cpu.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(key="k")), timeout=TIMEOUT)
    assert got.task.id == mine.id and list(got.unavailable_shards) == ["gpu"]

    for call in (
        lambda: cpu.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="llm"), timeout=TIMEOUT),
        lambda: cpu.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=theirs.id)), timeout=TIMEOUT),
    ):
        err = refusal(call)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err  # type: ignore[attr-defined]
        assert (
            trailers(err)["cronoq-shard"] == "gpu" and trailers(err)["cronoq-shard-endpoint"] == f"https://{gpu_listen}"
        )
        assert "certificate" in err.details()  # type: ignore[attr-defined]


def test_what_cannot_span_shards_is_refused(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    first = submit(cpu, "default", key="first").task
    for stubs in (cpu, gpu):
        err = refusal(lambda stubs=stubs: submit(stubs, "llm", depends_on=[task_pb2.TaskRef(id=first.id)]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err  # type: ignore[attr-defined]
        assert "depends_on[0]" in err.details() and "its own shard" in err.details()  # type: ignore[attr-defined]
        # By key: keys of the task's own shard, where 'first' names nothing.
        err = refusal(lambda stubs=stubs: submit(stubs, "llm", depends_on=[task_pb2.TaskRef(key="first")]))
        assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), err  # type: ignore[attr-defined]
        assert "'first'" in err.details()  # type: ignore[attr-defined]
        err = refusal(lambda stubs=stubs: submit(stubs, "default", resources={"gpu_slots": 1}))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err  # type: ignore[attr-defined]
        assert "'gpu_slots'" in err.details() and "'cpu'" in err.details()  # type: ignore[attr-defined]
    assert submit(cpu, "llm", resources={"gpu_slots": 1}).task.resources == {"gpu_slots": 1}
    assert submit(gpu, "default", depends_on=[task_pb2.TaskRef(key="first")]).task.state == task_pb2.TASK_STATE_BLOCKED


def test_shards_and_a_replica_on_one_host_read_one_file(tmp_path: Path) -> None:
    """As the README runs them: one file, no listen addresses in it, each server given its own
    with --listen and --http-listen. A server whose port is not its shard's endpoint port (a
    standby here) says so in one warning line."""
    ports = {name: (free_port(), free_port()) for name in ("cpu", "gpu", "gpu-standby")}
    config = sharded_config(tmp_path, f"127.0.0.1:{ports['cpu'][0]}", f"http://127.0.0.1:{ports['gpu'][0]}")
    del config["server"]
    path = tmp_path / "cronoq.toml"
    path.write_text(to_toml(config))
    servers: dict[str, ServerProcess] = {}
    try:
        for name, (grpc_port, http_port) in ports.items():
            listen = {"listen": f"127.0.0.1:{grpc_port}", "http_listen": f"127.0.0.1:{http_port}"}
            srv = ServerProcess(tmp_path, {**config, "server": listen}, name.split("-")[0], name)
            srv.config_path = path  # the one file, not the one ServerProcess wrote
            args = ["--listen", listen["listen"], "--http-listen", listen["http_listen"]]
            servers[name] = srv.start(wait_ready=name != "gpu-standby", extra_args=args)
        servers["gpu-standby"].wait_ready(leader=False)
        cpu, gpu = Stubs(servers["cpu"]), Stubs(servers["gpu"])
        to_gpu = submit(cpu, "llm").task  # forwarded cpu -> gpu
        to_cpu = submit(gpu, "default").task  # forwarded gpu -> cpu
        assert (to_gpu.id >> 56, to_cpu.id >> 56) == (2, 1)
        assert get_via(gpu, to_cpu.id).pool == "default" and get_via(cpu, to_gpu.id).pool == "llm"
        warnings = {name: [ln for ln in srv.log().splitlines() if " WARNING " in ln] for name, srv in servers.items()}
        assert warnings["cpu"] == warnings["gpu"] == [], warnings
        (line,) = warnings["gpu-standby"]
        assert f"port {ports['gpu-standby'][0]}" in line and f"http://127.0.0.1:{ports['gpu'][0]}" in line, line
    finally:
        for srv in servers.values():
            srv.kill()
    bad = subprocess.run(
        [sys.executable, "-m", "cronoq_server.main", "--config", str(path), "--shard", "cpu", "--listen", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--listen" in bad.stderr and "'nope'" in bad.stderr, bad.stderr


def get_via(stubs: Stubs, task_id: int) -> task_pb2.Task:
    ref = task_pb2.TaskRef(id=task_id)
    return stubs.tasks.GetTask(tpb.GetTaskRequest(task=ref), metadata=bearer("full"), timeout=TIMEOUT).task


@pytest.fixture(params=["sqlite", "postgres"])
def two_shards(request: pytest.FixtureRequest, tmp_path: Path, start_server: Any) -> TwoShards:
    """The page's deployment, one server a shard."""
    return TwoShards.on_store_of(request, tmp_path, start_server)


def test_newest_first_across_shards_is_by_creation_time(two_shards: TwoShards) -> None:
    """Tasks submitted to both shards in turn: newest first lists them newest to oldest whatever
    their shard, page after page, and tasks submitted between pages are neither shown (they are
    newer than the first page) nor make a task show twice or not at all."""
    import json
    import subprocess
    import sys

    cpu, gpu = two_shards.stubs["cpu"], two_shards.stubs["gpu"]
    submitted = [submit(cpu if i % 2 else gpu, "default" if i % 4 < 2 else "llm").task for i in range(240)]
    assert {t.id >> 56 for t in submitted} == {1, 2}
    newest = [t.id for t in submitted[::-1]]  # submitted one after another: creation order
    assert [t.id for t in submitted] != sorted(t.id for t in submitted)  # not id order across shards
    listed, later, token = [], [], ""
    for page_number in range(100):
        page = cpu.tasks.ListTasks(
            tpb.ListTasksRequest(page_size=50, page_token=token, newest_first=True),
            metadata=bearer("full"),
            timeout=TIMEOUT,
        )
        assert list(page.unavailable_shards) == [] and len(page.tasks) <= 50
        listed += [t.id for t in page.tasks]
        token = page.next_page_token
        if not token:
            break
        later.append(submit(cpu, "llm" if page_number % 2 else "default").task.id)  # newer than all listed
    assert listed == newest
    now_newest = later[::-1] + newest
    for token in (str(newest[0]), "n1", f"n{newest[0]}.{newest[0]}"):  # an id-order token, no shard's, twice one
        request = tpb.ListTasksRequest(newest_first=True, page_token=token)
        err = refusal(lambda: cpu.tasks.ListTasks(request, metadata=bearer("full"), timeout=TIMEOUT))  # noqa: B023
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in err.details(), token  # type: ignore[attr-defined]
    assert list_all(gpu, 7, newest_first=True, pool="llm") == chunks([i for i in now_newest if i >> 56 == 2], 7)
    status, _, body = http(two_shards.gpu, "GET", "/v1/tasks?newest_first=true&page_size=50")
    assert status == 200 and [int(t["id"]) for t in body["tasks"]] == list_all(cpu, 500, newest_first=True)[0][:50]
    first = [int(t["id"]) for t in body["tasks"]]
    assert {i >> 56 for i in first} == {1, 2}, first
    cli = ["tasks", "--newest-first", "--json", "--limit", "50", "--endpoint", two_shards.cpu.endpoint]
    shown = subprocess.run(
        [sys.executable, "-m", "cronoq.cli", *cli, "--token", TOKENS["full"]],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert [int(json.loads(line)["id"]) for line in shown.stdout.splitlines()] == first, shown.stdout


def chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def test_a_workflow_of_another_shard_is_read_by_key_and_cancelled_by_parent_id(two_shards: TwoShards) -> None:
    """GetTask by key through the other shard keeps include_children and
    include_dependency_results; a bulk cancel with filter.parent_id alone reaches the shard."""
    from cronoq.v1 import worker_service_pb2 as wpb
    from cronoq.v1 import worker_service_pb2_grpc

    cpu, gpu = two_shards.stubs["cpu"], two_shards.stubs["gpu"]
    workers = worker_service_pb2_grpc.WorkerServiceStub(gpu.channel)
    md = bearer("full")
    root = submit(cpu, "llm", key="wf-root").task
    worker = workers.RegisterWorker(wpb.RegisterWorkerRequest(name="t", pools=["llm"]), metadata=md).worker_id
    (leased,) = workers.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker, max_tasks=1), metadata=md).tasks
    spawn = [tpb.SubmitTaskRequest(pool="llm", key=f"wf-c{i}") for i in range(2)]
    spawn.append(tpb.SubmitTaskRequest(pool="llm", key="wf-after", depends_on=[task_pb2.TaskRef(id=root.id)]))
    success = wpb.TaskSuccess(result=b"7", content_type="application/json", spawn=spawn)
    outcome = wpb.TaskOutcome(task_id=leased.id, attempt=leased.attempt, success=success)
    workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=[outcome]), metadata=md)
    req = tpb.GetTaskRequest(task=task_pb2.TaskRef(key="wf-root"), include_children=True)
    got = cpu.tasks.GetTask(req, metadata=md, timeout=TIMEOUT)
    assert sorted(t.key for t in got.children) == ["wf-after", "wf-c0", "wf-c1"]
    req = tpb.GetTaskRequest(task=task_pb2.TaskRef(key="wf-after"), include_dependency_results=True)
    (dep,) = cpu.tasks.GetTask(req, metadata=md, timeout=TIMEOUT).task.dependency_results
    assert (dep.id, dep.result) == (root.id, b"7")
    answer = cpu.tasks.CancelTasks(
        tpb.CancelTasksRequest(filter=tpb.TaskFilter(parent_id=root.id)), metadata=md, timeout=TIMEOUT
    )
    assert (answer.matched, answer.changed) == (3, 3), answer
