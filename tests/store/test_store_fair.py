"""Leases of a pool that caps its groups (settings.group_pools), on every backend: round robin
across groups within a priority, never past a group's cap, tasks that become due later ranked
then, ranks rebuilt when a server takes over."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from test_store import SEC, T0, failure, finish_ok, new, success

from cronoq_server.store.base import NewTask, Outcome, OutcomeKind, State, Store
from cronoq_server.store.postgres import ANALYZE_AFTER_ROWS, ANALYZE_FIRST_ROWS

FAIR = frozenset({"default"})


def grouped(group: str, **kw: Any) -> NewTask:
    return dataclasses.replace(new(**kw), group_key=group)


async def lease(
    store: Store, n: int, now: int = T0, running: dict[str, int] | None = None, cap: int = 100
) -> list[Any]:
    rows, _ = await store.lease("w1", ["default"], n, now, 0, {}, {"default": (cap, running or {})})
    return rows


async def test_a_group_with_few_tasks_is_served_in_turn_with_one_that_has_many(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    await store.submit([grouped("a") for _ in range(50)], T0)
    await store.submit([grouped("b") for _ in range(3)] + [grouped("") for _ in range(2)], T0)
    rows = await lease(store, 8)
    assert [r.group_key for r in sorted(rows, key=lambda r: r.seq)][:2] == ["a", "a"]
    got = sorted(r.group_key for r in rows)
    assert got.count("b") == 3 and got.count("") == 2 and got.count("a") == 3, got


async def test_priority_goes_first_then_groups_in_turn(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    await store.submit([grouped("a") for _ in range(10)], T0)
    (urgent,), _ = await store.submit([grouped("a", priority=5)], T0)
    await store.submit([grouped("b")], T0)
    rows = await lease(store, 3)  # the urgent one, then a's first and b's first (tied ranks: by seq)
    assert urgent.row.seq in [r.seq for r in rows] and sorted(r.group_key for r in rows) == ["a", "a", "b"]


async def test_a_lease_never_takes_a_group_past_its_cap(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    await store.submit([grouped("a") for _ in range(10)] + [grouped("b") for _ in range(10)], T0)
    rows = await lease(store, 10, running={"a": 1}, cap=2)
    assert sorted(r.group_key for r in rows) == ["a", "b", "b"]
    assert await lease(store, 10, running={"a": 2, "b": 2}, cap=2) == []
    rows, next_due = await store.lease("w1", ["default"], 10, T0, 0, {}, {"default": (2, {"a": 2, "b": 2})})
    assert rows == [] and next_due is None  # nothing becomes due later: a release tells


async def test_a_task_due_later_is_ranked_when_due_and_takes_its_turn(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    await store.submit([grouped("a") for _ in range(20)], T0)
    (later,), _ = await store.submit([grouped("b", run_at=T0 + 5 * SEC)], T0)
    rows, next_due = await store.lease("w1", ["default"], 5, T0, 0, {}, {"default": (100, {})})
    assert all(r.group_key == "a" for r in rows) and len(rows) == 5 and next_due is None
    assert len(await lease(store, 100)) == 15
    rows, next_due = await store.lease("w1", ["default"], 100, T0, 0, {}, {"default": (100, {})})
    assert rows == [] and next_due == T0 + 5 * SEC  # b's, not yet due: the lease looks again then
    rows = await lease(store, 2, now=T0 + 5 * SEC)
    assert later.row.seq in [r.seq for r in rows]


async def test_a_retried_task_is_ranked_again_when_due_and_a_released_one_keeps_its_turn(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    await store.submit([grouped("a") for _ in range(3)], T0)
    first, second, _ = sorted(await lease(store, 3), key=lambda r: r.seq)
    await store.submit([grouped("a") for _ in range(5)], T0)
    await finish_ok(store, failure(first, retry_after_ms=2000), T0)
    results, _ = await store.finish("w1", [Outcome(second.seq, second.attempt, OutcomeKind.RELEASED)], T0)
    assert results[0].accepted
    rows = await lease(store, 1)
    assert [r.seq for r in rows] == [second.seq]  # released: its turn kept
    rows = await lease(store, 10, now=T0 + 3 * SEC)
    assert first.seq in [r.seq for r in rows]  # due again: ranked, then leased


async def test_ranks_are_rebuilt_by_a_server_that_takes_over(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    await store.submit([grouped("a") for _ in range(30)], T0)
    for r in await lease(store, 10):
        await finish_ok(store, success(r), T0)
    await store.close()
    store = await open_store(group_pools=FAIR)
    await store.load_ranks()
    await store.submit([grouped("b")], T0)  # after the round, not behind a's 20 left
    rows = await lease(store, 2)
    assert sorted(r.group_key for r in rows) == ["a", "b"]


async def test_a_pool_that_caps_its_groups_from_now_on_takes_the_tasks_stored_before(open_store: Any) -> None:
    store = await open_store()
    await store.submit([grouped("a") for _ in range(3)], T0)
    await store.close()
    store = await open_store(group_pools=FAIR)
    await store.load_ranks()
    assert len(await lease(store, 10)) == 3


async def test_running_resources_name_the_running_tasks_of_capped_pools(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    await store.submit([grouped("a"), grouped("b", pool="other")], T0)
    await lease(store, 10)
    await store.lease("w2", ["other"], 10, T0)
    held = await store.running_resources()
    assert [(w, h.pool, h.group_key) for w, h in held] == [("w1", "default", "a")]


async def test_a_fair_lease_looks_up_a_keyed_resource_by_key_then_its_full_size(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    subs, _ = await store.submit(
        [
            dataclasses.replace(grouped("a"), resources={"conn:x": 1}),  # key x at its limit
            dataclasses.replace(grouped("b"), resources={"conn:y": 2}),  # a fresh key
            dataclasses.replace(grouped("c"), resources={"conn:y": 1}),  # y then over
            grouped("d"),
        ],
        T0,
    )
    rows, _ = await store.lease("w1", ["default"], 10, T0, 0, {"conn:": 2, "conn:x": 0}, {"default": (100, {})})
    assert sorted(r.seq for r in rows) == [subs[1].row.seq, subs[3].row.seq]


async def test_a_lease_of_a_capped_pool_and_a_plain_one_takes_from_both(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    await store.submit([grouped("a") for _ in range(3)] + [grouped("a", pool="other") for _ in range(3)], T0)
    rows, _ = await store.lease("w1", ["default", "other"], 10, T0, 0, {}, {"default": (2, {})})
    assert sorted(r.pool for r in rows) == ["default", "default", "other", "other", "other"]
    rows, next_due = await store.lease("w1", ["default", "other"], 10, T0, 0, {}, {"default": (2, {"a": 2})})
    assert rows == [] and next_due is None  # default's one left waits for its group's place


async def test_finish_and_lease_takes_the_place_the_outcome_frees(open_store: Any) -> None:
    store = await open_store(group_pools=FAIR)
    await store.submit([grouped("a") for _ in range(2)], T0)
    (first,) = await lease(store, 10, cap=1)
    results, _, rows, _ = await store.finish_and_lease(
        "w1", [success(first)], ["default"], 10, T0, 0, {}, {"default": (1, {})}
    )
    assert results[0].accepted and [r.group_key for r in rows] == ["a"]


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite reads and takes in one transaction
@pytest.mark.parametrize("with_finish", [False, True])
async def test_a_task_cancelled_while_the_lease_chooses_is_not_taken(
    open_store: Any, monkeypatch: pytest.MonkeyPatch, with_finish: bool
) -> None:
    store = await open_store(group_pools=FAIR)
    (done,), _ = await store.submit([grouped("a")], T0)
    (running,) = await lease(store, 1)
    (first, second), _ = await store.submit([grouped("a"), grouped("b")], T0)
    fair_read = store._fair_read  # type: ignore[attr-defined]

    async def cancelled_meanwhile(*args: Any) -> Any:
        read = await fair_read(*args)
        await store.cancel(first.row.seq, T0)
        return read

    monkeypatch.setattr(store, "_fair_read", cancelled_meanwhile)
    if with_finish:
        outcome = Outcome(running.seq, running.attempt, OutcomeKind.SUCCESS, b"")
        _, _, rows, _ = await store.finish_and_lease(
            "w1", [outcome], ["default"], 10, T0, 0, {}, {"default": (100, {})}
        )
        assert (await store.get(done.row.seq)).state == State.SUCCEEDED  # type: ignore[union-attr]
    else:
        rows = await lease(store, 10)
    assert [r.seq for r in rows] == [second.row.seq]
    assert (await store.get(first.row.seq)).state == State.CANCELLED  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite's leases name their indexes
async def test_the_tasks_table_is_analyzed_after_its_first_submissions_and_after_a_burst(open_store: Any) -> None:
    """Else leases are planned without statistics (a keyed lease's step from one key to the next
    read every PENDING task of the pool, however few), or from those of a far smaller table until
    autovacuum comes (up to a minute): a sort of every PENDING task instead of an index range."""
    store = await open_store(group_pools=FAIR)
    rows = "SELECT reltuples FROM pg_class WHERE oid = to_regclass($1)"
    table = store._sql("{s}.tasks")  # type: ignore[attr-defined]
    for burst, size in (
        (ANALYZE_FIRST_ROWS, ANALYZE_FIRST_ROWS),
        (ANALYZE_AFTER_ROWS, ANALYZE_FIRST_ROWS + ANALYZE_AFTER_ROWS),
    ):
        await store.submit([grouped("a") for _ in range(burst)], T0)
        for _ in range(100):
            if await store._read(lambda c: c.fetchval(rows, table)) >= size:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the tasks table was not analyzed after {burst} submissions")


@pytest.mark.parametrize("backend", ["postgres"])
async def test_a_burst_beside_many_ended_tasks_is_analyzed(open_store: Any) -> None:
    """Ended tasks make a large table: the analyzer compares submissions with the PENDING tasks,
    not with the table's rows (beside 1,000,000 ended tasks, 100,000 submissions were leased
    with a plan for no PENDING task, and drained at a third of their rate on an empty store)."""
    store: Any = await open_store()
    ended = (
        "INSERT INTO {s}.tasks (pool, payload, run_at, max_attempts, state, created_at, finished_at)"
        " SELECT 'default', ''::bytea, 0, 1, 4, 0, 0 FROM generate_series(1, 30000)"
    )
    await store._read(lambda c: c.execute(store._sql(ended)))
    await store._read(lambda c: c.execute(store._sql("ANALYZE {s}.tasks")))
    await store.close()
    store = await open_store()  # as a server started on such a store
    await store.submit([grouped("a") for _ in range(ANALYZE_AFTER_ROWS)], T0)
    pending_seen = (  # the statistics know of PENDING tasks (state 1 among the most common values)
        "SELECT count(*) FROM pg_stats WHERE schemaname = $1 AND tablename = 'tasks' AND attname = 'state'"
        " AND '1' = ANY(most_common_vals::text::text[])"
    )
    for _ in range(100):
        if await store._read(lambda c: c.fetchval(pending_seen, store.schema)):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the tasks table was not analyzed after a burst beside ended tasks")
