"""The Store's schedules (store/base.py, `# -- schedules`), on every backend in conftest.BACKENDS.

Every call passes an explicit `now` (µs); slots are chosen by the test, as the core would."""

from __future__ import annotations

import asyncio
import dataclasses

from cronoq_server.store.base import NewTask, ScheduleRow, State, Store

T0 = 1_700_000_000_000_000  # µs
SEC = 1_000_000


def sched(pool: str = "default", name: str = "nightly", **kw: object) -> ScheduleRow:
    fields: dict[str, object] = dict(
        pool=pool, name=name, cron="* * * * * *", timezone="", payload=b'{"n": 1}', content_type="application/json",
        priority=3, max_attempts=0, resources={}, timeout_ms=0, paused=False, fire_all_missed=False,
        next_fire_at=T0 + SEC,
    )  # fmt: skip
    fields.update(kw)
    return ScheduleRow(**fields)  # type: ignore[arg-type]


def slot_task(s: ScheduleRow, slot: int) -> NewTask:
    return NewTask(
        pool=s.pool,
        key=f"schedule:{s.pool}:{s.name}:{slot // SEC}",
        payload=s.payload,
        content_type=s.content_type,
        priority=s.priority,
        run_at=slot,
        max_attempts=3,
    )


async def test_put_creates_then_replaces_keeping_last_fire_and_created(store: Store) -> None:
    first = await store.put_schedule(sched(resources={"gpu": 1}), T0)
    assert (first.created_at, first.updated_at, first.last_fire_at) == (T0, T0, None)
    assert first.resources == {"gpu": 1} and first.payload == b'{"n": 1}' and first.priority == 3
    fired = await store.fire_schedule(first, [slot_task(first, T0 + SEC)], T0 + SEC, T0 + 2 * SEC, T0 + SEC)
    assert fired is not None
    second = await store.put_schedule(sched(cron="0 * * * *", paused=True, next_fire_at=None), T0 + 5 * SEC)
    assert second.cron == "0 * * * *" and second.paused and second.next_fire_at is None
    assert (second.created_at, second.updated_at, second.last_fire_at) == (T0, T0 + 5 * SEC, T0 + SEC)
    assert second.resources == {}
    assert await store.list_schedules(None) == [second]


async def test_delete_and_list_by_pools(store: Store) -> None:
    a = await store.put_schedule(sched("default", "a"), T0)
    b = await store.put_schedule(sched("default", "b"), T0)
    c = await store.put_schedule(sched("other", "a"), T0)
    assert await store.list_schedules(None) == [a, b, c]
    assert await store.list_schedules(["other"]) == [c]
    assert await store.list_schedules([]) == []
    assert await store.delete_schedule("default", "a")
    assert not await store.delete_schedule("default", "a")
    assert not await store.delete_schedule("nope", "b")
    assert await store.list_schedules(None) == [b, c]


async def test_due_schedules_and_the_next_one(store: Store) -> None:
    await store.put_schedule(sched(name="soon", next_fire_at=T0 + SEC), T0)
    await store.put_schedule(sched(name="later", next_fire_at=T0 + 5 * SEC), T0)
    await store.put_schedule(sched(name="paused", paused=True, next_fire_at=None), T0)
    assert await store.due_schedules(T0, 10) == ([], T0 + SEC)
    due, nxt = await store.due_schedules(T0 + SEC, 10)
    assert [s.name for s in due] == ["soon"] and nxt == T0 + 5 * SEC
    due, nxt = await store.due_schedules(T0 + 9 * SEC, 1)
    assert [s.name for s in due] == ["soon"] and nxt is None  # earliest first, limited


async def test_fire_creates_the_slot_task_and_advances(store: Store) -> None:
    s = await store.put_schedule(sched(), T0)
    slot = T0 + SEC
    fired = await store.fire_schedule(s, [slot_task(s, slot)], slot, slot + SEC, slot + 2_000)
    assert fired is not None
    (sub,), changes = fired
    assert not sub.deduplicated and sub.row.key == f"schedule:default:nightly:{slot // SEC}"
    assert sub.row.run_at == slot and sub.row.created_at == slot + 2_000 and sub.row.priority == 3
    assert changes == [(sub.row.seq, State.PENDING)]
    (after,) = await store.list_schedules(None)
    assert (after.last_fire_at, after.next_fire_at) == (slot, slot + SEC)


