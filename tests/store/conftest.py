"""One Store suite for every backend (like River's riverdrivertest).

A backend is one entry of BACKENDS: an async factory that opens a store at a place
given by the test and returns it. Opening the same place again must reach the same
data (the reopen test relies on it). SQLite opens a file in the test's directory;
PostgreSQL maps the place to a schema of the session's throwaway server. Every test
runs on both.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from cronoq_server.store.base import Store, StoreSettings
from cronoq_server.store.postgres import PostgresStore
from cronoq_server.store.sqlite import SqliteStore

POOLS = ("default", "other")
LEASE_TTL_US = {"default": 10_000_000, "other": 60_000_000}
RETENTION_US = {"default": 3_600_000_000, "other": 7_200_000_000}


def retry_at(pool: str, attempt: int, now: int, retry_after_ms: int) -> int:
    """Deterministic backoff, so tests can assert the exact next run_at."""
    if retry_after_ms > 0:
        return now + retry_after_ms * 1000
    return now + 1000 * attempt


def make_settings(**overrides: Any) -> StoreSettings:
    settings = StoreSettings(
        shard_name="unsharded",
        shard_number=0,
        lease_ttl_us=dict(LEASE_TTL_US),
        retention_us=dict(RETENTION_US),
        retry_at=retry_at,
    )
    return dataclasses.replace(settings, **overrides)


async def open_sqlite(place: Path, settings: StoreSettings) -> Store:
    store = SqliteStore(str(place / "cronoq.db"), settings, synchronous="normal")
    try:
        await store.open()
    except BaseException:
        await store.close()
        raise
    return store


async def open_postgres(place: Path, settings: StoreSettings, url: str) -> Store:
    # One schema per test place: reopening the same place reaches the same schema.
    schema = "t_" + hashlib.sha1(str(place).encode()).hexdigest()[:16]
    store = PostgresStore(url, schema, settings)
    try:
        await store.open()
    except BaseException:
        await store.close()
        raise
    return store


# name -> async factory(place, settings, url) returning an opened store.
BACKENDS: dict[str, Callable[..., Awaitable[Store]]] = {
    "sqlite": lambda place, settings, url: open_sqlite(place, settings),
    "postgres": open_postgres,
}

OpenStore = Callable[..., Awaitable[Store]]


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def open_store(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[OpenStore]:
    """open_store(**settings_overrides) -> an opened store at this test's place.

    Every store opened is closed after the test, so close() must be idempotent.
    """
    opened: list[Store] = []
    url = request.getfixturevalue("postgres").url if backend == "postgres" else ""

    async def open_(**overrides: Any) -> Store:
        store = await BACKENDS[backend](tmp_path, make_settings(**overrides), url)
        opened.append(store)
        return store

    yield open_
    for store in reversed(opened):
        await store.close()


@pytest.fixture
async def store(open_store: OpenStore) -> Store:
    return await open_store()


@pytest.fixture
def settings() -> StoreSettings:
    """The settings the default store was opened with (lease TTLs, retention, retry_at)."""
    return make_settings()
