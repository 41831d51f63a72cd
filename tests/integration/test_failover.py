"""High availability: one leader per store, standbys that take over, fencing,
and clients and workers that ride through it. Real servers, a real PostgreSQL."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from _helpers import eventually, log_lines, start_worker

import cronoq

SUCCEEDED = cronoq.TaskState.Value("TASK_STATE_SUCCEEDED")


def is_leader(srv: Any) -> bool:
    try:
        with urllib.request.urlopen(srv.http_url + "/readyz", timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False


def start_replicas(start_server: Any, config: dict[str, Any], n: int = 3) -> list[Any]:
    first = start_server(config, name="replica0")  # waits until it leads
    others = [start_server(config, name=f"replica{i}", wait_ready=False) for i in range(1, n)]
    for srv in others:
        srv.wait_ready(leader=False)
    assert not any(is_leader(s) for s in others)
    return [first, *others]


def endpoints(servers: list[Any]) -> str:
    return ",".join(s.endpoint for s in servers)


def pg_config(pg: Any, **pool: Any) -> dict[str, Any]:
    return {
        "store": {"kind": "postgres", "url": pg.url, "schema": f"ha_{uuid.uuid4().hex[:10]}"},
        "pools": [{"name": "default", "lease_ttl": "30s", **pool}],
        "limits": {"max_batch_size": 100},
    }


class Submitter(threading.Thread):
    """Submits keyed tasks one by one through every endpoint, recording each acknowledgement,
    then waits for every acknowledged task (one event loop: grpc.aio wants one at a time)."""

    def __init__(self, endpoint_list: str, total: int, pause: float = 0.003):
        super().__init__(daemon=True)
        self.endpoints, self.total, self.pause = endpoint_list, total, pause
        self.acknowledged: dict[str, int] = {}
        self.results: list[cronoq.WaitResult] = []
        self.errors: list[BaseException] = []

    def run(self) -> None:
        async def submit_all() -> None:
            retry = cronoq.RetryConfig(initial_backoff=0.05, max_backoff=0.5, max_elapsed=30)
            async with cronoq.Client(self.endpoints, retry=retry) as client:
                for i in range(self.total):
                    key = f"job-{i}"
                    sub = await client.submit("default", {"i": i}, key=key)
                    self.acknowledged[key] = sub.task.id
                    await asyncio.sleep(self.pause)
                for task_id in self.acknowledged.values():
                    self.results.append(await client.wait(task_id, timeout=60))

        try:
            asyncio.run(submit_all())
        except BaseException as err:  # surfaced by the test
            self.errors.append(err)


def assert_all_succeeded(results: list[cronoq.WaitResult]) -> None:
    missing = [r.task.id for r in results if not (r.done and r.task.state == SUCCEEDED)]
    assert not missing, f"{len(missing)} acknowledged task(s) not SUCCEEDED, e.g. {missing[:5]}"


def assert_each_ran_once(logs: list[Path], ids: list[int]) -> None:
    done = collections.Counter(t for log in logs for t, _, _ in log_lines(log, "done"))
    twice = [t for t in ids if done[t] != 1]
    assert not twice, f"tasks not completed exactly once: {[(t, done[t]) for t in twice[:5]]}"


@contextlib.contextmanager
def under_load(servers: list[Any], tmp_path: Path, total: int) -> Iterator[tuple[Submitter, list[Path]]]:
    """One submitter of `total` tasks and two worker processes on every server's endpoint,
    running once the first third is acknowledged; the workers are stopped on the way out."""
    ep = endpoints(servers)
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [start_worker(ep, "default", log, concurrency=16) for log in logs]
    submitter = Submitter(ep, total)
    submitter.start()
    try:
        eventually(lambda: len(submitter.acknowledged) >= total // 3, timeout=30, what="first third submitted")
        yield submitter, logs
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(30)


def run_failover(
    servers: list[Any], tmp_path: Path, fault: Any, total: int = 400, same_may_lead: bool = False
) -> float:
    """Load (one submitter, two workers) across a fault on the leader; returns the takeover time.

    same_may_lead: the fault leaves the old leader's process alive, so it may win again.
    """
    with under_load(servers, tmp_path, total) as (submitter, logs):
        started = time.monotonic()
        fault(servers[0])
        if same_may_lead:
            eventually(lambda: "lost leadership" in servers[0].log(), timeout=10, interval=0.02, what="step down")
        candidates = servers if same_may_lead else servers[1:]
        new_leader = eventually(
            lambda: next((s for s in candidates if is_leader(s)), None),
            timeout=10,
            interval=0.02,
            what="a server leads again",
        )
        takeover = time.monotonic() - started
        print(f"\nstandby {new_leader.name} leads {takeover:.2f}s after the fault")
        submitter.join(90)
        assert not submitter.is_alive() and not submitter.errors, submitter.errors
        ids = list(submitter.acknowledged.values())
        assert len(ids) == total and len(submitter.results) == total
        assert_all_succeeded(submitter.results)
    assert_each_ran_once(logs, ids)
    return takeover


def test_postgres_sigkill_leader_under_load(start_server, postgres, tmp_path):
    servers = start_replicas(start_server, pg_config(postgres))
    takeover = run_failover(servers, tmp_path, lambda leader: leader.kill())
    assert takeover < 2.0, f"takeover took {takeover:.2f}s"


def test_postgres_sigterm_leader_hands_over(start_server, postgres, tmp_path):
    servers = start_replicas(start_server, pg_config(postgres))

    def sigterm(leader: Any) -> None:
        leader.signal(signal.SIGTERM)

    takeover = run_failover(servers, tmp_path, sigterm)
    assert servers[0].proc.wait(20) == 0
    assert "leadership released" in servers[0].log()
    assert takeover < 2.0


def test_sqlite_sigkill_leader_standby_on_the_same_file(start_server, tmp_path):
    config = {"store": {"path": str(tmp_path / "shared.db")}, "pools": [{"name": "default", "lease_ttl": "30s"}]}
    servers = start_replicas(start_server, config, n=2)
    takeover = run_failover(servers, tmp_path, lambda leader: leader.kill(), total=300)
    assert takeover < 2.0


def test_standby_answers_unavailable_naming_the_leader(start_server, postgres):
    leader, standby, _ = start_replicas(start_server, pg_config(postgres))
    status, body = standby.http("POST", "/v1/tasks", {"pool": "default"})
    assert status == 503 and body["code"] == "UNAVAILABLE"
    assert standby.http("GET", "/readyz")[0] == 503
    info = eventually(
        lambda: (lambda i: i if i["leader"] else None)(standby.http("GET", "/v1/info")[1]), what="leader known"
    )
    assert info["role"] == "ROLE_STANDBY" and info["leader"] == leader.endpoint
    with cronoq.SyncClient(standby.endpoint) as client:  # follows cronoq-leader by itself
        assert client.submit("default", {"via": "standby"}).task.id > 0


async def _leader_lock_pid(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND mode = 'ExclusiveLock'"
            " AND objid <> 0 ORDER BY pid LIMIT 1"
        )
    finally:
        await conn.close()


async def _terminate(url: str, pid: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SELECT pg_terminate_backend($1)", pid)
    finally:
        await conn.close()


async def _term(url: str, schema: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(f'SELECT term FROM "{schema}".leader WHERE id = 1')
    finally:
        await conn.close()


def test_terminated_lock_connection_steps_down_and_fences(start_server, postgres, tmp_path):
    config = pg_config(postgres)
    schema = config["store"]["schema"]
    servers = start_replicas(start_server, config)
    term_before = asyncio.run(_term(postgres.url, schema))

    def terminate_lock(leader: Any) -> None:
        pid = asyncio.run(_leader_lock_pid(postgres.url))
        asyncio.run(_terminate(postgres.url, pid))

    # Every task is leased once: no attempt 2 anywhere, and each completes exactly once.
    run_failover(servers, tmp_path, terminate_lock, total=300, same_may_lead=True)
    assert asyncio.run(_term(postgres.url, schema)) > term_before
    starts = [a for log in tmp_path.glob("worker*.log") for _, a, _ in log_lines(log, "start")]
    assert starts and set(starts) == {1}


def test_postgres_restart_during_load(start_server, postgres, tmp_path):
    servers = start_replicas(start_server, pg_config(postgres), n=2)
    run_failover(servers, tmp_path, lambda leader: postgres.restart(), total=300, same_may_lead=True)


@pytest.mark.asyncio
async def test_store_refuses_writes_from_an_old_term(postgres):
    from cronoq_server.core.retry import make_retry_at
    from cronoq_server.store.base import Fenced, NewTask, StoreSettings
    from cronoq_server.store.postgres import PostgresStore

    settings = StoreSettings("unsharded", 0, {"default": 10**7}, {"default": 10**9}, make_retry_at({}))
    schema = f"fence_{uuid.uuid4().hex[:8]}"
    old, new = PostgresStore(postgres.url, schema, settings), PostgresStore(postgres.url, schema, settings)
    await old.open()
    await new.open()
    try:
        old.term = 1
        conn = await asyncpg.connect(postgres.url)
        await conn.execute(f'UPDATE "{schema}".leader SET term = 1')
        task = NewTask("default", None, b"", "", 0, None, 3)
        await old.submit([task], 1)  # its own term: accepted
        await conn.execute(f'UPDATE "{schema}".leader SET term = 2')  # a new leader took over
        await conn.close()
        new.term = 2
        with pytest.raises(Fenced):
            await old.submit([task], 2)
        with pytest.raises(Fenced):
            await old.lease("w", ["default"], 10, 2)
        assert len(await new.list_tasks(None, None, 0, 10)) == 1
        assert len((await new.lease("w", ["default"], 10, 3))[0]) == 1
    finally:
        await old.close()
        await new.close()


async def _insert_task_behind_the_servers_back(url: str, schema: str, notify: bool) -> None:
    conn = await asyncpg.connect(url)
    try:
        now = int(time.time() * 1e6)
        await conn.execute(
            f'INSERT INTO "{schema}".tasks (pool, payload, run_at, max_attempts, state, created_at)'
            " VALUES ('default', '', $1, 3, 1, $1)",
            now,
        )
        if notify:
            await conn.execute("SELECT pg_notify($1, '')", f"cronoq_{schema}")
    finally:
        await conn.close()


@pytest.mark.parametrize("notify", [True, False], ids=["notify", "polling-fallback"])
def test_lease_long_poll_wakes_on_notify_or_falls_back_to_polling(start_server, postgres, notify):
    from test_lifecycle import Api

    from cronoq.v1 import worker_service_pb2 as wpb

    config = pg_config(postgres)
    server = start_server(config)
    api = Api(server.grpc_target)
    worker = api.register()
    poll = api.workers.LeaseTasks.future(wpb.LeaseTasksRequest(worker_id=worker, max_tasks=1, wait_ms=10_000))
    time.sleep(0.3)
    started = time.monotonic()
    asyncio.run(_insert_task_behind_the_servers_back(postgres.url, config["store"]["schema"], notify))
    leased = poll.result(timeout=10).tasks
    waited = time.monotonic() - started
    assert len(leased) == 1
    assert waited < (0.3 if notify else 1.5), f"leased after {waited:.2f}s"


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_snapshot_names_the_standbys_and_forgets_one_that_stopped(start_server, tmp_path, request, kind):
    if kind == "postgres":
        config = pg_config(request.getfixturevalue("postgres"))
    else:
        config = {"store": {"path": str(tmp_path / "shared.db")}, "pools": [{"name": "default"}]}
    leader, *standbys = start_replicas(start_server, config, n=3)

    def named() -> list[str]:
        status, body = leader.http("GET", "/v1/snapshot")
        assert status == 200, body
        return sorted(body["shards"][0].get("standbys", []))

    advertised = sorted(s.endpoint for s in standbys)
    eventually(lambda: named() == advertised, timeout=10, what=f"standbys {advertised} named")
    standbys[0].kill()
    eventually(lambda: named() == [standbys[1].endpoint], timeout=15, what="the stopped standby forgotten")
