"""Upgrades (docs/operations.md): a store made by the last release (0.1.0, commit a5189c4;
tests/fixtures/make_release_store.py tells how) is migrated by this server at start, which
then serves every task in the state it had. SQLite: a copy of the release's file; PostgreSQL:
the release's plain pg_dump restored with psql into a fresh database."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import Api, store_table
from conftest import REPO, ServerProcess  # type: ignore[import-not-found]
from pgserver import find_bin_dir
from preconditions import missing
from test_schema_version import POSTGRES_LATEST, SQLITE_LATEST, sqlite_version
from test_sharding_faults import fresh_database, pg_fetch

from cronoq.v1 import task_pb2

pytestmark = pytest.mark.timeout(90)
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "release-0.1.0.json").read_text())
RELEASE_SCHEMA = "cronoq_release"  # the schema the release's dump holds
RELEASE_COMMIT = "a5189c4"  # release 0.1.0, whose stores tests/fixtures keeps
POOLS = [{"name": "default", "lease_ttl": "1d"}, {"name": "reports"}]
# The release's RUNNING task holds a lease of a day from when the fixture was made: it is moved
# a year past today, so what the test expects does not depend on the day it runs.
RENEW_LEASES = "UPDATE {tasks} SET lease_expires_at = {until} WHERE state = 3"


def renew_leases(run: Any, tasks: str) -> None:
    run(RENEW_LEASES.format(tasks=tasks, until=int((time.time() + 365 * 86400) * 1e6)))


def assert_serves_release_tasks(srv: Any, expected: dict[str, Any]) -> None:
    api = Api(srv.grpc_target)
    for name, want in expected.items():
        task = api.get(int(want["id"]))
        got = {"id": str(task.id), "key": task.key, "pool": task.pool, "state": task_pb2.TaskState.Name(task.state)}
        assert got == want, name
    status, listed = srv.http("GET", "/v1/tasks")
    assert status == 200
    assert sorted(int(t["id"]) for t in listed["tasks"]) == sorted(int(w["id"]) for w in expected.values())
    # The new server works the migrated store: the pending task is leased and finished.
    worker = api.register()
    pending = int(expected["pending"]["id"])
    leased = [t for t in api.lease(worker, n=10) if t.id == pending]
    assert leased and api.succeed(worker, leased[0]).accepted
    assert api.get(pending).state == task_pb2.TASK_STATE_SUCCEEDED


def test_sqlite_store_of_the_last_release_is_migrated(start_server: Any, tmp_path: Path) -> None:
    path = tmp_path / "cronoq.db"
    shutil.copy(FIXTURES / "release-0.1.0.db", path)
    assert sqlite_version(path) < SQLITE_LATEST
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        renew_leases(db.execute, "tasks")
    srv = start_server({"store": {"path": str(path)}, "pools": POOLS})
    assert_serves_release_tasks(srv, EXPECTED["sqlite"])
    assert srv.stop() == 0
    assert sqlite_version(path) == SQLITE_LATEST


def test_postgres_schema_of_the_last_release_is_migrated(start_server: Any, postgres: Any) -> None:
    url = fresh_database(postgres)
    bin_dir = find_bin_dir()
    assert bin_dir is not None
    subprocess.run(
        [str(bin_dir / "psql"), "-v", "ON_ERROR_STOP=1", "-q", "-f", str(FIXTURES / "release-0.1.0.pg.sql"), url],
        check=True,
        capture_output=True,
    )
    versions = [r[0] for r in pg_fetch(url, f"SELECT version FROM {RELEASE_SCHEMA}.migrations")]
    assert max(versions) < POSTGRES_LATEST
    renew_leases(lambda sql: pg_fetch(url, sql), f"{RELEASE_SCHEMA}.tasks")
    srv = start_server({"store": {"kind": "postgres", "url": url, "schema": RELEASE_SCHEMA}, "pools": POOLS})
    assert_serves_release_tasks(srv, EXPECTED["postgres"])
    assert srv.stop() == 0
    versions = [r[0] for r in pg_fetch(url, f"SELECT version FROM {RELEASE_SCHEMA}.migrations ORDER BY version")]
    assert versions == list(range(1, POSTGRES_LATEST + 1))


@pytest.fixture(scope="module")
def release(tmp_path_factory: Any) -> Path:
    """The last release's code (a5189c4), exported from this repository's history."""
    if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{RELEASE_COMMIT}^{{commit}}"]).returncode != 0:
        missing(f"commit {RELEASE_COMMIT} (release 0.1.0) not in this clone: fetch its full history")
    tree = tmp_path_factory.mktemp("release")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", RELEASE_COMMIT, "server", "proto/python"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def start_release(srv: ServerProcess, tree: Path) -> ServerProcess:
    """srv's config served by the release's code instead of this checkout's."""
    cmd = [sys.executable, "-m", "cronoq_server.main", "--config", str(srv.config_path)]
    env = {**os.environ, "PYTHONPATH": f"{tree}/server{os.pathsep}{tree}/proto/python"}
    srv.proc = subprocess.Popen(
        cmd, stdout=open(srv.log_path, "ab"), stderr=subprocess.STDOUT, cwd=srv.workdir, env=env
    )
    return srv


