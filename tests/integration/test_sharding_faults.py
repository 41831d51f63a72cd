"""Sharding under faults: store guards, replicas of each shard on one PostgreSQL, a leader
failover inside a shard while the other shard forwards to it, and a shard entirely down.

The deployment of test_sharding (shard `cpu` = number 1 owns pool `default`, shard `gpu` =
number 2 owns `llm`), with real server processes on loopback, a real PostgreSQL (one fresh
database per deployment, so the shards' default schemas cronoq_cpu and cronoq_gpu are used),
and real worker processes.
"""

from __future__ import annotations

import asyncio
import collections
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from _helpers import eventually, log_lines, start_worker
from conftest import ServerProcess, free_port  # type: ignore[import-not-found]
from test_failover import is_leader
from test_sharding import TIMEOUT, Stubs, bearer, http, metric, refusal, sharded_config, submit, trailers

import cronoq
from cronoq.v1 import admin_service_pb2 as apb
from cronoq.v1 import admin_service_pb2_grpc, task_pb2, worker_service_pb2_grpc
from cronoq.v1 import schedule_service_pb2 as spb
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

pytestmark = pytest.mark.timeout(90)

PENDING = task_pb2.TASK_STATE_PENDING
SUCCEEDED = task_pb2.TASK_STATE_SUCCEEDED
# Fan-out reads and keys across shards (the router change under way).

# launch(config, shard, name, wait_ready) -> a started ServerProcess: the start_server fixture,
# or the shard_down fixture's own (module-scoped).
Launch = Callable[..., ServerProcess]


# -- deployments ----------------------------------------------------------------------


def fresh_database(pg: Any) -> str:
    """The URL of a new, empty database of the session's PostgreSQL."""
    name = f"shards_{uuid.uuid4().hex[:10]}"

    async def create() -> None:
        conn = await asyncpg.connect(pg.url)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    return f"{pg.url.rsplit('/', 1)[0]}/{name}"


def pg_fetch(url: str, query: str) -> list[Any]:
    async def fetch() -> list[Any]:
        conn = await asyncpg.connect(url)
        try:
            return list(await conn.fetch(query))
        finally:
            await conn.close()

    return asyncio.run(fetch())


def shard_store(kind: str, tmp_path: Path, request: Any) -> dict[str, Any]:
    """A sharded deployment's [store]: one SQLite file a shard, or a fresh PostgreSQL database
    (its shards on the default schemas cronoq_cpu and cronoq_gpu)."""
    if kind == "postgres":
        return {"kind": "postgres", "url": fresh_database(request.getfixturevalue("postgres"))}
    return {"path": str(tmp_path / "cronoq-{shard}.db")}


class Deployment:
    """cpu and gpu with `replicas[shard]` servers each on loopback; servers[shard][0] leads, the
    others are its standbys. Each shard's [[shards]] endpoint is its server number
    `endpoint[shard]`."""

    def __init__(
        self,
        tmp_path: Path,
        launch: Launch,
        store: dict[str, Any],
        replicas: dict[str, int],
        endpoint: dict[str, int] | None = None,
        tokens: bool = True,
        pools: list[dict[str, Any]] | None = None,
    ):
        endpoint = {"cpu": 0, "gpu": 0, **(endpoint or {})}
        self.listens = {shard: [f"127.0.0.1:{free_port()}" for _ in range(n)] for shard, n in replicas.items()}
        # A shard without servers here gets an address nothing listens on.
        addresses = {s: self.listens.get(s) or [f"127.0.0.1:{free_port()}"] for s in ("cpu", "gpu")}
        config = sharded_config(
            tmp_path, addresses["cpu"][endpoint["cpu"]], f"http://{addresses['gpu'][endpoint['gpu']]}"
        )
        config["store"] = store
        if pools is not None:
            config["pools"] = pools
        if not tokens:
            del config["tokens"]
        self.config = config
        self.servers: dict[str, list[ServerProcess]] = {}
        for shard, listens in self.listens.items():
            group = []
            for i, listen in enumerate(listens):
                srv = launch({**config, "server": {"listen": listen}}, shard, f"{shard}{i}", i == 0)
                if i:
                    srv.wait_ready(leader=False)
                group.append(srv)
            self.servers[shard] = group
        for shard, group in self.servers.items():
            assert is_leader(group[0]) and not any(is_leader(s) for s in group[1:]), shard
            for standby in group[1:]:  # a standby names its leader once it has read who leads
                eventually(
                    lambda standby=standby, leader=group[0]: (
                        http(standby, "GET", "/v1/info")[2]["leader"] == leader.endpoint
                    ),
                    timeout=10,
                    what=f"{standby.name} knows its leader",
                )


