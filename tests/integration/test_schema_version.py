"""A server refuses a store whose schema is newer than it knows (written by a newer
cronoq-server): exit 2, one ERROR line naming both versions, the recorded version unchanged.
It never lowers the recorded version. Real servers, a real SQLite file, a real PostgreSQL."""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest
from _helpers import store_table
from test_failover import is_leader
from test_sharding_faults import assert_refused_store, pg_fetch

from cronoq_server.store.postgres import MIGRATIONS as POSTGRES_MIGRATIONS
from cronoq_server.store.sqlite import MIGRATIONS as SQLITE_MIGRATIONS

SQLITE_LATEST = max(SQLITE_MIGRATIONS)
POSTGRES_LATEST = max(POSTGRES_MIGRATIONS)


def assert_refused_newer(srv: Any, store: str, recorded: int, known: int) -> None:
    """srv exits with 2 and one ERROR line naming the store and both versions; it never led."""
    assert_refused_store(srv, store, f"has schema version {recorded},", f"knows versions up to {known})")


def sqlite_version(path: Path, set_to: int | None = None) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        if set_to is not None:
            db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(set_to),))
        return int(db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])


def test_sqlite_store_of_a_newer_schema_is_refused(start_server: Any, tmp_path: Path) -> None:
    path = tmp_path / "cronoq.db"
    first = start_server({"store": {"path": str(path)}}, name="first")
    assert first.stop() == 0
    assert sqlite_version(path) == SQLITE_LATEST
    sqlite_version(path, set_to=SQLITE_LATEST + 1)  # as a newer server would leave it
    older = start_server({"store": {"path": str(path)}}, name="older", wait_ready=False)
    assert_refused_newer(older, f"store {path}", SQLITE_LATEST + 1, SQLITE_LATEST)
    assert sqlite_version(path) == SQLITE_LATEST + 1


def test_postgres_schema_of_a_newer_version_is_refused_also_by_a_standby(start_server: Any, postgres: Any) -> None:
    """The schema moves on under a running leader (a newer server migrated it): a server started
    now, which would be a standby, refuses it at once rather than wait to lead on it."""
    schema = f"v_{uuid.uuid4().hex[:10]}"
    config = {"store": {"kind": "postgres", "url": postgres.url, "schema": schema}}
    leader = start_server(config, name="leader")
    versions = [r[0] for r in pg_fetch(postgres.url, f"SELECT version FROM {schema}.migrations ORDER BY version")]
    assert versions == sorted(POSTGRES_MIGRATIONS)
    pg_fetch(postgres.url, f"INSERT INTO {schema}.migrations (version) VALUES ({POSTGRES_LATEST + 1})")
    standby = start_server(config, name="standby", wait_ready=False)
    assert_refused_newer(standby, f"schema {schema}", POSTGRES_LATEST + 1, POSTGRES_LATEST)
    assert is_leader(leader)
    assert leader.stop() == 0
    newest = pg_fetch(postgres.url, f"SELECT max(version) FROM {schema}.migrations")[0][0]
    assert newest == POSTGRES_LATEST + 1


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_standby_refuses_to_lead_on_a_schema_migrated_past_it(
    start_server: Any, request: Any, tmp_path: Path, kind: str
) -> None:
    """A newer server migrated the store while this standby waited (its leader still on the
    version both knew): when the leader goes, the standby exits 2 instead of leading on it."""
    store = store_table(kind, request, tmp_path / "shared.db")
    leader = start_server({"store": store}, name="leader")
    standby = start_server({"store": store}, name="standby", wait_ready=False)
    standby.wait_ready(leader=False)
    if kind == "sqlite":
        sqlite_version(tmp_path / "shared.db", set_to=SQLITE_LATEST + 1)
        named, latest = f"store {tmp_path / 'shared.db'}", SQLITE_LATEST
    else:
        pg_fetch(store["url"], f"INSERT INTO {store['schema']}.migrations (version) VALUES ({POSTGRES_LATEST + 1})")
        named, latest = f"schema {store['schema']}", POSTGRES_LATEST
    assert leader.stop() == 0
    assert_refused_newer(standby, named, latest + 1, latest)
