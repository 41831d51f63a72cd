"""Schema versions, run against every backend in conftest.BACKENDS: a store migrates forward
from the version before, refuses a schema newer than the code knows, and never lowers the
recorded version."""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
from typing import Any

import asyncpg
import pytest
from test_store import T0, new, submit_one
from test_store_events import events

from cronoq_server.store import postgres, sqlite
from cronoq_server.store.base import Store, StoreSchemaTooNew
from cronoq_server.store.postgres import PostgresStore, quote_ident
from cronoq_server.store.sqlite import SqliteStore


def migrations(store_or_backend: Store | str) -> dict[int, Any]:
    is_sqlite = store_or_backend == "sqlite" or isinstance(store_or_backend, SqliteStore)
    return sqlite.MIGRATIONS if is_sqlite else postgres.MIGRATIONS  # type: ignore[return-value]


async def run_sql(store: Store, sql: str) -> list[tuple[Any, ...]]:
    """Runs sql on the store's database, beside the store ({s}. names its PostgreSQL schema)."""
    if isinstance(store, SqliteStore):
        with contextlib.closing(sqlite3.connect(store.path)) as db, db:
            return db.execute(sql.replace("{s}.", "")).fetchall()
    assert isinstance(store, PostgresStore)
    conn = await asyncpg.connect(store.url)
    try:
        return [tuple(r) for r in await conn.fetch(sql.replace("{s}", quote_ident(store.schema)))]
    finally:
        await conn.close()


async def recorded_version(store: Store) -> int:
    if isinstance(store, SqliteStore):
        return int((await run_sql(store, "SELECT value FROM meta WHERE key = 'schema_version'"))[0][0])
    return int((await run_sql(store, "SELECT max(version) FROM {s}.migrations"))[0][0])


async def record_version(store: Store, version: int) -> None:
    """What a server of that version records (a newer one: as it would)."""
    if isinstance(store, SqliteStore):
        await run_sql(store, f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'")
    else:
        await run_sql(store, f"INSERT INTO {{s}}.migrations (version) VALUES ({version})")


async def test_a_schema_newer_than_the_code_is_refused_and_left_as_it_is(open_store: Any) -> None:
    first: Store = await open_store()
    await submit_one(first)
    newest = max(migrations(first))
    assert await recorded_version(first) == newest
    await first.close()
    await record_version(first, newest + 1)
    with pytest.raises(StoreSchemaTooNew) as info:
        await open_store()
    assert f"schema version {newest + 1}," in str(info.value) and f"versions up to {newest})" in str(info.value)
    assert await recorded_version(first) == newest + 1


async def test_a_store_of_the_version_before_migrates_and_keeps_its_events(
    open_store: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store as the code before the last migration left it, with an event that code recorded
    (none of the task's fields with it): migrated on open, that event still read, new ones full."""
    newest = max(migrations(backend))
    with monkeypatch.context() as patch:
        patch.delitem(migrations(backend), newest)
        before: Store = await open_store()
    assert await recorded_version(before) == newest - 1
    await run_sql(
        before,
        "INSERT INTO {s}.events (task_seq, pool, prev_state, state, attempt, at) VALUES (1, 'default', 0, 1, 0, 7)",
    )
    await before.close()

    after: Store = await open_store()
    assert await recorded_version(after) == newest
    task = await submit_one(after)
    old, new = await events(after)
    assert (old.seq, old.task_seq, old.at, old.run_at, old.worker_id) == (1, 1, 7, None, None)
    assert (new.seq, new.task_seq, new.run_at, new.error) == (2, task.seq, T0, "")
    await after.close()
    again: Store = await open_store()
    assert await recorded_version(again) == newest


# A PENDING task as any earlier schema stores it (pool, payload, run_at, max_attempts, state,
# created_at, resources).
OLD_TASK = "INSERT INTO {s}.tasks (pool, payload, run_at, max_attempts, state, created_at, resources)"


def empty(backend: str) -> str:
    """SQL: an empty payload."""
    return "X''" if backend == "sqlite" else "''::bytea"


async def store_before(
    open_store: Any, backend: str, monkeypatch: pytest.MonkeyPatch, column: str
) -> tuple[Store, int]:
    """A store as the code before the migration that adds column left it (that migration and
    those after it not applied), and the newest version."""
    newest = max(migrations(backend))
    first = min(v for v, m in migrations(backend).items() if column in str(m))
    with monkeypatch.context() as patch:
        for version in range(first, newest + 1):
            patch.delitem(migrations(backend), version)
        before: Store = await open_store()
    return before, newest


async def test_tasks_and_schedules_of_the_store_before_groups_read_back_without_a_group(
    open_store: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store as the code before group_key left it (its last migration not applied), with a task
    and a schedule: migrated on open, both read back with no group, and new ones keep theirs."""
    before, newest = await store_before(open_store, backend, monkeypatch, "group_key")
    await run_sql(before, f"{OLD_TASK} VALUES ('default', {empty(backend)}, 1, 3, 1, 1, NULL)")
    await run_sql(
        before,
        "INSERT INTO {s}.schedules (pool, name, cron, payload, created_at, updated_at)"
        f" VALUES ('default', 'old', '* * * * *', {empty(backend)}, 1, 1)",
    )
    await before.close()

    after: Store = await open_store()
    assert await recorded_version(after) == newest
    old = await after.get(1)
    assert old is not None and old.group_key == ""
    assert [(s.name, s.group_key) for s in await after.list_schedules(None)] == [("old", "")]
    (sub,), _ = await after.submit([dataclasses.replace(new(), group_key="g")], T0)
    assert (await after.get(sub.row.seq)).group_key == "g"  # type: ignore[union-attr]


async def test_pending_tasks_of_the_store_before_keyed_leases_are_leased_by_their_key(
    open_store: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store as the code before res_key left it, with PENDING tasks naming a keyed entry (and a
    plain one), a plain resource, and none: migrated on open, each is leased (the keyed ones by
    their key, which the migration stored)."""
    before, newest = await store_before(open_store, backend, monkeypatch, "res_key")
    for resources in ('{"gpu": 1, "conn:b": 1}', '{"gpu": 1}', '{"conn:a": 1}'):
        await run_sql(before, f"{OLD_TASK} VALUES ('default', {empty(backend)}, 1, 3, 1, 1, '{resources}')")
    await before.close()

    after: Store = await open_store()
    assert await recorded_version(after) == newest
    assert sorted(r[0] for r in await run_sql(after, "SELECT res_key FROM {s}.tasks WHERE res_key IS NOT NULL")) == [
        "conn:a",
        "conn:b",
    ]
    rows, _ = await after.lease("w1", ["default"], 10, T0, free={"conn:": 1, "gpu": 1})
    assert sorted(r.seq for r in rows) == [1, 3]  # the two naming gpu: one at a time
    rows, _ = await after.lease("w1", ["default"], 10, T0, free={"conn:": 1, "gpu": 1})
    assert [r.seq for r in rows] == [2]