def full_md() -> list[tuple[str, str]]:
    return bearer("full")


def get_task(stubs: Stubs, ref: task_pb2.TaskRef) -> tpb.GetTaskResponse:
    return stubs.tasks.GetTask(tpb.GetTaskRequest(task=ref), metadata=full_md(), timeout=TIMEOUT)


# -- 1. store guards --------------------------------------------------------------------


def assert_refused_store(srv: ServerProcess, store: str, owner: str, runner: str) -> None:
    """srv exits with 2 and one ERROR line naming the store, its owner and the shard it was
    started as; it never led."""
    assert srv.proc is not None
    code = srv.proc.wait(20)
    log = srv.log()
    assert code == 2, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1, log
    assert store in errors[0] and owner in errors[0] and runner in errors[0], errors[0]
    assert "leader (term" not in log, log


def sqlite_meta(path: Path) -> tuple[dict[str, str], int]:
    db = sqlite3.connect(path)
    try:
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        return meta, db.execute("SELECT count(*) FROM tasks").fetchone()[0]
    finally:
        db.close()


def test_sqlite_store_of_one_shard_is_refused_by_another(tmp_path: Path, start_server: Any) -> None:
    """cpu's SQLite file, renamed to what gpu's store.path resolves to: gpu exits with 2."""
    deploy = Deployment(tmp_path, start_server, shard_store("sqlite", tmp_path, None), {"cpu": 1})
    cpu = deploy.servers["cpu"][0]
    task = submit(Stubs(cpu), "default").task
    assert cpu.stop() == 0
    for suffix in ("", "-wal", "-shm"):
        if (tmp_path / f"cronoq-cpu.db{suffix}").exists():
            (tmp_path / f"cronoq-cpu.db{suffix}").rename(tmp_path / f"cronoq-gpu.db{suffix}")
    gpu = start_server({**deploy.config, "server": {"listen": f"127.0.0.1:{free_port()}"}}, "gpu", "gpu", False)
    path = tmp_path / "cronoq-gpu.db"
    assert_refused_store(gpu, f"store {path}", "'cpu' (number 1)", "'gpu' (number 2)")
    meta, tasks = sqlite_meta(path)
    assert (meta["shard_name"], meta["shard_number"], tasks) == ("cpu", "1", 1)
    assert task.id >> 56 == 1


def test_postgres_schema_of_one_shard_is_refused_by_another(tmp_path: Path, start_server: Any, request: Any) -> None:
    """cpu's schema cronoq_cpu, renamed to gpu's default cronoq_gpu: gpu exits with 2."""
    store = shard_store("postgres", tmp_path, request)
    deploy = Deployment(tmp_path, start_server, store, {"cpu": 1})
    cpu = deploy.servers["cpu"][0]
    submit(Stubs(cpu), "default")
    assert cpu.stop() == 0
    pg_fetch(store["url"], "ALTER SCHEMA cronoq_cpu RENAME TO cronoq_gpu")
    gpu = start_server({**deploy.config, "server": {"listen": f"127.0.0.1:{free_port()}"}}, "gpu", "gpu", False)
    assert_refused_store(gpu, "schema cronoq_gpu", "'cpu' (number 1)", "'gpu' (number 2)")
    meta = dict(pg_fetch(store["url"], "SELECT key, value FROM cronoq_gpu.meta"))
    assert (meta["shard_name"], meta["shard_number"]) == ("cpu", "1")
    assert pg_fetch(store["url"], "SELECT count(*) FROM cronoq_gpu.tasks")[0][0] == 1


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_an_unsharded_store_is_refused_by_a_shard(tmp_path: Path, start_server: Any, request: Any, kind: str) -> None:
    """A store an unsharded server created, where shard cpu's store resolves: cpu exits with 2."""
    if kind == "sqlite":
        unsharded_store: dict[str, Any] = {"path": str(tmp_path / "cronoq-cpu.db")}
        sharded_store: dict[str, Any] = {"path": str(tmp_path / "cronoq-{shard}.db")}
        named = f"store {tmp_path / 'cronoq-cpu.db'}"
    else:
        url = fresh_database(request.getfixturevalue("postgres"))
        unsharded_store = {"kind": "postgres", "url": url, "schema": "cronoq_cpu"}
        sharded_store = {"kind": "postgres", "url": url}  # cpu's default schema: cronoq_cpu
        named = "schema cronoq_cpu"
    listen = f"127.0.0.1:{free_port()}"
    pools = [{"name": "default"}, {"name": "llm"}]
    alone = start_server({"server": {"listen": listen}, "pools": pools, "store": unsharded_store}, None, "alone")
    assert Stubs(alone).tasks.SubmitTask(tpb.SubmitTaskRequest(pool="llm"), timeout=TIMEOUT).task.id >> 56 == 0
    assert alone.stop() == 0
    config = sharded_config(tmp_path, listen, f"http://127.0.0.1:{free_port()}")
    cpu = start_server({**config, "store": sharded_store, "server": {"listen": listen}}, "cpu", "cpu", False)
    assert_refused_store(cpu, named, "'unsharded' (number 0)", "'cpu' (number 1)")


