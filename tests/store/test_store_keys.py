"""The Store contract for key modes (replace, debounce, a key held for a period), start
deadlines (EXPIRED) and retention in bounded batches; run against every backend."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
import pytest
from conftest import OpenStore
from test_store import SEC, T0, failure, lease_one, new, row, states, submit_one, success

from cronoq_server.errors import ApiError
from cronoq_server.store.base import (
    KEY_DEBOUNCE,
    KEY_REPLACE_PENDING,
    NOT_STARTED,
    RUN_WHEN_ENDED,
    NewTask,
    State,
    Store,
)

MS = 1000


def keyed(key: str, mode: int, payload: bytes = b"p", **kw: Any) -> NewTask:
    fields = {k: kw.pop(k) for k in ("debounce_us", "max_debounce_us", "key_ttl_ms", "start_by") if k in kw}
    return dataclasses.replace(new(key=key, payload=payload, **kw), key_mode=mode, **fields)


async def submit(store: Store, task: NewTask, now: int = T0) -> Any:
    (sub,), _ = await store.submit([task], now)
    return sub


# -- replace -------------------------------------------------------------------------------


async def test_replace_pending_takes_the_new_payload_priority_and_run_at(store: Store) -> None:
    first = await submit(store, new(key="k", payload=b"old", priority=1))
    again = await submit(store, keyed("k", KEY_REPLACE_PENDING, b"new", priority=7, run_at=T0 + 5 * SEC), T0 + 1)
    assert (again.replaced, again.deduplicated, again.row.seq) == (True, False, first.row.seq)
    got = await row(store, first.row.seq)
    assert (got.payload, got.priority, got.run_at, got.state) == (b"new", 7, T0 + 5 * SEC, State.PENDING)
    assert (got.created_at, got.attempt) == (T0, 0)


async def test_replace_records_an_event_that_keeps_the_state(store: Store) -> None:
    first = await submit(store, new(key="k"))
    before = await store.sequence_events()
    await submit(store, keyed("k", KEY_REPLACE_PENDING, b"new"), T0 + 1)
    await store.sequence_events()
    events = [e for e in await store.read_events(before, 100) if e.task_seq == first.row.seq]
    assert [(e.prev_state, e.state) for e in events] == [(State.PENDING, State.PENDING)]


async def test_replace_of_a_blocked_task_keeps_it_blocked(store: Store) -> None:
    dep = await submit_one(store)
    first = await submit(store, new(key="k", dep_seqs=[dep.seq]))
    again = await submit(store, keyed("k", KEY_REPLACE_PENDING, b"new", dep_seqs=[dep.seq]), T0 + 1)
    assert again.replaced and (await row(store, first.row.seq)).state == State.BLOCKED
    assert (await row(store, first.row.seq)).payload == b"new"


async def test_replace_of_a_running_or_ended_task_returns_it(store: Store) -> None:
    first = await submit(store, new(key="k", payload=b"old"))
    leased = await lease_one(store, first.row.seq)
    again = await submit(store, keyed("k", KEY_REPLACE_PENDING, b"new"), T0 + 1)
    assert (again.replaced, again.deduplicated) == (False, True)
    await store.finish("w1", [success(leased)], T0 + 2)
    again = await submit(store, keyed("k", KEY_DEBOUNCE, b"new", debounce_us=SEC), T0 + 3)
    assert (again.replaced, again.deduplicated) == (False, True)
    assert (await row(store, first.row.seq)).payload == b"old"


async def test_replace_of_another_pools_task_is_refused(store: Store) -> None:
    await submit(store, new(key="k"))
    with pytest.raises(ApiError) as err:
        await submit(store, keyed("k", KEY_REPLACE_PENDING, pool="other"), T0 + 1)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS


async def test_return_existing_changes_nothing(store: Store) -> None:
    first = await submit(store, new(key="k", payload=b"old"))
    again = await submit(store, new(key="k", payload=b"new"), T0 + 1)
    assert (again.deduplicated, again.replaced) == (True, False)
    assert (await row(store, first.row.seq)).payload == b"old"


async def test_a_replaced_task_is_not_leased_twice(store: Store) -> None:
    first = await submit(store, new(key="k"))
    await submit(store, keyed("k", KEY_REPLACE_PENDING, b"new"), T0 + 1)
    rows, _ = await store.lease("w1", ["default"], 10, T0 + 2)
    assert [(r.seq, r.payload) for r in rows] == [(first.row.seq, b"new")]


# -- debounce ------------------------------------------------------------------------------


async def test_debounce_moves_the_due_time_after_each_submission(store: Store) -> None:
    first = await submit(store, keyed("k", KEY_DEBOUNCE, b"1", debounce_us=2 * SEC))
    assert first.row.run_at == T0 + 2 * SEC and not first.replaced
    again = await submit(store, keyed("k", KEY_DEBOUNCE, b"2", debounce_us=2 * SEC), T0 + SEC)
    assert again.replaced and again.row.run_at == T0 + 3 * SEC
    assert (await store.lease("w1", ["default"], 1, T0 + 2 * SEC))[0] == []
    rows, _ = await store.lease("w1", ["default"], 1, T0 + 3 * SEC)
    assert [(r.seq, r.payload) for r in rows] == [(first.row.seq, b"2")]


async def test_debounce_never_moves_past_max_debounce_after_the_first(store: Store) -> None:
    task = lambda: keyed("k", KEY_DEBOUNCE, debounce_us=2 * SEC, max_debounce_us=5 * SEC)  # noqa: E731
    first = await submit(store, task())
    for i in range(1, 10):
        last = await submit(store, task(), T0 + i * SEC)
    assert last.row.seq == first.row.seq and last.row.run_at == T0 + 5 * SEC


async def test_a_debounce_burst_is_one_task(store: Store) -> None:
    seqs = set()
    for i in range(50):
        batch = [keyed(f"k{i % 5}-{j}", KEY_DEBOUNCE, debounce_us=SEC) for j in range(2)]
        subs, _ = await store.submit(batch, T0 + i)
        seqs |= {s.row.seq for s in subs}
    assert len(seqs) == 10


# -- a key held for a period ---------------------------------------------------------------


async def test_a_key_is_free_key_ttl_after_its_task_ended(store: Store) -> None:
    first = await submit(store, dataclasses.replace(new(key="k", payload=b"1"), key_ttl_ms=1000))
    await store.finish("w1", [success(await lease_one(store, first.row.seq))], T0 + SEC)
    held = await submit(store, new(key="k", payload=b"2"), T0 + 2 * SEC - 1)
    assert held.deduplicated and held.row.seq == first.row.seq
    fresh = await submit(store, new(key="k", payload=b"2"), T0 + 2 * SEC)
    assert not fresh.deduplicated and fresh.row.seq != first.row.seq
    assert (await store.get_by_key("k")).seq == fresh.row.seq  # type: ignore[union-attr]
    old = await row(store, first.row.seq)
    assert (old.key, old.state) == ("k", State.SUCCEEDED)  # still shows the key it had


async def test_without_key_ttl_the_key_is_held_until_deleted(store: Store) -> None:
    first = await submit(store, new(key="k"))
    await store.finish("w1", [success(await lease_one(store, first.row.seq))], T0 + SEC)
    assert (await submit(store, new(key="k"), T0 + 10**6 * SEC)).deduplicated


async def test_a_released_key_may_move_to_another_pool(store: Store) -> None:
    first = await submit(store, dataclasses.replace(new(key="k"), key_ttl_ms=1))
    await store.cancel(first.row.seq, T0 + 1)
    moved = await submit(store, new("other", key="k"), T0 + SEC)
    assert not moved.deduplicated and moved.row.pool == "other"


async def test_a_dependency_by_key_names_the_task_that_holds_it_now(store: Store) -> None:
    first = await submit(store, dataclasses.replace(new(key="k"), key_ttl_ms=1))
    await store.cancel(first.row.seq, T0 + 1)
    fresh = await submit(store, new(key="k"), T0 + SEC)
    dependent = await submit(store, new(dep_keys=["k"]), T0 + SEC)
    assert dependent.row.depends_on == [fresh.row.seq] and dependent.row.state == State.BLOCKED


# -- start deadlines -----------------------------------------------------------------------


async def test_a_task_past_its_start_by_is_never_leased(store: Store) -> None:
    late = await submit(store, dataclasses.replace(new(), start_by=T0 + SEC))
    ok = await submit_one(store)
    rows, _ = await store.lease("w1", ["default"], 10, T0 + SEC)
    assert [r.seq for r in rows] == [ok.seq]
    assert await states(store, late.row.seq) == [State.PENDING]  # until the sweep ends it


async def test_a_task_before_its_start_by_is_leased(store: Store) -> None:
    soon = await submit(store, dataclasses.replace(new(), start_by=T0 + SEC))
    rows, _ = await store.lease("w1", ["default"], 10, T0 + SEC - 1)
    assert [r.seq for r in rows] == [soon.row.seq]
    assert await store.expire_unstarted(T0 + 2 * SEC, 100) == []  # a leased one is never expired
    assert await states(store, soon.row.seq) == [State.RUNNING]


async def test_the_sweep_expires_in_bounded_batches_and_ends_dependents(store: Store) -> None:
    tasks = [await submit(store, dataclasses.replace(new(), start_by=T0 + i)) for i in range(1, 6)]
    fin = await submit(store, dataclasses.replace(new(dep_seqs=[tasks[0].row.seq]), run_when=RUN_WHEN_ENDED))
    plain = await submit(store, new(dep_seqs=[tasks[0].row.seq]))
    later = await submit(store, dataclasses.replace(new(), start_by=T0 + 100 * SEC))
    changes = await store.expire_unstarted(T0 + SEC, 2)
    assert [c for c in changes if c[1] == State.EXPIRED] == [(t.row.seq, State.EXPIRED) for t in tasks[:2]]
    assert (plain.row.seq, State.FAILED) in changes and (fin.row.seq, State.PENDING) in changes
    first = await row(store, tasks[0].row.seq)
    assert (first.error, first.finished_at) == (NOT_STARTED, T0 + SEC)
    assert f"dependency {tasks[0].row.seq} expired" in (await row(store, plain.row.seq)).error
    assert len(await store.expire_unstarted(T0 + SEC, 100)) == 3
    assert await store.expire_unstarted(T0 + SEC, 100) == []
    assert await states(store, later.row.seq) == [State.PENDING]


async def test_a_blocked_task_past_its_start_by_expires(store: Store) -> None:
    dep = await submit_one(store)
    blocked = await submit(store, dataclasses.replace(new(dep_seqs=[dep.seq]), start_by=T0 + SEC))
    await store.expire_unstarted(T0 + SEC, 10)
    assert await states(store, blocked.row.seq, dep.seq) == [State.EXPIRED, State.PENDING]


async def test_an_expired_task_depended_on_fails_a_new_dependent(store: Store) -> None:
    late = await submit(store, dataclasses.replace(new(key="late"), start_by=T0 + 1))
    await store.expire_unstarted(T0 + 1, 10)
    dependent = await submit(store, new(dep_keys=["late"]), T0 + 2)
    assert dependent.row.state == State.FAILED and "expired" in dependent.row.error
    assert late.row.start_by == T0 + 1


async def test_a_retried_expired_task_runs_and_brings_its_dependents_back(store: Store) -> None:
    late = await submit(store, dataclasses.replace(new(), start_by=T0 + 1))
    dependent = await submit(store, new(dep_seqs=[late.row.seq]))
    await store.expire_unstarted(T0 + 1, 10)
    retried, restored, _ = await store.retry_tasks([late.row.seq], T0 + 2, None, 1)
    assert [r.seq for r in retried] == [late.row.seq] and restored == 1
    assert await states(store, late.row.seq, dependent.row.seq) == [State.PENDING, State.BLOCKED]
    assert (await row(store, late.row.seq)).start_by is None  # retried: the deadline is gone
    await lease_one(store, late.row.seq, T0 + 3)


async def test_an_expired_task_can_be_deleted(store: Store) -> None:
    late = await submit(store, dataclasses.replace(new(), start_by=T0 + 1))
    await store.expire_unstarted(T0 + 1, 10)
    assert await store.delete_tasks([late.row.seq]) == [late.row.seq]


# -- retention -----------------------------------------------------------------------------


async def test_purge_goes_in_bounded_batches_oldest_first(open_store: OpenStore) -> None:
    store = await open_store(retention_us={"default": SEC, "other": SEC})
    done = []
    for i in range(5):
        t = await submit_one(store, T0 + i)
        await store.finish("w1", [success(await lease_one(store, t.seq, T0 + i))], T0 + i)
        done.append(t.seq)
    running = await submit_one(store)
    await lease_one(store, running.seq)
    pending = await submit_one(store)
    assert await store.purge(T0 + 10 * SEC, 2) == 2
    assert [await store.get(s) is None for s in done] == [True, True, False, False, False]
    assert await store.purge(T0 + 10 * SEC, 100) == 3
    assert await store.purge(T0 + 10 * SEC, 100) == 0
    assert await states(store, running.seq, pending.seq) == [State.RUNNING, State.PENDING]
    assert await store.attempts(done[0]) == []


async def test_retention_failed_and_forever(open_store: OpenStore) -> None:
    store = await open_store(
        retention_us={"default": SEC, "other": 0}, retention_failed_us={"default": 100 * SEC, "other": 0}
    )
    ok = await submit_one(store)
    await store.finish("w1", [success(await lease_one(store, ok.seq))], T0)
    bad = await submit_one(store)
    await store.finish("w1", [failure(await lease_one(store, bad.seq), retryable=False)], T0)
    kept = await submit_one(store, pool="other")
    await store.cancel(kept.seq, T0)
    assert await store.purge(T0 + 10 * SEC, 100) == 1
    assert await store.get(ok.seq) is None and await store.get(bad.seq) is not None
    assert await store.purge(T0 + 101 * SEC, 100) == 1
    assert await store.purge(T0 + 10**9 * SEC, 100) == 0
    assert await store.get(kept.seq) is not None
