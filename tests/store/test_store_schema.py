"""Schema versions, run against every backend in conftest.BACKENDS: a store migrates forward
from any earlier version, refuses a schema newer than the code knows, and never lowers the
recorded version."""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Any

import asyncpg
import pytest
from test_store import submit_one

from cronoq_server.store import postgres, sqlite
from cronoq_server.store.base import Store, StoreSchemaTooNew
from cronoq_server.store.postgres import PostgresStore
from cronoq_server.store.sqlite import SqliteStore


def latest(store: Store) -> int:
    return max(sqlite.MIGRATIONS if isinstance(store, SqliteStore) else postgres.MIGRATIONS)


async def recorded_version(store: Store, set_to: int | None = None) -> int:
    """The schema version the store records (set first, by SQL, when set_to is given)."""
    if isinstance(store, SqliteStore):
        with contextlib.closing(sqlite3.connect(store.path)) as db, db:
            if set_to is not None:
                db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(set_to),))
            return int(db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
    assert isinstance(store, PostgresStore)
    conn = await asyncpg.connect(store.url)
    try:
        if set_to is not None:
            await conn.execute(f'INSERT INTO "{store.schema}".migrations (version) VALUES ($1)', set_to)
        return int(await conn.fetchval(f'SELECT max(version) FROM "{store.schema}".migrations'))
    finally:
        await conn.close()


async def test_a_schema_newer_than_the_code_is_refused_and_left_as_it_is(open_store: Any) -> None:
    first: Store = await open_store()
    await submit_one(first)
    newest = latest(first)
    assert await recorded_version(first) == newest
    await first.close()
    await recorded_version(first, set_to=newest + 1)
    with pytest.raises(StoreSchemaTooNew) as info:
        await open_store()
    assert f"schema version {newest + 1}," in str(info.value) and f"versions up to {newest})" in str(info.value)
    assert await recorded_version(first) == newest + 1


async def test_reopening_at_the_latest_version_keeps_it(open_store: Any) -> None:
    first: Store = await open_store()
    await first.close()
    again: Store = await open_store()
    assert await recorded_version(again) == latest(again)
