"""The Store contract (store/base.py), run against every backend in conftest.BACKENDS.

Every call passes an explicit `now` (µs), so no test depends on the clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from cronoq_server.errors import ApiError
from cronoq_server.ids import make_task_id
from cronoq_server.store.base import (
    NewTask,
    Outcome,
    OutcomeKind,
    State,
    Store,
    StoreOwnedElsewhere,
    StoreSettings,
    TaskRow,
    WorkerRow,
)

T0 = 1_700_000_000_000_000  # µs
SEC = 1_000_000


def new(
    pool: str = "default",
    key: str | None = None,
    *,
    payload: bytes = b"payload",
    content_type: str = "",
    priority: int = 0,
    run_at: int | None = None,
    max_attempts: int = 3,
    dep_seqs: list[int] | None = None,
    dep_keys: list[str] | None = None,
    dep_batch: list[int] | None = None,
) -> NewTask:
    return NewTask(
        pool=pool,
        key=key,
        payload=payload,
        content_type=content_type,
        priority=priority,
        run_at=run_at,
        max_attempts=max_attempts,
        dep_seqs=list(dep_seqs or []),
        dep_keys=list(dep_keys or []),
        dep_batch=list(dep_batch or []),
    )


async def submit_one(store: Store, now: int = T0, **kw: Any) -> TaskRow:
    (sub,), _ = await store.submit([new(**kw)], now)
    return sub.row


async def row(store: Store, seq: int) -> TaskRow:
    got = await store.get(seq)
    assert got is not None, f"task seq {seq} is gone"
    return got


async def states(store: Store, *seqs: int) -> list[State]:
    return [(await row(store, s)).state for s in seqs]


async def lease_one(store: Store, seq: int, now: int = T0, worker: str = "w1", pool: str = "default") -> TaskRow:
    rows, _ = await store.lease(worker, [pool], 1, now)
    assert [r.seq for r in rows] == [seq]
    return rows[0]


def success(task: TaskRow, result: bytes = b"done") -> Outcome:
    return Outcome(task.seq, task.attempt, OutcomeKind.SUCCESS, result=result, result_content_type="text/plain")


def failure(task: TaskRow, error: str = "boom", retryable: bool = True, retry_after_ms: int = 0) -> Outcome:
    return Outcome(
        task.seq, task.attempt, OutcomeKind.FAILURE, error=error, retryable=retryable, retry_after_ms=retry_after_ms
    )


async def finish_ok(store: Store, outcome: Outcome, now: int) -> None:
    """Reports the outcome as the worker that holds the task."""
    holder = await store.get(outcome.seq)
    results, _ = await store.finish(holder.worker_id if holder and holder.worker_id else "w1", [outcome], now)
    assert results[0].accepted, results[0]


async def run_to_success(store: Store, seq: int, now: int, pool: str = "default") -> None:
    await finish_ok(store, success(await lease_one(store, seq, now, pool=pool)), now)


async def run_to_failure(store: Store, seq: int, now: int) -> None:
    await finish_ok(store, failure(await lease_one(store, seq, now), retryable=False), now)


# -- submit ---------------------------------------------------------------------


async def test_submit_creates_pending_rows_in_sequence(store: Store) -> None:
    subs, changes = await store.submit(
        [new(payload=b"a", content_type="application/json"), new("other", "k2", priority=5), new(run_at=T0 + SEC)], T0
    )
    assert [s.row.seq for s in subs] == [1, 2, 3]
    assert not any(s.deduplicated for s in subs)
    assert changes == [(1, State.PENDING), (2, State.PENDING), (3, State.PENDING)]
    first, second, third = [await row(store, s) for s in (1, 2, 3)]
    assert (first.pool, first.key, first.payload, first.content_type) == ("default", None, b"a", "application/json")
    assert (first.state, first.attempt, first.worker_id, first.run_at, first.created_at) == (
        State.PENDING,
        0,
        None,
        T0,
        T0,
    )
    assert first.started_at is None and first.finished_at is None and first.lease_expires_at is None
    assert (second.pool, second.key, second.priority) == ("other", "k2", 5)
    assert third.run_at == T0 + SEC
    assert await store.get(4) is None
    assert sorted(r.seq for r in await store.get_many([3, 1, 99])) == [1, 3]
    assert await store.get_many([]) == []
    assert (await store.get_by_key("k2")).seq == 2  # type: ignore[union-attr]
    assert await store.get_by_key("nope") is None


async def test_key_deduplicates(store: Store) -> None:
    first = await submit_one(store, key="invoice-42", payload=b"one")
    (sub,), changes = await store.submit([new(key="invoice-42", payload=b"two")], T0 + 5)
    assert sub.deduplicated and sub.row.seq == first.seq
    assert sub.row.payload == b"one" and sub.row.created_at == T0
    assert changes == []
    assert [r.seq for r in await store.list_tasks(None, None, 0, 100)] == [first.seq]


async def test_newest_first_lists_in_descending_seq_order_before_the_bound(store: Store) -> None:
    seqs = [(await submit_one(store, pool="a" if i % 2 else "b")).seq for i in range(5)]
    assert [r.seq for r in await store.list_tasks(None, None, 0, 3, newest_first=True)] == seqs[::-1][:3]
    assert [r.seq for r in await store.list_tasks(None, None, seqs[2], 100, newest_first=True)] == seqs[1::-1]
    assert [r.seq for r in await store.list_tasks(["a"], None, 0, 100, newest_first=True)] == seqs[3::-2]
    assert [r.seq for r in await store.list_tasks(None, None, 0, 100)] == seqs  # the default is unchanged


async def test_batch_is_atomic(store: Store) -> None:
    batch = [new(key="a"), new(key="b"), new(key="c", dep_seqs=[999])]
    with pytest.raises(ApiError) as err:
        await store.submit(batch, T0)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ApiError) as err:
        await store.submit([new(key="a"), new(key="b"), new(key="c", dep_keys=["missing"])], T0)
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "missing" in err.value.message
    assert await store.list_tasks(None, None, 0, 100) == []
    assert await store.get_by_key("a") is None
    assert await store.count_by_pool_and_state() == {}


# -- dependencies ---------------------------------------------------------------


async def test_dependencies_by_seq_key_and_batch_index_block(store: Store) -> None:
    dep = await submit_one(store, key="dep")
    subs, changes = await store.submit(
        [new(dep_seqs=[dep.seq]), new(dep_keys=["dep"]), new(key="first"), new(dep_batch=[2])], T0
    )
    by_seq, by_key, first, by_index = (s.row for s in subs)
    assert by_seq.state == by_key.state == by_index.state == State.BLOCKED
    assert first.state == State.PENDING
    assert by_seq.depends_on == by_key.depends_on == [dep.seq]
    assert by_index.depends_on == [first.seq]
    assert (by_seq.seq, State.BLOCKED) in changes
    rows, _ = await store.lease("w1", ["default"], 10, T0)
    assert sorted(r.seq for r in rows) == [dep.seq, first.seq]  # blocked tasks are not leased


async def test_success_unblocks_after_every_dependency(store: Store) -> None:
    a = await submit_one(store, key="a")
    b = await submit_one(store, key="b")
    one = await submit_one(store, dep_seqs=[a.seq])
    both = await submit_one(store, dep_keys=["a", "b"])
    leased, _ = await store.lease("w1", ["default"], 2, T0)
    assert [r.seq for r in leased] == [a.seq, b.seq]
    _, changes = await store.finish("w1", [success(leased[0])], T0 + 1)
    assert (one.seq, State.PENDING) in changes
    assert await states(store, one.seq, both.seq) == [State.PENDING, State.BLOCKED]
    _, changes = await store.finish("w1", [success(leased[1])], T0 + 2)
    assert (both.seq, State.PENDING) in changes
    assert await states(store, both.seq) == [State.PENDING]


async def test_two_dependencies_succeeding_together_unblock(store: Store) -> None:
    a, b = await submit_one(store), await submit_one(store)
    both = await submit_one(store, dep_seqs=[a.seq, b.seq])
    leased, _ = await store.lease("w1", ["default"], 2, T0)
    results, _ = await store.finish("w1", [success(t) for t in leased], T0 + 1)
    assert all(r.accepted for r in results)
    assert await states(store, both.seq) == [State.PENDING]


async def test_failure_fails_dependents_transitively(open_store: Any) -> None:
    store: Store = await open_store(shard_name="s3", shard_number=3)
    a = await submit_one(store)
    b = await submit_one(store, dep_seqs=[a.seq])
    c = await submit_one(store, dep_seqs=[b.seq])
    d = await submit_one(store, dep_seqs=[c.seq])
    other = await submit_one(store)
    _, changes = await store.finish("w1", [failure(await lease_one(store, a.seq), retryable=False)], T0 + 1)
    assert await states(store, a.seq, b.seq, c.seq, d.seq, other.seq) == [
        State.FAILED,
        State.FAILED,
        State.FAILED,
        State.FAILED,
        State.PENDING,
    ]
    assert {(s, State.FAILED) for s in (a.seq, b.seq, c.seq, d.seq)} <= set(changes)
    failed_b = await row(store, b.seq)
    assert str(make_task_id(3, a.seq)) in failed_b.error
    assert failed_b.finished_at == T0 + 1
    assert str(make_task_id(3, c.seq)) in (await row(store, d.seq)).error


async def test_cancelling_a_dependency_cancels_dependents(store: Store) -> None:
    a = await submit_one(store)
    b = await submit_one(store, dep_seqs=[a.seq])
    c = await submit_one(store, dep_seqs=[b.seq])
    cancelled, changes = await store.cancel(a.seq, T0 + 1)
    assert cancelled is not None and cancelled.state == State.CANCELLED
    assert await states(store, a.seq, b.seq, c.seq) == [State.CANCELLED] * 3
    assert {(b.seq, State.CANCELLED), (c.seq, State.CANCELLED)} <= set(changes)
    assert str(a.seq) in (await row(store, b.seq)).error


async def test_depending_on_an_ended_task(store: Store) -> None:
    failed, cancelled, succeeded = await submit_one(store), await submit_one(store), await submit_one(store)
    await run_to_failure(store, failed.seq, T0)
    await store.cancel(cancelled.seq, T0)
    await run_to_success(store, succeeded.seq, T0)
    subs, changes = await store.submit(
        [new(dep_seqs=[failed.seq]), new(dep_seqs=[cancelled.seq]), new(dep_seqs=[succeeded.seq])], T0 + 7
    )
    on_failed, on_cancelled, on_succeeded = (s.row for s in subs)
    assert on_failed.state == State.FAILED and str(failed.seq) in on_failed.error
    assert on_failed.finished_at == T0 + 7
    assert on_cancelled.state == State.CANCELLED
    assert on_succeeded.state == State.PENDING
    assert changes == [
        (on_failed.seq, State.FAILED),
        (on_cancelled.seq, State.CANCELLED),
        (on_succeeded.seq, State.PENDING),
    ]


# -- leases ---------------------------------------------------------------------


async def test_lease_order_priority_then_run_at_then_seq(store: Store) -> None:
    await store.submit(
        [
            new(priority=0, run_at=T0 - 10),  # 1
            new(priority=5, run_at=T0 - 1),  # 2
            new(priority=5, run_at=T0 - 2),  # 3
            new(priority=-1, run_at=T0 - 100),  # 4
            new(priority=0, run_at=T0 - 10),  # 5
            new(priority=5, run_at=T0 - 2),  # 6
        ],
        T0 - 200,
    )
    rows, next_due = await store.lease("w1", ["default"], 10, T0)
    assert [r.seq for r in rows] == [3, 6, 2, 1, 5, 4]
    assert next_due is None


async def test_future_run_at_is_not_leased(store: Store) -> None:
    assert await store.lease("w1", ["default"], 10, T0) == ([], None)
    later = await submit_one(store, run_at=T0 + 5 * SEC)
    await submit_one(store, run_at=T0 + 9 * SEC)
    rows, next_due = await store.lease("w1", ["default"], 10, T0)
    assert rows == [] and next_due == T0 + 5 * SEC
    rows, _ = await store.lease("w1", ["default"], 10, T0 + 5 * SEC)
    assert [r.seq for r in rows] == [later.seq]


async def test_lease_respects_limit_and_pools(store: Store) -> None:
    await store.submit([new("default"), new("other"), new("default"), new("other"), new("default")], T0)
    rows, _ = await store.lease("w1", ["other"], 10, T0)
    assert [r.seq for r in rows] == [2, 4]
    rows, _ = await store.lease("w1", ["default"], 2, T0)
    assert [r.seq for r in rows] == [1, 3]
    rows, _ = await store.lease("w1", ["default", "other"], 10, T0)
    assert [r.seq for r in rows] == [5]


async def test_lease_marks_running(store: Store, settings: StoreSettings) -> None:
    await store.submit([new("default"), new("other")], T0)
    rows, _ = await store.lease("w1", ["default", "other"], 10, T0 + 3)
    for leased in rows:
        stored = await row(store, leased.seq)
        assert stored == leased
        assert (stored.state, stored.attempt, stored.worker_id, stored.started_at) == (State.RUNNING, 1, "w1", T0 + 3)
        assert stored.lease_expires_at == T0 + 3 + settings.lease_ttl_us[stored.pool]
    assert rows[0].lease_expires_at != rows[1].lease_expires_at  # each pool's own TTL


# -- finish ---------------------------------------------------------------------


async def test_finish_success(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    results, changes = await store.finish("w1", [success(task, b"42")], T0 + 9)
    assert [(r.seq, r.accepted) for r in results] == [(task.seq, True)]
    assert changes == [(task.seq, State.SUCCEEDED)]
    done = await row(store, task.seq)
    assert (done.state, done.result, done.result_content_type, done.finished_at) == (
        State.SUCCEEDED,
        b"42",
        "text/plain",
        T0 + 9,
    )
    assert done.lease_expires_at is None


async def test_second_finish_of_an_attempt_is_refused(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    await finish_ok(store, success(task, b"first"), T0 + 1)
    before = await row(store, task.seq)
    results, changes = await store.finish("w1", [failure(task, retryable=False)], T0 + 2)
    assert not results[0].accepted and results[0].code == "FAILED_PRECONDITION"
    assert str(task.seq) in results[0].message
    assert changes == []
    assert await row(store, task.seq) == before


async def test_duplicate_outcomes_in_one_report_count_once(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    results, _ = await store.finish("w1", [success(task, b"one"), success(task, b"two")], T0 + 1)
    assert [r.accepted for r in results] == [True, False]
    assert (await row(store, task.seq)).result == b"one"


async def test_finish_of_unknown_task(store: Store) -> None:
    results, changes = await store.finish("w1", [Outcome(77, 1, OutcomeKind.SUCCESS)], T0)
    assert [(r.seq, r.accepted, r.code) for r in results] == [(77, False, "FAILED_PRECONDITION")]
    assert results[0].message == "task 77 is not leased to worker w1 at attempt 1"
    assert changes == []


async def test_retryable_failure_with_attempts_left_is_retried(store: Store, settings: StoreSettings) -> None:
    task = await lease_one(store, (await submit_one(store, max_attempts=3)).seq)
    results, changes = await store.finish("w1", [failure(task, "flaky")], T0 + 10)
    assert results[0].accepted and changes == [(task.seq, State.PENDING)]
    retried = await row(store, task.seq)
    assert (retried.state, retried.error, retried.attempt, retried.worker_id) == (State.PENDING, "flaky", 1, None)
    assert retried.run_at == settings.retry_at("default", 1, T0 + 10, 0) == T0 + 10 + 1000
    assert retried.lease_expires_at is None and retried.finished_at is None
    assert (await store.lease("w1", ["default"], 1, T0 + 10))[0] == []
    again = await lease_one(store, task.seq, T0 + 10 + 1000, worker="w2")
    assert (again.attempt, again.worker_id) == (2, "w2")
    await finish_ok(store, failure(again, "slow down", retry_after_ms=250), T0 + 2 * SEC)
    assert (await row(store, task.seq)).run_at == T0 + 2 * SEC + 250_000


async def test_stale_attempt_is_refused_after_retry(store: Store) -> None:
    first = await lease_one(store, (await submit_one(store)).seq)
    await finish_ok(store, failure(first), T0 + 1)
    second = await lease_one(store, first.seq, T0 + SEC)
    results, _ = await store.finish("w1", [success(first)], T0 + SEC + 1)
    assert results[0].code == "FAILED_PRECONDITION"
    assert (await row(store, first.seq)).state == State.RUNNING
    await finish_ok(store, success(second), T0 + SEC + 2)


async def test_non_retryable_or_last_attempt_fails(store: Store) -> None:
    non_retryable = await lease_one(store, (await submit_one(store, max_attempts=5)).seq)
    await finish_ok(store, failure(non_retryable, "bad input", retryable=False), T0 + 1)
    last = await lease_one(store, (await submit_one(store, max_attempts=1)).seq)
    _, changes = await store.finish("w1", [failure(last, "still broken")], T0 + 2)
    assert changes == [(last.seq, State.FAILED)]
    for seq, error, finished in ((non_retryable.seq, "bad input", T0 + 1), (last.seq, "still broken", T0 + 2)):
        ended = await row(store, seq)
        assert (ended.state, ended.error, ended.finished_at) == (State.FAILED, error, finished)


async def test_cancelled_outcome(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    _, changes = await store.finish("w1", [Outcome(task.seq, task.attempt, OutcomeKind.CANCELLED)], T0 + 1)
    assert changes == [(task.seq, State.CANCELLED)]
    assert (await row(store, task.seq)).state == State.CANCELLED


# -- heartbeat and expiry -------------------------------------------------------


async def test_heartbeat(store: Store, settings: StoreSettings) -> None:
    await store.submit([new(), new(), new()], T0)
    mine, _ = await store.lease("w1", ["default"], 2, T0)
    theirs = await lease_one(store, 3, T0, worker="w2")
    await store.cancel(mine[1].seq, T0 + 1)
    attempts = [(t.seq, t.attempt) for t in mine] + [(theirs.seq, theirs.attempt), (mine[0].seq, 7), (404, 1)]
    cancelled, lost = await store.heartbeat("w1", attempts, T0 + 5 * SEC)
    assert cancelled == [mine[1].seq]
    assert sorted(lost) == sorted([theirs.seq, mine[0].seq, 404])  # another's task, a stale attempt, a gone task
    ttl = settings.lease_ttl_us["default"]
    assert (await row(store, mine[0].seq)).lease_expires_at == T0 + 5 * SEC + ttl
    assert (await row(store, theirs.seq)).lease_expires_at == T0 + ttl  # not extended by w1
    await finish_ok(store, success(mine[0]), T0 + 6 * SEC)
    _, lost = await store.heartbeat("w1", [(mine[0].seq, mine[0].attempt)], T0 + 7 * SEC)
    assert lost == [mine[0].seq]  # finished: no longer held


async def test_expired_leases_are_retried_then_failed(store: Store, settings: StoreSettings) -> None:
    retried = await submit_one(store, max_attempts=2)
    await store.lease("w1", ["default"], 1, T0)
    ttl = settings.lease_ttl_us["default"]
    assert await store.expire_leases(T0 + ttl - 1) == ([], [])
    changes, _ = await store.expire_leases(T0 + ttl + 1)
    assert changes == [(retried.seq, State.PENDING)]
    after = await row(store, retried.seq)
    assert (after.state, after.error, after.worker_id) == (State.PENDING, "lease expired", None)
    assert after.run_at == settings.retry_at("default", 1, T0 + ttl + 1, 0)
    second = await lease_one(store, retried.seq, after.run_at)
    # A heartbeat keeps the lease past the first expiry.
    await store.heartbeat("w1", [(second.seq, second.attempt)], after.run_at + ttl - 1)
    assert await store.expire_leases(after.run_at + ttl + 1) == ([], [])
    changes, _ = await store.expire_leases(after.run_at + 2 * ttl)
    assert changes == [(retried.seq, State.FAILED)]
    failed = await row(store, retried.seq)
    assert (failed.state, failed.error, failed.attempt) == (State.FAILED, "lease expired", 2)


async def test_expiry_on_the_last_attempt_fails_dependents(store: Store, settings: StoreSettings) -> None:
    dep = await submit_one(store, max_attempts=1)
    dependent = await submit_one(store, dep_seqs=[dep.seq])
    await lease_one(store, dep.seq)
    changes, _ = await store.expire_leases(T0 + settings.lease_ttl_us["default"] + 1)
    assert set(changes) == {(dep.seq, State.FAILED), (dependent.seq, State.FAILED)}


# -- cancel ---------------------------------------------------------------------


async def test_cancel_pending_and_blocked_at_once(store: Store) -> None:
    pending = await submit_one(store)
    blocked = await submit_one(store, dep_seqs=[pending.seq])
    other_dep = await submit_one(store)
    blocked_too = await submit_one(store, dep_seqs=[other_dep.seq])
    for task in (blocked_too, pending):
        ended, changes = await store.cancel(task.seq, T0 + 3)
        assert ended is not None and (ended.state, ended.finished_at) == (State.CANCELLED, T0 + 3)
        assert changes[0] == (task.seq, State.CANCELLED)
    assert await states(store, blocked.seq, other_dep.seq) == [State.CANCELLED, State.PENDING]


async def test_cancel_running_requests_then_ends_cancelled(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    requested, changes = await store.cancel(task.seq, T0 + 1)
    assert requested is not None and (requested.state, requested.cancel_requested) == (State.RUNNING, True)
    assert changes == [(task.seq, State.RUNNING)]
    again, changes = await store.cancel(task.seq, T0 + 2)
    assert again is not None and again.cancel_requested and changes == []
    _, changes = await store.finish("w1", [success(task)], T0 + 3)
    assert changes == [(task.seq, State.CANCELLED)]
    assert (await row(store, task.seq)).state == State.CANCELLED


async def test_cancel_requested_failure_is_not_retried(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store, max_attempts=5)).seq)
    await store.cancel(task.seq, T0 + 1)
    await finish_ok(store, failure(task), T0 + 2)
    assert (await row(store, task.seq)).state == State.CANCELLED


async def test_cancel_of_terminal_or_unknown_task_changes_nothing(store: Store) -> None:
    done = await submit_one(store)
    await run_to_success(store, done.seq, T0)
    before = await row(store, done.seq)
    after, changes = await store.cancel(done.seq, T0 + 5)
    assert after == before and changes == []
    assert await row(store, done.seq) == before
    assert await store.cancel(999, T0) == (None, [])


# -- purge ----------------------------------------------------------------------


async def test_purge_deletes_only_terminal_tasks_past_retention(store: Store, settings: StoreSettings) -> None:
    old_default = await submit_one(store, pool="default")
    old_other = await submit_one(store, pool="other")
    pending = await submit_one(store, pool="default")
    blocked = await submit_one(store, pool="default", dep_seqs=[pending.seq])
    running = await submit_one(store, pool="other", run_at=T0 + 1)
    await store.cancel(old_default.seq, T0)
    await run_to_success(store, old_other.seq, T0, pool="other")
    await lease_one(store, running.seq, T0 + 1, pool="other")
    recent = await submit_one(store, pool="default", now=T0 + 10)
    await store.cancel(recent.seq, T0 + 10)
    keep_default = settings.retention_us["default"]
    assert await store.purge(T0 + keep_default, 1000) == 0
    assert await store.purge(T0 + keep_default + 1, 1000) == 1
    assert await store.get(old_default.seq) is None
    assert await store.get(old_other.seq) is not None and await store.get(recent.seq) is not None
    far = T0 + settings.retention_us["other"] + keep_default
    assert await store.purge(far, 1000) == 2
    left = sorted(r.seq for r in await store.list_tasks(None, None, 0, 100))
    assert left == sorted([pending.seq, blocked.seq, running.seq])


# -- limits ---------------------------------------------------------------------


async def test_max_pending_total(open_store: Any) -> None:
    store: Store = await open_store(max_pending_total=3)
    await store.submit([new(key="a"), new("other")], T0)
    with pytest.raises(ApiError) as err:
        await store.submit([new(key="b"), new(key="c")], T0)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_pending_total" in err.value.message
    assert len(await store.list_tasks(None, None, 0, 100)) == 2 and await store.get_by_key("b") is None
    (dup,), _ = await store.submit([new(key="a")], T0)  # a duplicate adds nothing, so it is admitted
    assert dup.deduplicated
    await submit_one(store, key="b")
    with pytest.raises(ApiError):
        await submit_one(store)
    # Ending a task frees room.
    await run_to_success(store, 1, T0)
    await submit_one(store)


async def test_max_pending_per_pool(open_store: Any) -> None:
    store: Store = await open_store(max_pending_per_pool=2)
    await store.submit([new(), new()], T0)
    with pytest.raises(ApiError) as err:
        await store.submit([new("other"), new("default")], T0)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "'default'" in err.value.message
    assert await store.count_by_pool_and_state() == {("default", State.PENDING): 2}
    await store.submit([new("other"), new("other")], T0)


# -- listings -------------------------------------------------------------------


async def test_list_tasks_pages_by_seq_with_filters(store: Store) -> None:
    await store.submit([new("default"), new("other"), new("default"), new("other"), new("default")], T0)
    await store.cancel(3, T0)
    pages, after = [], 0
    while page := await store.list_tasks(None, None, after, 2):
        pages.append([r.seq for r in page])
        after = page[-1].seq
    assert pages == [[1, 2], [3, 4], [5]]
    assert [r.seq for r in await store.list_tasks(["other"], None, 0, 10)] == [2, 4]
    assert [r.seq for r in await store.list_tasks(["default"], None, 1, 10)] == [3, 5]
    assert [r.seq for r in await store.list_tasks(None, State.CANCELLED, 0, 10)] == [3]
    assert [r.seq for r in await store.list_tasks(["default"], State.PENDING, 0, 10)] == [1, 5]
    assert await store.list_tasks(["other"], State.CANCELLED, 0, 10) == []
    assert await store.list_tasks([], None, 0, 10) == []


async def test_workers(store: Store) -> None:
    w2 = WorkerRow("w2", "beta", ["other"], 4, {"zone": "b"}, T0, T0, principal="token-b")
    w1 = WorkerRow("w1", "alpha", ["default", "other"], 8, {}, T0, T0, principal="token-a")
    await store.register_worker(w2)
    await store.register_worker(w1)
    assert await store.get_worker("w1") == w1
    assert await store.get_worker("nobody") is None
    assert [w.id for w in await store.list_workers()] == ["w1", "w2"]
    await store.heartbeat("w2", [], T0 + 5)
    assert (await store.get_worker("w2")).last_seen_at == T0 + 5  # type: ignore[union-attr]
    await store.deregister_worker("w1")
    assert [w.id for w in await store.list_workers()] == ["w2"]
    await store.deregister_worker("w1")  # twice is harmless


async def test_count_by_pool_and_state(store: Store) -> None:
    await store.submit([new(), new(), new("other"), new("other", dep_seqs=[3])], T0)
    await lease_one(store, 1)
    assert await store.count_by_pool_and_state() == {
        ("default", State.RUNNING): 1,
        ("default", State.PENDING): 1,
        ("other", State.PENDING): 1,
        ("other", State.BLOCKED): 1,
    }


# -- durability and ownership ---------------------------------------------------


async def test_reopened_store_keeps_everything(open_store: Any) -> None:
    store: Store = await open_store()
    await store.submit([new(key="a"), new(key="b"), new(dep_keys=["a"])], T0)
    leased = await lease_one(store, 1)
    await store.register_worker(WorkerRow("w1", "alpha", ["default"], 1, {}, T0, T0))
    before = [await row(store, s) for s in (1, 2, 3)]
    await store.close()

    reopened: Store = await open_store()
    assert [await row(reopened, s) for s in (1, 2, 3)] == before
    assert (await reopened.get_worker("w1")) is not None
    assert (await submit_one(reopened, key="b")).seq == 2  # keys still dedup
    assert (await submit_one(reopened)).seq == 4  # the sequence continues
    await finish_ok(reopened, success(leased), T0 + 1)  # the lease is still valid
    assert await states(reopened, 3) == [State.PENDING]


@pytest.mark.parametrize("owner", [("s1", 1), ("unsharded", 1), ("s1", 0)])
async def test_store_of_another_shard_is_refused(open_store: Any, owner: tuple[str, int]) -> None:
    first: Store = await open_store(shard_name=owner[0], shard_number=owner[1])
    await submit_one(first)
    await first.close()
    with pytest.raises(StoreOwnedElsewhere):
        await open_store()  # shard "unsharded", number 0


# -- group commit ---------------------------------------------------------------


async def test_concurrent_submits_all_commit(store: Store) -> None:
    results = await asyncio.gather(*(store.submit([new(key=f"k{i}")], T0 + i) for i in range(50)))
    seqs = sorted(subs[0].row.seq for subs, _ in results)
    assert seqs == list(range(1, 51))
    assert len(await store.list_tasks(None, None, 0, 100)) == 50


async def test_one_failing_submit_does_not_sink_its_group(store: Store) -> None:
    def batch(i: int) -> list[NewTask]:
        if i == 25:
            return [new(key="bad-1"), new(key="bad-2", dep_seqs=[10_000])]
        return [new(key=f"k{i}")]

    results = await asyncio.gather(*(store.submit(batch(i), T0) for i in range(50)), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], ApiError) and errors[0].code == grpc.StatusCode.NOT_FOUND
    assert isinstance(results[25], ApiError)
    rows = await store.list_tasks(None, None, 0, 100)
    assert sorted(r.key or "" for r in rows) == sorted(f"k{i}" for i in range(50) if i != 25)
    assert await store.get_by_key("bad-1") is None


async def test_concurrent_submits_of_one_key_create_one_task(store: Store) -> None:
    results = await asyncio.gather(*(store.submit([new(key="once", payload=bytes([i]))], T0) for i in range(20)))
    subs = [s for subs, _ in results for s in subs]
    assert len({s.row.seq for s in subs}) == 1
    assert sum(not s.deduplicated for s in subs) == 1


async def test_concurrent_leases_never_share_a_task(store: Store) -> None:
    await store.submit([new() for _ in range(20)], T0)
    results = await asyncio.gather(*(store.lease(f"w{i}", ["default"], 6, T0) for i in range(5)))
    leased = [r.seq for rows, _ in results for r in rows]
    assert sorted(leased) == list(range(1, 21))


async def test_finish_reports_after_a_sweep_saw_nothing_blocked(store: Store) -> None:
    """Once the leader's sweep has seen no BLOCKED task, backends may take a faster finish path:
    it must keep the same fencing by attempt and the same cancel-wins rule."""
    for _ in range(3):
        await submit_one(store)
    await store.expire_leases(T0)  # the sweep: nothing BLOCKED
    first, second, third = [await lease_one(store, seq) for seq in (1, 2, 3)]
    await store.cancel(3, T0 + 1)
    results, changes = await store.finish(
        "w1",
        [
            Outcome(1, first.attempt, OutcomeKind.SUCCESS, result=b"r1"),
            Outcome(2, second.attempt + 1, OutcomeKind.SUCCESS),  # a stale attempt
            Outcome(3, third.attempt, OutcomeKind.SUCCESS),
            Outcome(99, 1, OutcomeKind.SUCCESS),
        ],
        T0 + 2,
    )
    assert [(r.seq, r.accepted, r.code) for r in results] == [
        (1, True, ""),
        (2, False, "FAILED_PRECONDITION"),
        (3, True, ""),
        (99, False, "FAILED_PRECONDITION"),
    ]
    assert sorted(changes) == [(1, State.SUCCEEDED), (3, State.CANCELLED)]
    assert (await row(store, 1)).result == b"r1"
    assert (await row(store, 2)).state == State.RUNNING
    assert (await row(store, 3)).state == State.CANCELLED


# -- hardening: fencing by worker, release, keys across pools, request ids, sizes ---------


@pytest.mark.parametrize("after_sweep", [False, True], ids=["slow-path", "fast-path"])
async def test_outcome_from_another_worker_is_refused_and_changes_nothing(store: Store, after_sweep: bool) -> None:
    task = await lease_one(store, (await submit_one(store)).seq, worker="w1")
    if after_sweep:
        await store.expire_leases(T0)  # lets a backend take its fast success path
    results, changes = await store.finish("w2", [success(task, b"forged")], T0 + 1)
    full_id = make_task_id(0, task.seq)
    assert [(r.accepted, r.code, r.message) for r in results] == [
        (False, "FAILED_PRECONDITION", f"task {full_id} is not leased to worker w2 at attempt 1")
    ]
    assert changes == []
    now = await row(store, task.seq)
    assert (now.state, now.result, now.worker_id) == (State.RUNNING, None, "w1")
    await finish_ok(store, success(task, b"real"), T0 + 2)  # its own worker still can


async def test_heartbeat_from_another_worker_extends_nothing(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq, worker="w1")
    cancelled, lost = await store.heartbeat("w2", [(task.seq, task.attempt)], T0 + SEC)
    assert (cancelled, lost) == ([], [task.seq])
    assert (await row(store, task.seq)).lease_expires_at == task.lease_expires_at


async def test_released_task_is_pending_at_once_and_the_attempt_not_counted(store: Store) -> None:
    sub = await submit_one(store, max_attempts=1)
    task = await lease_one(store, sub.seq)
    results, changes = await store.finish(
        "w1", [Outcome(task.seq, task.attempt, OutcomeKind.RELEASED, error="worker shut down")], T0 + 5
    )
    assert results[0].accepted and changes == [(task.seq, State.PENDING)]
    again = await row(store, task.seq)
    assert (again.state, again.attempt, again.worker_id, again.run_at) == (State.PENDING, 0, None, sub.run_at)
    second = await lease_one(store, task.seq, T0 + 5, worker="w2")
    assert second.attempt == 1  # max_attempts 1: the release did not use it up
    await finish_ok(store, Outcome(second.seq, 1, OutcomeKind.RELEASED), T0 + 6)
    results, _ = await store.finish("w2", [success(second)], T0 + 7)
    assert not results[0].accepted  # a released attempt is over


async def test_released_task_with_cancel_requested_ends_cancelled(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    await store.cancel(task.seq, T0 + 1)
    _, changes = await store.finish("w1", [Outcome(task.seq, task.attempt, OutcomeKind.RELEASED)], T0 + 2)
    assert changes == [(task.seq, State.CANCELLED)]


async def test_key_of_another_pool_is_refused_with_no_task(store: Store) -> None:
    await submit_one(store, pool="other", key="K", payload=b"secret")
    with pytest.raises(ApiError) as err:
        await store.submit([new("default", "K")], T0 + 1)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert err.value.message == "key 'K' already names a task of another pool"
    with pytest.raises(ApiError) as err:
        await store.submit([new("default", "fresh"), new("default", "K")], T0 + 1)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert [t.key for t in await store.list_tasks(None, None, 0, 100)] == ["K"]  # nothing of the batch


async def test_dependency_in_a_pool_the_caller_may_not_read_is_missing(store: Store) -> None:
    hidden = await submit_one(store, pool="other", key="hidden")
    visible = frozenset({"default"})
    for task, message in (
        (new(dep_seqs=[hidden.seq]), f"depends_on: task {make_task_id(0, hidden.seq)} not found"),
        (new(dep_keys=["hidden"]), "depends_on: no task with key 'hidden'"),
    ):
        with pytest.raises(ApiError) as err:
            await store.submit([task], T0, visible=visible)
        assert (err.value.code, err.value.message) == (grpc.StatusCode.NOT_FOUND, message)
    (sub,), _ = await store.submit([new(dep_keys=["hidden"])], T0)  # visible=None: every pool
    assert sub.row.state == State.BLOCKED


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
async def test_repeated_request_id_returns_what_the_first_call_created(store: Store, keyed: bool) -> None:
    batch = [new(key="k1" if keyed else None), new(key="k2" if keyed else None)]
    first, changes = await store.submit(batch, T0, request_id="req-1")
    assert len(changes) == 2
    again, changes = await store.submit(batch, T0 + SEC, request_id="req-1")
    assert changes == []
    assert [(s.row.seq, s.deduplicated) for s in again] == [(s.row.seq, s.deduplicated) for s in first]
    assert len(await store.list_tasks(None, None, 0, 100)) == 2
    other, _ = await store.submit([new()], T0, request_id="req-2")
    assert other[0].row.seq not in {s.row.seq for s in first}


async def test_concurrent_calls_with_one_request_id_create_once(store: Store) -> None:
    results = await asyncio.gather(*(store.submit([new()], T0, request_id="same") for _ in range(5)))
    assert {subs[0].row.seq for subs, _ in results} == {1}
    assert len(await store.list_tasks(None, None, 0, 100)) == 1


async def test_lease_is_bounded_by_bytes_and_one_task_always_fits(open_store: Any) -> None:
    store = await open_store(lease_overhead_bytes=0)
    await store.submit([new(payload=b"x" * 1000) for _ in range(10)], T0)
    rows, _ = await store.lease("w1", ["default"], 10, T0, max_bytes=3500)
    assert [r.seq for r in rows] == [1, 2, 3]
    rows, _ = await store.lease("w1", ["default"], 10, T0, max_bytes=10)
    assert [r.seq for r in rows] == [4]  # larger than max_bytes, leased alone
    rows, _ = await store.lease("w1", ["default"], 10, T0, max_bytes=0)
    assert [r.seq for r in rows] == [5, 6, 7, 8, 9, 10]


async def test_dependent_is_released_when_a_sweep_ran_during_its_submission(store: Store) -> None:
    """A sweep that finds nothing BLOCKED while a dependent's submission is in flight must not
    let the dependency's success skip releasing it."""
    dep = await lease_one(store, (await submit_one(store)).seq)
    submitting = asyncio.create_task(store.submit([new(dep_seqs=[dep.seq])], T0 + 1))
    await store.expire_leases(T0 + 1)  # the sweep, racing the submission
    (sub,), _ = await submitting
    await store.expire_leases(T0 + 2)
    await finish_ok(store, success(dep), T0 + 3)
    assert (await row(store, sub.row.seq)).state == State.PENDING
