"""The procedures of docs/operations.md, each with real server processes: the PostgreSQL pool
size, the JSON log, backups of a live SQLite store and of a PostgreSQL schema, and the
systemd unit in deploy/systemd."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import json
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from _helpers import Api, eventually
from conftest import ServerProcess  # type: ignore[import-not-found]
from pgserver import find_bin_dir
from test_sharding_faults import fresh_database, pg_fetch

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent.parent


def test_postgres_pool_size_bounds_the_leaders_connections(start_server: Any, postgres: Any) -> None:
    """With every query of the server held on a lock, the calls in flight wait for the pool:
    exactly store.pool_size connections of the server wait, whatever the number of calls."""
    url = fresh_database(postgres)
    database = url.rsplit("/", 1)[1]
    srv = start_server({"store": {"kind": "postgres", "url": url, "pool_size": 3}})
    api = Api(srv.grpc_target)
    task = api.submit(payload=b"x")

    query = "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'"

    async def count_waiting_while_locked(threads: concurrent.futures.Executor) -> tuple[int, list[Any]]:
        conn = await asyncpg.connect(url)
        try:
            async with conn.transaction():
                await conn.execute("LOCK TABLE cronoq.tasks IN ACCESS EXCLUSIVE MODE")
                calls = [threads.submit(api.get, task.id) for _ in range(12)]
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and await conn.fetchval(query, database) < 3:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)  # more calls had time to take connections, were there more
                return await conn.fetchval(query, database), calls
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(12) as threads:
        waiting, calls = asyncio.run(count_waiting_while_locked(threads))
        assert [call.result(timeout=30).id for call in calls] == [task.id] * 12
    assert waiting == 3
    assert srv.stop() == 0


def json_lines(srv: Any) -> list[dict[str, Any]]:
    lines = srv.log().splitlines()
    parsed = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all(isinstance(entry, dict) for entry in parsed)
    return parsed


@pytest.mark.parametrize("how", ["config", "flag"])
def test_json_log_is_one_object_a_line_with_the_exception_as_a_field(
    start_server: Any, tmp_path: Path, how: str
) -> None:
    path = tmp_path / "cronoq.db"
    server = {"log_format": "json"} if how == "config" else {}
    srv = ServerProcess(tmp_path, {"server": server, "store": {"path": str(path)}})
    srv.start(wait_ready=False, extra_args=["--log-format", "json"] if how == "flag" else [])
    try:
        srv.wait_ready()
        # A table dropped under the server: the next read fails inside the server and is logged.
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute("DROP TABLE schedules")
        status, _ = srv.http("GET", "/v1/schedules")
        assert status == 500
        eventually(lambda: any("exception" in e for e in json_lines(srv)), what="the failure logged")
    finally:
        assert srv.stop() == 0
    entries = json_lines(srv)
    startup = next(e for e in entries if e["logger"] == "cronoq.server" and "gRPC" in e["message"])
    assert {"time", "level", "logger", "message", "shard"} <= set(startup)
    assert startup["level"] == "INFO" and startup["shard"] == "unsharded"
    assert datetime.datetime.fromisoformat(startup["time"]).tzinfo is not None
    failure = next(e for e in entries if "exception" in e)
    assert failure["level"] == "ERROR"
    assert "Traceback" in failure["exception"] and "schedules" in failure["exception"]
    assert entries[-1]["message"] == "shard unsharded: stopped"


class BurnDown:
    """Submissions and a worker finishing them, each in a thread of its own, until stopped; the
    ids of the submissions acknowledged so far are in `acknowledged`."""

    def __init__(self, target: str):
        self.target = target
        self.acknowledged: list[int] = []
        self.finished = 0
        self.running = True
        self.threads = [threading.Thread(target=self._submit), threading.Thread(target=self._work)]

    def __enter__(self) -> BurnDown:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.running = False
        for thread in self.threads:
            thread.join(30)

    def _submit(self) -> None:
        api = Api(self.target)
        while self.running:
            batch = [tpb.SubmitTaskRequest(pool="default", payload=b"p" * 512) for _ in range(20)]
            tasks = api.tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=batch)).tasks
            self.acknowledged += [t.id for t in tasks]

    def _work(self) -> None:
        api = Api(self.target)
        worker = api.register()
        while self.running:
            leased = api.lease(worker, n=20, wait_ms=200)
            assert all(result.accepted for result in succeed_all(api, worker, leased))
            self.finished += len(leased)


class Backup:
    """One store of each kind, backed up and restored as docs/operations.md says."""

    def __init__(self, kind: str, tmp_path: Path, request: Any):
        self.kind = kind
        self.tmp_path = tmp_path
        if kind == "postgres":
            self.pg = request.getfixturevalue("postgres")
            self.bin_dir = find_bin_dir()
            self.url, self.restored_url = fresh_database(self.pg), fresh_database(self.pg)

    def store(self, restored: bool = False) -> dict[str, Any]:
        if self.kind == "postgres":
            return {"kind": "postgres", "url": self.restored_url if restored else self.url}
        return {"path": str(self.tmp_path / ("restored.db" if restored else "cronoq.db"))}

    def back_up(self, srv: Any) -> None:
        if self.kind == "sqlite":
            copy = cli_backup(srv, "--to", str(self.tmp_path / "restored.db"))
            assert copy.returncode == 0, copy.stderr
            assert copy.stdout.startswith(f"backed up store {self.tmp_path / 'cronoq.db'} to ")
            return
        dump = ["pg_dump", "--schema=cronoq", "--format=custom", f"--file={self.tmp_path / 'cronoq.dump'}", self.url]
        subprocess.run([str(self.bin_dir / dump[0]), *dump[1:]], check=True, capture_output=True, timeout=60)

    def restore(self) -> int:
        """Puts the backup in place; returns how many tasks it holds."""
        if self.kind == "sqlite":
            with contextlib.closing(sqlite3.connect(self.tmp_path / "restored.db")) as db:
                assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
                return int(db.execute("SELECT count(*) FROM tasks").fetchone()[0])
        restore = ["pg_restore", "--no-owner", "--exit-on-error", f"--dbname={self.restored_url}"]
        subprocess.run(
            [str(self.bin_dir / restore[0]), *restore[1:], str(self.tmp_path / "cronoq.dump")],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return int(pg_fetch(self.restored_url, "SELECT count(*) FROM cronoq.tasks")[0][0])


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_backup_of_a_live_store_restores_every_acknowledged_task(
    start_server: Any, tmp_path: Path, request: Any, kind: str
) -> None:
    backup = Backup(kind, tmp_path, request)
    pools = [{"name": "default", "lease_ttl": "5s"}]
    srv = start_server({"store": backup.store(), "pools": pools})
    with BurnDown(srv.grpc_target) as burn:
        eventually(lambda: len(burn.acknowledged) >= 600 and burn.finished >= 200, timeout=60, what="a burn-down")
        acknowledged_before, finished_before = set(burn.acknowledged), burn.finished
        backup.back_up(srv)
        eventually(lambda: len(burn.acknowledged) > len(acknowledged_before) + 100, what="more submissions")
    assert srv.stop() == 0
    held = backup.restore()
    # Restore: a server on the copy serves every task acknowledged before the backup began...
    restored = start_server({"store": backup.store(restored=True), "pools": pools}, name="restored")
    api = Api(restored.grpc_target)
    served = list_all(api)
    assert acknowledged_before <= set(served)
    assert len(served) == held
    succeeded = [i for i in acknowledged_before if served[i] == task_pb2.TASK_STATE_SUCCEEDED]
    assert len(succeeded) >= finished_before
    # ...and its state is whole: a worker finishes every task the copy holds unfinished
    # (the tasks the copy holds leased come back when their 5 s leases expire).
    worker = api.register()

    def burnt_down() -> bool:
        assert all(result.accepted for result in succeed_all(api, worker, api.lease(worker, n=100, wait_ms=500)))
        return set(list_all(api).values()) == {task_pb2.TASK_STATE_SUCCEEDED}

    eventually(burnt_down, timeout=60, what="the restored store burnt down")
    assert restored.stop() == 0


def succeed_all(api: Api, worker: str, tasks: list[task_pb2.Task]) -> list[wpb.FinishTaskResult]:
    """One FinishTasks call for all of them."""
    success = wpb.TaskSuccess(result=b"ok")
    outcomes = [wpb.TaskOutcome(task_id=t.id, attempt=t.attempt, success=success) for t in tasks]
    return list(api.workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=outcomes)).results)


def list_all(api: Api) -> dict[int, int]:
    """Every task's state, by id."""
    states: dict[int, int] = {}
    token = ""
    while True:
        page = api.tasks.ListTasks(tpb.ListTasksRequest(page_size=1000, page_token=token))
        states.update((t.id, t.state) for t in page.tasks)
        if not (token := page.next_page_token):
            return states


