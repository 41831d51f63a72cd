"""Upgrades (docs/operations.md): a store made by the last release (0.1.0, commit a5189c4;
tests/fixtures/make_release_store.py tells how) is migrated by this server at start, which
then serves every task in the state it had. SQLite: a copy of the release's file; PostgreSQL:
the release's plain pg_dump restored with psql into a fresh database."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _helpers import Api
from pgserver import find_bin_dir
from test_schema_version import POSTGRES_LATEST, SQLITE_LATEST, sqlite_version
from test_sharding_faults import fresh_database, pg_fetch

from cronoq.v1 import task_pb2

pytestmark = pytest.mark.timeout(90)
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "release-0.1.0.json").read_text())
RELEASE_SCHEMA = "cronoq_release"  # the schema the release's dump holds
POOLS = [{"name": "default", "lease_ttl": "1d"}, {"name": "reports"}]


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
    srv = start_server({"store": {"kind": "postgres", "url": url, "schema": RELEASE_SCHEMA}, "pools": POOLS})
    assert_serves_release_tasks(srv, EXPECTED["postgres"])
    assert srv.stop() == 0
    versions = [r[0] for r in pg_fetch(url, f"SELECT version FROM {RELEASE_SCHEMA}.migrations ORDER BY version")]
    assert versions == list(range(1, POSTGRES_LATEST + 1))
