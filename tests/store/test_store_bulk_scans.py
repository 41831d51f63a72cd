"""Bulk actions' scans (match_tasks) run aside within StoreSettings.bulk_scan_timeout_us: one
that runs longer is stopped with ScanTimedOut, and the store serves on as before."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from conftest import OpenStore
from test_store import T0, new

from cronoq_server.store.base import ScanTimedOut, State, TaskFilter
from cronoq_server.store.postgres import PostgresStore

NOT_MATCHING = TaskFilter(states=frozenset(State), error_contains="no such text")
PENDING = TaskFilter(states=frozenset({State.PENDING}))


@pytest.mark.parametrize("read", ["match_tasks", "list_matching"])
async def test_a_scan_past_its_timeout_is_stopped_and_the_next_one_runs(
    open_store: OpenStore, backend: str, read: str
) -> None:
    # A listing by a filter no index serves (scans_far) is read as a bulk action's scan is.
    def scan(store: Any, match: TaskFilter, limit: int) -> Any:
        return getattr(store, read)(match, 0, limit)

    if backend == "postgres":
        # The scan waits for a lock held meanwhile: statement_timeout counts the wait.
        store = await open_store(bulk_scan_timeout_us=200_000)
        assert isinstance(store, PostgresStore)
        await store.submit([new() for _ in range(100)], T0)
        holder = await asyncpg.connect(store.url)
        try:
            async with holder.transaction():
                await holder.execute(f'LOCK TABLE "{store.schema}".tasks IN ACCESS EXCLUSIVE MODE')
                with pytest.raises(ScanTimedOut):
                    await scan(store, NOT_MATCHING, 100)
        finally:
            await holder.close()
    else:
        # Reading 3,000 tasks takes far more than a microsecond.
        hasty = await open_store(bulk_scan_timeout_us=1)
        await hasty.submit([new() for _ in range(3000)], T0)
        with pytest.raises(ScanTimedOut):
            await scan(hasty, NOT_MATCHING, 100)
        assert len(await hasty.list_matching(PENDING, 0, 5)) == 5  # a plain listing: not a scan
        store = await open_store()  # the same file, the default timeout
    assert await scan(store, NOT_MATCHING, 100) == []
    assert len(await scan(store, PENDING, 5)) == 5