# -- 2. two replicas a shard on PostgreSQL -----------------------------------------------


def test_two_replicas_a_shard_on_postgres(tmp_path: Path, start_server: Any, request: Any) -> None:
    """cpu0/cpu1 and gpu0/gpu1 (leaders first) on one PostgreSQL, the default schemas. cpu's
    endpoint is its leader, gpu's its standby: calls forwarded to gpu follow cronoq-leader."""
    store = shard_store("postgres", tmp_path, request)
    deploy = Deployment(tmp_path, start_server, store, {"cpu": 2, "gpu": 2}, endpoint={"gpu": 1})
    (cpu0, cpu1), (gpu0, gpu1) = deploy.servers["cpu"], deploy.servers["gpu"]
    stubs = {s.name: Stubs(s) for s in (cpu0, cpu1, gpu0, gpu1)}

    # Directly on each shard's leader: the ids' top 8 bits are the shard's number.
    own = {"default": submit(stubs["cpu0"], "default").task, "llm": submit(stubs["gpu0"], "llm").task}
    assert (own["default"].id >> 56, own["llm"].id >> 56) == (1, 2)
    # Through the other shard's leader and through its standby (a standby forwards too).
    via: dict[str, task_pb2.Task] = {}
    for name, pool in (("cpu0", "llm"), ("cpu1", "llm"), ("gpu0", "default"), ("gpu1", "default")):
        via[name] = submit(stubs[name], pool, payload=name.encode()).task
        assert via[name].id >> 56 == (2 if pool == "llm" else 1) and via[name].pool == pool, name
    status, _, body = http(cpu1, "POST", "/v1/tasks", {"pool": "llm", "payload_json": {"via": "cpu1"}})
    assert status == 200 and int(body["task"]["id"]) >> 56 == 2, body
    # gpu's endpoint is its standby: the first call each cpu server forwards to gpu is refused
    # there (UNAVAILABLE naming the leader) and then answered by the leader, which the server
    # then calls directly (cpu1's call over HTTP).
    forwarded_to_gpu = metric(gpu1, "cronoq_api_calls_total", method="SubmitTask", code="UNAVAILABLE")
    assert forwarded_to_gpu == 2, forwarded_to_gpu  # cpu0's first, cpu1's first
    # Its own, three forwarded to it, and the one it forwarded to cpu.
    assert metric(gpu0, "cronoq_api_calls_total", method="SubmitTask", code="OK") == 5
    assert metric(cpu0, "cronoq_forwarded_calls_total", shard="gpu", code="OK") == 1
    assert metric(cpu1, "cronoq_forwarded_calls_total", shard="gpu", code="OK") == 2
    # A standby's own shard's call: UNAVAILABLE naming its leader (the SDK follows it).
    err = refusal(lambda: submit(stubs["cpu1"], "default"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert trailers(err)["cronoq-leader"] == cpu0.endpoint
    with cronoq.SyncClient(cpu1.endpoint, token="full-token") as client:
        assert client.submit("default", {"via": "cpu1"}).task.id >> 56 == 1

    # Every task by id through every server: answered (a standby asks its own shard's leader).
    tasks = [*own.values(), *via.values()]
    for name, srv_stubs in stubs.items():
        for task in tasks:
            ref = task_pb2.TaskRef(id=task.id)
            got = get_task(srv_stubs, ref).task
            assert (got.id, got.pool, got.state, got.payload) == (task.id, task.pool, PENDING, task.payload), name

    # Each shard's tasks in its own default schema, each schema marked with its shard.
    url = store["url"]
    for schema, name, number, pool in (("cronoq_cpu", "cpu", "1", "default"), ("cronoq_gpu", "gpu", "2", "llm")):
        meta = dict(pg_fetch(url, f"SELECT key, value FROM {schema}.meta"))
        assert (meta["shard_name"], meta["shard_number"]) == (name, number)
        pools = collections.Counter(r[0] for r in pg_fetch(url, f"SELECT pool FROM {schema}.tasks"))
        assert pools == {pool: 4}, (schema, pools)


# -- 3. a leader failover inside gpu while cpu forwards to it -----------------------------


class Load(threading.Thread):
    """`clients` SDK clients of one server submitting `pool` tasks one after another (a fresh
    request_id each, retried with it on UNAVAILABLE by the SDK) until stopped; records every
    acknowledged id. One event loop (grpc.aio wants one at a time)."""

    def __init__(self, endpoint: str, pool: str, clients: int):
        super().__init__(daemon=True)
        self.endpoint, self.pool, self.clients = endpoint, pool, clients
        self.acked: list[int] = []
        self.errors: list[BaseException] = []
        self._halt = threading.Event()

    def run(self) -> None:
        async def one(c: int) -> None:
            retry = cronoq.RetryConfig(initial_backoff=0.05, max_backoff=0.3, max_elapsed=20)
            async with cronoq.Client(self.endpoint, retry=retry) as client:
                i = 0
                while not self._halt.is_set():
                    sub = await client.submit(self.pool, {"client": c, "i": i})
                    self.acked.append(sub.task.id)
                    i += 1
                    await asyncio.sleep(0.003)

        async def everyone() -> None:
            await asyncio.gather(*(one(c) for c in range(self.clients)))

        try:
            asyncio.run(everyone())
        except BaseException as err:  # surfaced by the test
            self.errors.append(err)

    def stop(self) -> None:
        self._halt.set()

    def finish(self, timeout: float) -> list[int]:
        self.stop()
        self.join(timeout)
        assert not self.is_alive(), "submissions still running"
        assert not self.errors, self.errors
        return list(self.acked)


async def wait_all(endpoint: str, ids: list[int], timeout: float) -> list[cronoq.WaitResult]:
    async with cronoq.Client(endpoint) as client:
        results: list[cronoq.WaitResult] = []
        for start in range(0, len(ids), 50):
            chunk = ids[start : start + 50]
            results += await asyncio.gather(*(client.wait(i, timeout=timeout) for i in chunk))
        return results


def list_pool(srv: ServerProcess, pool: str) -> list[task_pb2.Task]:
    stubs, tasks, token = Stubs(srv), [], ""
    while True:
        resp = stubs.tasks.ListTasks(tpb.ListTasksRequest(pool=pool, page_size=1000, page_token=token), timeout=TIMEOUT)
        tasks += resp.tasks
        token = resp.next_page_token
        if not token:
            return tasks


@pytest.mark.timeout(60)
def test_gpu_leader_sigkilled_while_cpu_forwards_submissions_to_it(
    tmp_path: Path, start_server: Any, request: Any
) -> None:
    """Four SDK clients submit `llm` tasks through cpu's server without pause; a worker
    process serves llm on gpu (both gpu servers configured); gpu's leader is SIGKILLed.

    gpu's [[shards]] endpoint is its standby gpu1, the server that survives: a shard's endpoint
    is one address, and a forwarder whose endpoint is dead cannot find another server of the
    shard (see test_a_shard_entirely_down...). Before the kill, gpu1 names gpu0 and the
    forwarder follows; between the kill and gpu1's takeover, forwarded calls are UNAVAILABLE
    and the SDK retries them with the same request_id; after it, gpu1 answers itself.
    Every acknowledged task exists once and completes exactly once."""
    pools = [{"name": "default"}, {"name": "llm", "lease_ttl": "5s"}]
    store = shard_store("postgres", tmp_path, request)
    deploy = Deployment(
        tmp_path, start_server, store, {"cpu": 1, "gpu": 2}, endpoint={"gpu": 1}, tokens=False, pools=pools
    )
    cpu, (gpu0, gpu1) = deploy.servers["cpu"][0], deploy.servers["gpu"]
    worker_log = tmp_path / "worker.log"
    worker = start_worker(f"{gpu0.endpoint},{gpu1.endpoint}", "llm", worker_log, concurrency=16)
    load = Load(cpu.endpoint, "llm", clients=4)
    load.start()
    try:
        eventually(lambda: len(load.acked) >= 150 and len(log_lines(worker_log, "done")) >= 50, timeout=20)
        assert not load.errors, load.errors
        killed_at = time.monotonic()
        gpu0.kill()
        eventually(lambda: is_leader(gpu1), timeout=10, interval=0.02, what="gpu1 leads")
        takeover = time.monotonic() - killed_at
        after = len(load.acked)
        eventually(lambda: len(load.acked) >= after + 150, timeout=20, what="submissions after the takeover")
        ids = load.finish(timeout=25)
        results = asyncio.run(wait_all(cpu.endpoint, ids, timeout=20))  # WaitTask forwarded by cpu
    finally:
        load.stop()
        worker.terminate()
        worker.wait(30)
    unavailable = metric(cpu, "cronoq_forwarded_calls_total", shard="gpu", code="UNAVAILABLE")
    print(
        f"\n{len(ids)} tasks acknowledged; gpu1 led {takeover:.2f}s after the kill; {unavailable:.0f} forwarded calls UNAVAILABLE"
    )
    assert unavailable >= 1  # submissions did meet the shard without a leader, and were retried
    assert len(set(ids)) == len(ids)
    assert all(i >> 56 == 2 for i in ids)
    not_done = [(r.task.id, r.task.state) for r in results if not (r.done and r.task.state == SUCCEEDED)]
    assert not not_done, f"{len(not_done)} acknowledged task(s) not SUCCEEDED: {not_done[:5]}"
    # No submission made a second task (a retry deduplicated by its request_id), and none was lost.
    stored = list_pool(gpu1, "llm")
    assert sorted(t.id for t in stored) == sorted(ids)
    assert all(t.state == SUCCEEDED for t in stored)
    # Each ran exactly once: one start and one done (a lease whose reply the kill lost is
    # leased again after its lease_ttl, as attempt 2: still one execution).
    starts = collections.Counter(t for t, _, _ in log_lines(worker_log, "start"))
    dones = collections.Counter(t for t, _, _ in log_lines(worker_log, "done"))
    wrong = [(i, starts[i], dones[i]) for i in ids if (starts[i], dones[i]) != (1, 1)]
    assert not wrong, f"tasks not run exactly once (id, starts, dones): {wrong[:5]}"
    assert takeover < 5.0


# -- 4. a shard entirely down ------------------------------------------------------------


class ShardDown:
    """cpu (one server) and gpu (two), some tasks, a schedule and a worker on each shard; then
    both gpu servers SIGKILLed."""

    def __init__(self, tmp_path: Path, launch: Launch, store: dict[str, Any]):
        self.deploy = Deployment(tmp_path, launch, store, {"cpu": 1, "gpu": 2})
        self.cpu_server = self.deploy.servers["cpu"][0]
        self.cpu = Stubs(self.cpu_server)
        gpu = Stubs(self.deploy.servers["gpu"][0])
        self.keyed = {k: submit(self.cpu, "default", key=k).task for k in ("held-by-cpu", "cancel-me")}
        self.cpu_tasks = [*self.keyed.values(), submit(self.cpu, "default").task]
        # Through cpu: its channel to gpu is connected when gpu goes down.
        self.gpu_task = submit(self.cpu, "llm", key="held-by-gpu").task
        for stubs, pool in ((self.cpu, "default"), (gpu, "llm")):
            schedule = spb.Schedule(pool=pool, name=f"{pool}-hourly", cron="0 * * * *")
            stubs.schedules.PutSchedule(spb.PutScheduleRequest(schedule=schedule), metadata=full_md(), timeout=TIMEOUT)
        self.workers = {
            pool: worker_service_pb2_grpc.WorkerServiceStub(stubs.channel)
            .RegisterWorker(wpb.RegisterWorkerRequest(name=f"w-{pool}", pools=[pool]), metadata=full_md())
            .worker_id
            for stubs, pool in ((self.cpu, "default"), (gpu, "llm"))
        }
        for srv in self.deploy.servers["gpu"]:
            srv.kill()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def shard_down(request: Any, tmp_path_factory: Any) -> Iterator[ShardDown]:
    """One deployment a store kind for the tests of this section (they only read it, or write
    to cpu what the others do not look at)."""
    workdir = tmp_path_factory.mktemp(f"shard-down-{request.param}")
    started: list[ServerProcess] = []

    def launch(config: dict[str, Any], shard: str | None, name: str, wait_ready: bool = True) -> ServerProcess:
        srv = ServerProcess(workdir, config, shard, name)
        started.append(srv)
        return srv.start(wait_ready)

    try:
        yield ShardDown(workdir, launch, shard_store(request.param, workdir, request))
    finally:
        for srv in started:
            srv.kill()


def assert_unavailable_gpu(call: Callable[[], Any]) -> None:
    started = time.monotonic()
    err = refusal(call)
    assert time.monotonic() - started < 2.0
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err  # type: ignore[attr-defined]
    assert "'gpu'" in err.details() and trailers(err)["cronoq-unavailable-shards"] == "gpu"  # type: ignore[attr-defined]


def test_a_shard_entirely_down_is_unavailable_by_name_and_the_other_serves_on(shard_down: ShardDown) -> None:
    cpu = shard_down.cpu
    for i in range(3):
        task = submit(cpu, "default", payload=b"%d" % i).task
        assert task.id >> 56 == 1 and get_task(cpu, task_pb2.TaskRef(id=task.id)).task.state == PENDING
        assert_unavailable_gpu(lambda: submit(cpu, "llm"))
    assert_unavailable_gpu(lambda: get_task(cpu, task_pb2.TaskRef(id=shard_down.gpu_task.id)))
    batch = tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="llm")] * 2)
    assert_unavailable_gpu(lambda: cpu.tasks.SubmitBatch(batch, metadata=full_md(), timeout=TIMEOUT))
    schedule = spb.Schedule(pool="llm", name="x", cron="0 * * * *")
    assert_unavailable_gpu(
        lambda: cpu.schedules.PutSchedule(
            spb.PutScheduleRequest(schedule=schedule), metadata=full_md(), timeout=TIMEOUT
        )
    )
    # cpu's own calls: by id, by key (the key is cpu's), a schedule.
    assert get_task(cpu, task_pb2.TaskRef(id=shard_down.cpu_tasks[-1].id)).task.state == PENDING
    status, headers, body = http(shard_down.cpu_server, "POST", "/v1/tasks", {"pool": "llm"})
    assert status == 503 and "'gpu'" in body["message"] and headers["cronoq-unavailable-shards"] == "gpu", body
    status, _, body = http(shard_down.cpu_server, "POST", "/v1/tasks", {"pool": "default"})
    assert status == 200 and int(body["task"]["id"]) >> 56 == 1, body
    # A caller that may not use llm learns nothing about where it is served, even now.
    err = refusal(lambda: submit(cpu, "llm", token="default-only"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "gpu" not in err.details()  # type: ignore[attr-defined]


def test_fan_out_reads_with_a_shard_down_answer_the_others_naming_it(shard_down: ShardDown) -> None:
    cpu, srv = shard_down.cpu, shard_down.cpu_server
    tasks = cpu.tasks.ListTasks(tpb.ListTasksRequest(page_size=1000), metadata=full_md(), timeout=TIMEOUT)
    assert list(tasks.unavailable_shards) == ["gpu"]
    listed = {t.id for t in tasks.tasks}
    assert {t.id for t in shard_down.cpu_tasks} <= listed and all(i >> 56 == 1 for i in listed)

    workers = worker_service_pb2_grpc.WorkerServiceStub(cpu.channel).ListWorkers(
        wpb.ListWorkersRequest(), metadata=full_md(), timeout=TIMEOUT
    )
    assert list(workers.unavailable_shards) == ["gpu"]
    assert [w.id for w in workers.workers] == [shard_down.workers["default"]]

    schedules = cpu.schedules.ListSchedules(spb.ListSchedulesRequest(), metadata=full_md(), timeout=TIMEOUT)
    assert list(schedules.unavailable_shards) == ["gpu"]
    assert [(s.pool, s.name) for s in schedules.schedules] == [("default", "default-hourly")]

    snapshot = admin_service_pb2_grpc.AdminServiceStub(cpu.channel).GetSnapshot(
        apb.GetSnapshotRequest(), metadata=full_md(), timeout=TIMEOUT
    )
    assert list(snapshot.unavailable_shards) == ["gpu"]

    for path in ("/v1/tasks", "/v1/workers", "/v1/schedules", "/v1/snapshot"):
        status, _, body = http(srv, "GET", path)
        assert status == 200 and body["unavailable_shards"] == ["gpu"], (path, body)


def unavailable_header(call: Any) -> str | None:
    md = dict(call.initial_metadata() or ()) | dict(call.trailing_metadata() or ())
    value = md.get("cronoq-unavailable-shards")
    return value.decode() if isinstance(value, bytes) else value


def test_reads_by_key_with_a_shard_down_answer_naming_it(shard_down: ShardDown) -> None:
    """The key is cpu's; gpu might hold it too, and cannot say: the answer names gpu."""
    cpu, held = shard_down.cpu, shard_down.keyed["held-by-cpu"]
    ref = task_pb2.TaskRef(key="held-by-cpu")
    got, call = cpu.tasks.GetTask.with_call(tpb.GetTaskRequest(task=ref), metadata=full_md(), timeout=TIMEOUT)
    assert got.task.id == held.id and list(got.unavailable_shards) == ["gpu"]
    assert unavailable_header(call) == "gpu"
    waited, call = cpu.tasks.WaitTask.with_call(
        tpb.WaitTaskRequest(task=ref, timeout_ms=100), metadata=full_md(), timeout=TIMEOUT
    )
    assert waited.task.id == held.id and not waited.done and list(waited.unavailable_shards) == ["gpu"]
    assert unavailable_header(call) == "gpu"
    status, headers, body = http(shard_down.cpu_server, "GET", "/v1/keys/held-by-cpu")
    assert status == 200 and int(body["task"]["id"]) == held.id and body["unavailable_shards"] == ["gpu"], body
    assert headers["cronoq-unavailable-shards"] == "gpu"


def test_cancel_by_key_with_a_shard_down_is_refused(shard_down: ShardDown) -> None:
    """Which shard's task the key names is not known while gpu is down: nothing is cancelled."""
    cpu, task = shard_down.cpu, shard_down.keyed["cancel-me"]
    err = refusal(
        lambda: cpu.tasks.CancelTask(
            tpb.CancelTaskRequest(task=task_pb2.TaskRef(key="cancel-me")), metadata=full_md(), timeout=TIMEOUT
        )
    )
    state = get_task(cpu, task_pb2.TaskRef(id=task.id)).task.state
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err  # type: ignore[attr-defined]
    assert "gpu" in err.details() or trailers(err).get("cronoq-unavailable-shards") == "gpu"  # type: ignore[attr-defined]
    assert state == PENDING
    status, _, body = http(shard_down.cpu_server, "POST", "/v1/keys/cancel-me/cancel")
    assert status == 503, body
    assert get_task(cpu, task_pb2.TaskRef(id=task.id)).task.state == PENDING


def test_with_a_shard_down_a_caller_that_may_read_none_of_it_learns_nothing_of_it(shard_down: ShardDown) -> None:
    """default-only reads pool default (cpu) only: that gpu is down is not its to know. Reads
    do not name it unavailable, and a gpu task id or key is, to it, a missing task."""
    cpu, srv, md = shard_down.cpu, shard_down.cpu_server, bearer("default-only")
    reads = {
        "ListTasks": cpu.tasks.ListTasks(tpb.ListTasksRequest(), metadata=md, timeout=TIMEOUT),
        "ListWorkers": worker_service_pb2_grpc.WorkerServiceStub(cpu.channel).ListWorkers(
            wpb.ListWorkersRequest(), metadata=md, timeout=TIMEOUT
        ),
        "ListSchedules": cpu.schedules.ListSchedules(spb.ListSchedulesRequest(), metadata=md, timeout=TIMEOUT),
        "GetSnapshot": admin_service_pb2_grpc.AdminServiceStub(cpu.channel).GetSnapshot(
            apb.GetSnapshotRequest(), metadata=md, timeout=TIMEOUT
        ),
    }
    for name, answer in reads.items():
        assert not answer.unavailable_shards and "gpu" not in str(answer), (name, answer)
    for path in ("/v1/tasks", "/v1/workers", "/v1/schedules", "/v1/snapshot"):
        status, headers, body = http(srv, "GET", path, token="default-only")
        assert status == 200 and not body.get("unavailable_shards"), (path, body)
        assert "cronoq-unavailable-shards" not in headers, path
    # A read of gpu's pool: refused for the pool, not for gpu being down.
    err = refusal(lambda: cpu.tasks.ListTasks(tpb.ListTasksRequest(pool="llm"), metadata=md, timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "gpu" not in err.details(), err  # type: ignore[attr-defined]

    gpu_id = shard_down.gpu_task.id
    for ref, message in ((task_pb2.TaskRef(id=gpu_id), f"task {gpu_id} not found"),
                         (task_pb2.TaskRef(key="held-by-gpu"), "no task with key 'held-by-gpu'")):  # fmt: skip
        err = refusal(lambda ref=ref: cpu.tasks.GetTask(tpb.GetTaskRequest(task=ref), metadata=md, timeout=TIMEOUT))
        assert err.code() == grpc.StatusCode.NOT_FOUND and err.details() == message, err  # type: ignore[attr-defined]
        assert not {"cronoq-shard", "cronoq-unavailable-shards"} & set(trailers(err)), trailers(err)
        err = refusal(
            lambda ref=ref: cpu.tasks.CancelTask(tpb.CancelTaskRequest(task=ref), metadata=md, timeout=TIMEOUT)
        )
        assert err.code() == grpc.StatusCode.NOT_FOUND and err.details() == message, err  # type: ignore[attr-defined]
    status, headers, body = http(srv, "GET", f"/v1/tasks/{gpu_id}", token="default-only")
    assert status == 404 and "gpu" not in body["message"] and "cronoq-unavailable-shards" not in headers, body


# -- a peer that is not a cronoq server -------------------------------------------------


@pytest.fixture
def foreign_peer() -> Iterator[str]:
    """A real gRPC server on loopback that serves no cronoq service: it answers every call
    UNIMPLEMENTED, as an older or a foreign server does. Yields its endpoint."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop(None)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_shard_answering_unimplemented_is_named_unavailable_in_fan_out_reads(
    tmp_path: Path, start_server: Any, request: Any, kind: str, foreign_peer: str
) -> None:
    cpu_listen = f"127.0.0.1:{free_port()}"
    config = sharded_config(tmp_path, cpu_listen, foreign_peer)
    config["store"] = shard_store(kind, tmp_path, request)
    srv = start_server({**config, "server": {"listen": cpu_listen}}, shard="cpu", name="cpu")
    cpu = Stubs(srv)
    held = submit(cpu, "default", key="held-by-cpu").task
    tasks = cpu.tasks.ListTasks(tpb.ListTasksRequest(), metadata=full_md(), timeout=TIMEOUT)
    assert list(tasks.unavailable_shards) == ["gpu"] and [t.id for t in tasks.tasks] == [held.id]
    newest = cpu.tasks.ListTasks(tpb.ListTasksRequest(newest_first=True), metadata=full_md(), timeout=TIMEOUT)
    assert list(newest.unavailable_shards) == ["gpu"] and [t.id for t in newest.tasks] == [held.id]
    workers = worker_service_pb2_grpc.WorkerServiceStub(cpu.channel).ListWorkers(
        wpb.ListWorkersRequest(), metadata=full_md(), timeout=TIMEOUT
    )
    assert list(workers.unavailable_shards) == ["gpu"]
    for path in ("/v1/tasks", "/v1/tasks?newest_first=true", "/v1/schedules", "/v1/snapshot"):
        status, _, body = http(srv, "GET", path)
        assert status == 200 and body["unavailable_shards"] == ["gpu"], (path, body)
    got = get_task(cpu, task_pb2.TaskRef(key="held-by-cpu"))
    assert got.task.id == held.id and list(got.unavailable_shards) == ["gpu"]
    # A call for that shard alone still says what it answered, naming it.
    err = refusal(lambda: submit(cpu, "llm"))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED and "'gpu'" in err.details(), err  # type: ignore[attr-defined]
    status, _, body = http(srv, "POST", "/v1/tasks", {"pool": "llm"})
    assert status == 501 and "'gpu'" in body["message"], body