def cli_backup(srv: Any, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cronoq_server.main", "backup", "--config", str(srv.config_path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_backup_refuses_an_existing_file_a_missing_store_and_postgres(tmp_path: Path) -> None:
    path = tmp_path / "cronoq.db"
    srv = ServerProcess(tmp_path, {"store": {"path": str(path)}})
    missing = cli_backup(srv, "--to", str(tmp_path / "copy.db"))
    assert (missing.returncode, missing.stderr) == (
        2,
        f"cronoq-server backup: store {path}: no such file (is --config the server's?)\n",
    )
    assert not path.exists()  # no empty store made in its place
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        db.execute("CREATE TABLE tasks (seq INTEGER PRIMARY KEY)")
        db.execute("INSERT INTO meta VALUES ('schema_version', '6')")
        db.commit()
    existing = tmp_path / "existing.db"
    existing.write_bytes(b"keep me")
    refused = cli_backup(srv, "--to", str(existing))
    assert (refused.returncode, refused.stderr) == (
        2,
        f"cronoq-server backup: --to {existing}: exists (give --force to replace it)\n",
    )
    assert existing.read_bytes() == b"keep me"
    forced = cli_backup(srv, "--to", str(existing), "--force")
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout == f"backed up store {path} to {existing}: 0 tasks, schema version 6\n"
    assert sorted(p.name for p in tmp_path.iterdir() if ".partial" in p.name) == []
    sharded = {
        "store": {"path": str(tmp_path / "{shard}.db")},
        "pools": [{"name": "default"}],
        "shards": [{"name": "cpu", "number": 1, "pools": ["default"], "endpoint": "http://127.0.0.1:1"}],
    }
    shard = ServerProcess(tmp_path, sharded, name="sharded")
    unnamed = cli_backup(shard, "--to", str(tmp_path / "cpu-copy.db"))
    assert unnamed.returncode == 2
    assert "--shard is required with [[shards]] (one of: cpu)" in unnamed.stderr
    shutil.copy(path, tmp_path / "cpu.db")
    named = cli_backup(shard, "--shard", "cpu", "--to", str(tmp_path / "cpu-copy.db"))
    assert named.returncode == 0, named.stderr
    assert named.stdout.startswith(f"backed up store {tmp_path / 'cpu.db'} to {tmp_path / 'cpu-copy.db'}: ")
    pg = ServerProcess(
        tmp_path, {"store": {"kind": "postgres", "url": "postgresql://x/y", "schema": "jobs"}}, name="pg"
    )
    to_pg = cli_backup(pg, "--to", str(tmp_path / "pg.db"))
    assert to_pg.returncode == 2
    assert to_pg.stderr == (
        "cronoq-server backup: store.kind is postgres: back up its schema with pg_dump --schema=jobs "
        "--format=custom (see docs/operations.md)\n"
    )


def test_memory_bench_gives_the_sizing_figures() -> None:
    """bench/memory.py, whose figures docs/operations.md quotes, on a small scale."""
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "memory.py"), "--connections", "3", "--watches", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.splitlines()[-1])
    assert figures["base_rss_mib"] > 10
    assert {"kib_per_connection", "kib_per_watch_stream"} <= set(figures)


def test_json_log_lines_name_the_worker_and_the_task(tmp_path: Path) -> None:
    """A worker's lines carry worker_id and a task's task_id (and attempt): a log pipeline joins
    them with the workers' own lines, which the SDKs log with the same fields."""
    config = {
        "server": {"log_format": "json"},
        "store": {"path": str(tmp_path / "cronoq.db")},
        "pools": [{"name": "default", "lease_ttl": "300ms"}],
    }
    srv = ServerProcess(tmp_path, config).start()
    try:
        api = Api(srv.grpc_target)
        worker = api.register()
        task = api.submit()
        assert [t.id for t in api.lease(worker, wait_ms=5000)] == [task.id]  # and no heartbeat
        expired = eventually(
            lambda: next((e for e in json_lines(srv) if e.get("task_id") == str(task.id)), None),
            what="the expired lease logged",
        )
    finally:
        assert srv.stop() == 0
    assert expired["attempt"] == 1 and "lease of attempt 1 expired" in expired["message"]
    registered = next(e for e in json_lines(srv) if "registered" in e["message"])
    assert registered["worker_id"] == worker and registered["shard"] == "unsharded"