def store_version(kind: str, store: dict[str, Any]) -> int:
    if kind == "sqlite":
        return sqlite_version(Path(store["path"]))
    return int(pg_fetch(store["url"], f"SELECT max(version) FROM {store['schema']}.migrations")[0][0])


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_rolling_upgrade_from_the_last_release(release: Path, tmp_path: Path, request: Any, kind: str) -> None:
    """The README's order: a standby of this version joins a leader of the last release and
    migrates the store; the old leader goes on serving on it; when it stops, the new one leads
    and serves every task."""
    store = store_table(kind, request, tmp_path / "cronoq.db")
    config = {"store": store, "pools": POOLS}
    servers: list[ServerProcess] = []
    try:
        old = start_release(ServerProcess(tmp_path, config, name="old"), release)
        servers.append(old)
        old.wait_ready()
        assert "cronoq-server 0.1.0" in old.log()
        api = Api(old.grpc_target)
        before = api.submit(payload=b"before")
        new = ServerProcess(tmp_path, config, name="new").start(wait_ready=False)
        servers.append(new)
        new.wait_ready(leader=False)
        latest = SQLITE_LATEST if kind == "sqlite" else POSTGRES_LATEST
        # A standby answers /healthz before it has opened (and migrated) the store.
        deadline = time.monotonic() + 20
        while store_version(kind, store) != latest and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store_version(kind, store) == latest
        during = api.submit(payload=b"during")  # the old leader, on the migrated store
        worker = api.register()
        leased = {t.id: t for t in api.lease(worker, n=10)}
        assert set(leased) == {before.id, during.id}
        assert api.succeed(worker, leased[before.id]).accepted
        assert old.stop() == 0
        new.wait_ready()
        api = Api(new.grpc_target)
        assert api.get(before.id).state == task_pb2.TASK_STATE_SUCCEEDED
        assert api.get(during.id).state == task_pb2.TASK_STATE_RUNNING
        after = api.submit(payload=b"after")
        assert api.get(after.id).state == task_pb2.TASK_STATE_PENDING
        # 0.1.0 predates the check of the schema version: started again, it waits as a standby
        # (later versions refuse a newer store: test_schema_version.py). It changes nothing.
        again = start_release(ServerProcess(tmp_path, config, name="old-again"), release)
        servers.append(again)
        again.wait_ready(leader=False)
        assert new.stop() == 0
        again.stop()
        newest = ServerProcess(tmp_path, config, name="newest").start(wait_ready=False)
        servers.append(newest)
        newest.wait_ready()
        assert Api(newest.grpc_target).get(after.id).state == task_pb2.TASK_STATE_PENDING
        assert newest.stop() == 0
        assert store_version(kind, store) == (SQLITE_LATEST if kind == "sqlite" else POSTGRES_LATEST)
    finally:
        for srv in servers:
            srv.kill()
