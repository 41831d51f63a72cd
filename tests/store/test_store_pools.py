"""The Store's paused pools and its oldest-due read (store/base.py), on every backend in
conftest.BACKENDS."""

from __future__ import annotations

from typing import Any

from test_store import SEC, T0, new

from cronoq_server.store.base import PoolPause, Store


async def test_pause_is_stored_idempotent_and_resumed(open_store: Any) -> None:
    store: Store = await open_store()
    assert await store.paused_pools() == []
    first = await store.set_pool_paused("default", True, T0, "ops")
    assert first == PoolPause("default", True, T0, "ops")
    # Paused again (by another caller, later): the first pause is kept.
    assert await store.set_pool_paused("default", True, T0 + SEC, "other") == first
    assert await store.paused_pools() == [first]
    await store.close()
    reopened: Store = await open_store()
    assert await reopened.paused_pools() == [first]
    assert await reopened.set_pool_paused("default", False, T0 + 2 * SEC, "ops") == PoolPause("default", False)
    assert await reopened.paused_pools() == []
    # Resuming a pool never paused stores it as not paused.
    assert await reopened.set_pool_paused("other", False, T0, "ops") == PoolPause("other", False)
    assert await reopened.paused_pools() == []
    again = await reopened.set_pool_paused("default", True, T0 + 3 * SEC, "later")
    assert again == PoolPause("default", True, T0 + 3 * SEC, "later")


async def test_oldest_due_pending_per_pool(store: Store) -> None:
    assert await store.oldest_due_pending(["default", "other"], T0) == {}
    await store.submit([new(run_at=T0 - 5 * SEC)], T0 - 10 * SEC)  # due 5 s ago, submitted before
    await store.submit([new(run_at=T0 - 20 * SEC)], T0 - 3 * SEC)  # due before it was submitted
    await store.submit([new(run_at=T0 + 60 * SEC)], T0 - 30 * SEC)  # not due yet
    await store.submit([new("other", run_at=T0 + SEC)], T0)  # not due yet
    # The earliest-due one is the second: its age counts from its submission (T0 - 3 s).
    assert await store.oldest_due_pending(["default", "other"], T0) == {"default": T0 - 3 * SEC}
    rows, _ = await store.lease("w", ["default"], 1, T0)
    assert rows[0].run_at == T0 - 20 * SEC
    assert await store.oldest_due_pending(["default", "other"], T0 + 2 * SEC) == {
        "default": T0 - 5 * SEC,
        "other": T0 + SEC,
    }
