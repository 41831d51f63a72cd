"""A task's group_key (SubmitTaskRequest.group_key) on every backend in conftest.BACKENDS: stored
by each submit path, read back by every read, kept by a retry; a schedule's, and its fired tasks'."""

from __future__ import annotations

import dataclasses

from test_store import SEC, T0, failure, finish_ok, lease_one, new, row
from test_store_schedules import sched, slot_task

from cronoq_server.store.base import State, Store


async def test_each_submit_path_stores_the_group_and_every_read_returns_it(store: Store) -> None:
    # Plain tasks (PostgreSQL: one multi-row INSERT), a keyed one and a dependent one (the
    # per-task path), and a repeated request_id (read back from what the first call created).
    plain = [dataclasses.replace(new(), group_key=f"tenant-{i}") for i in range(2)]
    subs, _ = await store.submit([*plain, new(), dataclasses.replace(new(key="k"), group_key="é ü 東京")], T0)
    keyed, _ = await store.submit([dataclasses.replace(new(dep_keys=["k"]), group_key="tenant-1")], T0)
    replayed, _ = await store.submit([dataclasses.replace(new(), group_key="r")], T0, request_id="req")
    again, _ = await store.submit([dataclasses.replace(new(), group_key="r")], T0, request_id="req")
    wanted = ["tenant-0", "tenant-1", "", "é ü 東京", "tenant-1", "r"]
    created = [s.row for s in [*subs, *keyed, *replayed]]
    assert [r.group_key for r in created] == wanted
    assert [(s.row.seq, s.row.group_key) for s in again] == [(replayed[0].row.seq, "r")]
    seqs = [r.seq for r in created]
    assert [(await row(store, s)).group_key for s in seqs] == wanted
    assert [r.group_key for r in await store.get_many(seqs)] == wanted
    assert [r.group_key for r in await store.list_tasks(None, None, 0, 100)] == wanted
    assert (await store.get_by_key("k")).group_key == "é ü 東京"  # type: ignore[union-attr]
    deduplicated, _ = await store.submit([dataclasses.replace(new(key="k"), group_key="other")], T0)
    assert deduplicated[0].deduplicated and deduplicated[0].row.group_key == "é ü 東京"
    leased, _ = await store.lease("w1", ["default"], 1, T0)
    assert leased[0].group_key == "tenant-0"


async def test_a_retried_task_keeps_its_group(store: Store) -> None:
    (sub,), _ = await store.submit([dataclasses.replace(new(max_attempts=1), group_key="g")], T0)
    await finish_ok(store, failure(await lease_one(store, sub.row.seq), retryable=False), T0)
    assert (await row(store, sub.row.seq)).state == State.FAILED
    retried, _, _ = await store.retry_tasks([sub.row.seq], T0 + SEC, None, 1)
    assert [r.group_key for r in retried] == ["g"]
    assert (await row(store, sub.row.seq)).group_key == "g"


async def test_a_schedule_keeps_its_group_and_its_fired_tasks_carry_what_they_were_given(store: Store) -> None:
    first = await store.put_schedule(sched(group_key="nightly-group"), T0)
    assert first.group_key == "nightly-group"
    assert [s.group_key for s in await store.list_schedules(None)] == ["nightly-group"]
    (due,), _ = await store.due_schedules(T0 + SEC, 10)
    assert due.group_key == "nightly-group"
    task = dataclasses.replace(slot_task(due, T0 + SEC), group_key=due.group_key)
    fired = await store.fire_schedule(due, [task], T0 + SEC, T0 + 2 * SEC, T0 + SEC)
    assert fired is not None and fired[0][0].row.group_key == "nightly-group"
    assert (await row(store, fired[0][0].row.seq)).group_key == "nightly-group"
    replaced = await store.put_schedule(sched(group_key=""), T0 + 2 * SEC)
    assert replaced.group_key == "" and (await store.list_schedules(None))[0].group_key == ""