async def test_a_slot_fired_twice_creates_one_task(store: Store) -> None:
    s = await store.put_schedule(sched(), T0)
    slot = T0 + SEC
    assert await store.fire_schedule(s, [slot_task(s, slot)], slot, slot + SEC, slot) is not None
    # The same read again (a duplicate or stale leader): the guard moves nothing, creates nothing.
    assert await store.fire_schedule(s, [slot_task(s, slot)], slot, slot + SEC, slot) is None
    # A new leader that read the schedule before the fire committed, and fires the slot from a
    # row that claims it is still due: the task's key deduplicates it.
    (now_row,) = await store.list_schedules(None)
    stale = dataclasses.replace(now_row, next_fire_at=slot + SEC)
    fired = await store.fire_schedule(stale, [slot_task(s, slot)], slot + SEC, slot + 2 * SEC, slot + SEC)
    assert fired is not None and [x.deduplicated for x in fired[0]] == [True] and fired[1] == []
    tasks = await store.list_tasks(None, None, 0, 10)
    assert [t.key for t in tasks] == [f"schedule:default:nightly:{slot // SEC}"]


async def test_concurrent_fires_of_one_slot_create_one_task(store: Store) -> None:
    s = await store.put_schedule(sched(), T0)
    slot = T0 + SEC
    results = await asyncio.gather(
        *(store.fire_schedule(s, [slot_task(s, slot)], slot, slot + SEC, slot) for _ in range(5))
    )
    assert sum(r is not None for r in results) == 1
    assert len(await store.list_tasks(None, None, 0, 10)) == 1


async def test_fire_after_a_put_or_pause_does_nothing(store: Store) -> None:
    s = await store.put_schedule(sched(), T0)
    await store.put_schedule(sched(priority=9), T0 + 1)  # replaced after s was read
    assert await store.fire_schedule(s, [slot_task(s, T0 + SEC)], T0 + SEC, T0 + 2 * SEC, T0 + SEC) is None
    paused = await store.put_schedule(sched(paused=True), T0 + 2)
    assert await store.fire_schedule(paused, [slot_task(s, T0 + SEC)], T0 + SEC, None, T0 + SEC) is None
    assert await store.list_tasks(None, None, 0, 10) == []


async def test_fire_of_several_missed_slots_is_one_transaction(store: Store) -> None:
    s = await store.put_schedule(sched(fire_all_missed=True), T0)
    slots = [T0 + SEC, T0 + 2 * SEC, T0 + 3 * SEC]
    fired = await store.fire_schedule(s, [slot_task(s, x) for x in slots], slots[-1], T0 + 4 * SEC, T0 + 3 * SEC)
    assert fired is not None and len(fired[0]) == 3
    (after,) = await store.list_schedules(None)
    assert (after.last_fire_at, after.next_fire_at) == (slots[-1], T0 + 4 * SEC)


async def test_a_slot_key_held_by_another_pool_is_skipped(store: Store) -> None:
    s = await store.put_schedule(sched(), T0)
    slot = T0 + SEC
    taken = slot_task(s, slot)
    await store.submit([dataclasses.replace(taken, pool="other")], T0)
    fired = await store.fire_schedule(s, [taken, slot_task(s, slot + SEC)], slot + SEC, slot + 2 * SEC, slot + SEC)
    assert fired is not None
    assert [x.row.run_at for x in fired[0]] == [slot + SEC]
    (after,) = await store.list_schedules(None)
    assert after.next_fire_at == slot + 2 * SEC


async def test_a_fire_over_the_pending_limit_changes_nothing(open_store: object) -> None:
    store: Store = await open_store(max_pending_per_pool=1)  # type: ignore[operator]
    s = await store.put_schedule(sched(), T0)
    await store.submit([dataclasses.replace(slot_task(s, T0), key=None)], T0)
    try:
        await store.fire_schedule(s, [slot_task(s, T0 + SEC)], T0 + SEC, T0 + 2 * SEC, T0 + SEC)
        raise AssertionError("fire over the limit was admitted")
    except Exception as err:  # the pending limit's ApiError
        assert "RESOURCE_EXHAUSTED" in repr(getattr(err, "code", err))
    (after,) = await store.list_schedules(None)
    assert after.next_fire_at == T0 + SEC and after.last_fire_at is None
    assert len(await store.list_tasks(None, None, 0, 10)) == 1


async def test_schedules_survive_reopen(open_store: object) -> None:
    store: Store = await open_store()  # type: ignore[operator]
    s = await store.put_schedule(sched(), T0)
    await store.close()
    again: Store = await open_store()  # type: ignore[operator]
    assert await again.list_schedules(None) == [s]
