"""An operator's actions on ended tasks (retry_tasks, delete_tasks) and the attempt history,
run against every backend in conftest.BACKENDS."""

from __future__ import annotations

from test_store import SEC, T0, failure, finish_ok, lease_one, row, states, submit_one, success
from test_store_events import check_counts_follow_the_events, events, transitions

from cronoq_server.ids import make_task_id
from cronoq_server.store.base import AttemptOutcome, Outcome, OutcomeKind, State, Store, StoreSettings, TaskRow
from cronoq_server.store.logic import dependency_error

P, B, R, F, C = State.PENDING, State.BLOCKED, State.RUNNING, State.FAILED, State.CANCELLED
NOW = T0 + 100 * SEC


async def fail(store: Store, seq: int, now: int = T0, retryable: bool = False, error: str = "boom") -> TaskRow:
    """Leases the task and reports a failure; the row after it."""
    await finish_ok(store, failure(await lease_one(store, seq, now), error, retryable=retryable), now)
    return await row(store, seq)


async def exhaust(store: Store, seq: int, attempts: int) -> TaskRow:
    """Fails every attempt of the task (retryable failures, each due at once after the last)."""
    now = T0
    for _ in range(attempts):
        after = await fail(store, seq, now, retryable=True, error=f"boom {now}")
        now = max(after.run_at, now + 1)
    return after


# -- retry_tasks ----------------------------------------------------------------


async def test_retry_puts_failed_and_cancelled_tasks_back_due_now(store: Store) -> None:
    failed = await submit_one(store, key="f", max_attempts=3)
    failed_row = await fail(store, failed.seq)  # not retryable: 1 of 3 attempts used
    cancelled = await submit_one(store, key="c")
    await store.cancel(cancelled.seq, T0)
    succeeded = await submit_one(store, key="s")
    await finish_ok(store, success(await lease_one(store, succeeded.seq)), T0)
    running = await submit_one(store, key="r", pool="other")
    await lease_one(store, running.seq, pool="other")
    pending = await submit_one(store, key="p")
    untouched = {s: await row(store, s) for s in (pending.seq, running.seq, succeeded.seq)}
    seqs = [failed.seq, cancelled.seq, pending.seq, running.seq, succeeded.seq, 999]
    rows, restored, changes = await store.retry_tasks(seqs, NOW, None, 0)
    assert sorted(r.seq for r in rows) == [failed.seq, cancelled.seq]
    assert (restored, sorted(changes)) == (0, [(failed.seq, P), (cancelled.seq, P)])
    by_seq = {r.seq: r for r in rows}
    for seq in (failed.seq, cancelled.seq):
        got = await row(store, seq)
        assert by_seq[seq] == got
        assert (got.state, got.run_at, got.error, got.result, got.finished_at) == (P, NOW, "", None, None)
        assert (got.worker_id, got.started_at, got.lease_expires_at, got.cancel_requested) == (None, None, None, False)
    # attempts continue; a task with attempts left keeps its max_attempts
    assert (by_seq[failed.seq].attempt, by_seq[failed.seq].max_attempts) == (1, failed_row.max_attempts)
    assert (by_seq[cancelled.seq].attempt, by_seq[cancelled.seq].max_attempts) == (0, cancelled.max_attempts)
    for seq, before in untouched.items():
        assert await row(store, seq) == before
    start = len(await events(store)) - 2
    assert sorted(transitions((await events(store))[start:])) == sorted(
        [(failed.seq, "default", F, P), (cancelled.seq, "default", C, P)]
    )
    await check_counts_follow_the_events(store)
    leased, _ = await store.lease("w1", ["default"], 5, NOW)
    assert {r.seq: r.attempt for r in leased} == {pending.seq: 1, failed.seq: 2, cancelled.seq: 1}


async def test_retry_at_a_given_time(store: Store) -> None:
    task = await submit_one(store)
    await store.cancel(task.seq, T0)
    rows, _, _ = await store.retry_tasks([task.seq], NOW, NOW + 60 * SEC, 0)
    assert rows[0].run_at == NOW + 60 * SEC
    assert (await store.lease("w1", ["default"], 1, NOW))[0] == []


async def test_an_exhausted_task_gets_extra_attempts(store: Store) -> None:
    one = await submit_one(store, key="one", max_attempts=3)
    assert (await exhaust(store, one.seq, 3)).state == F
    five = await submit_one(store, key="five", max_attempts=3)
    await exhaust(store, five.seq, 3)
    (got,), _, _ = await store.retry_tasks([one.seq], NOW, None, 0)  # 0: one more
    assert (got.attempt, got.max_attempts) == (3, 4)
    (got,), _, _ = await store.retry_tasks([five.seq], NOW, None, 5)
    assert (got.attempt, got.max_attempts) == (3, 8)
    leased = await lease_one(store, one.seq, NOW)
    assert leased.attempt == 4
    await finish_ok(store, failure(leased, retryable=True), NOW)  # its last attempt: FAILED again
    assert (await row(store, one.seq)).state == F


async def test_a_cancel_request_does_not_survive_a_retry(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    await store.cancel(task.seq, T0 + 1)
    await finish_ok(store, success(task), T0 + 2)  # cancel wins: CANCELLED
    (got,), _, _ = await store.retry_tasks([task.seq], NOW, None, 0)
    assert (got.state, got.cancel_requested) == (P, False)
    await finish_ok(store, success(await lease_one(store, task.seq, NOW)), NOW)
    assert await states(store, task.seq) == [State.SUCCEEDED]


async def test_retry_restores_the_dependents_it_ended_transitively(store: Store) -> None:
    a = await submit_one(store, key="a")
    b = await submit_one(store, key="b", dep_keys=["a"])
    c = await submit_one(store, key="c", dep_keys=["b"])
    by_hand = await submit_one(store, key="by-hand", dep_keys=["a"])
    await store.cancel(by_hand.seq, T0)  # cancelled by the operator: stays so
    await fail(store, a.seq, T0 + 1)
    late = await submit_one(store, T0 + 2, key="late", dep_keys=["a"])  # FAILED at once
    assert await states(store, b.seq, c.seq, late.seq) == [F, F, F]
    start = len(await events(store))
    rows, restored, changes = await store.retry_tasks([a.seq], NOW, None, 0)
    assert [r.seq for r in rows] == [a.seq] and restored == 3
    assert sorted(changes) == sorted([(a.seq, P), (b.seq, B), (c.seq, B), (late.seq, B)])
    for seq in (b.seq, c.seq, late.seq):
        got = await row(store, seq)
        assert (got.state, got.error, got.finished_at, got.attempt) == (B, "", None, 0)
    assert await states(store, by_hand.seq) == [C]
    assert sorted(transitions((await events(store))[start:])) == sorted(
        [(a.seq, "default", F, P), (b.seq, "default", F, B), (c.seq, "default", F, B), (late.seq, "default", F, B)]
    )
    await check_counts_follow_the_events(store)
    # They run in order once a succeeds.
    await finish_ok(store, success(await lease_one(store, a.seq, NOW)), NOW)
    assert await states(store, b.seq, late.seq, c.seq) == [P, P, B]
    rows, _ = await store.lease("w1", ["default"], 5, NOW)
    assert sorted(r.seq for r in rows) == sorted([b.seq, late.seq])
    await finish_ok(store, success(next(r for r in rows if r.seq == b.seq)), NOW)
    assert await states(store, c.seq) == [P]
    await check_counts_follow_the_events(store)


async def test_a_dependent_still_waiting_for_another_ended_task_stays_ended(store: Store) -> None:
    a = await submit_one(store, key="a")
    q = await submit_one(store, key="q")
    x = await submit_one(store, key="x", dep_keys=["a", "q"])
    await fail(store, a.seq)
    await fail(store, q.seq)
    full = lambda seq: make_task_id(0, seq)  # noqa: E731
    assert (await row(store, x.seq)).error == dependency_error(F, full(a.seq))
    _, restored, changes = await store.retry_tasks([a.seq], NOW, None, 0)
    assert restored == 0 and (x.seq, B) not in changes
    ended = await row(store, x.seq)
    # It now names the dependency it still waits for, so retrying that one brings it back.
    assert (ended.state, ended.error) == (F, dependency_error(F, full(q.seq)))
    _, restored, changes = await store.retry_tasks([q.seq], NOW, None, 0)
    assert restored == 1 and (x.seq, B) in changes
    await check_counts_follow_the_events(store)
    for seq in (a.seq, q.seq):
        await finish_ok(store, success(await lease_one(store, seq, NOW)), NOW)
    assert await states(store, x.seq) == [P]


async def test_only_dependents_of_restorable_pools_wait_again(store: Store) -> None:
    """restorable: the pools whose dependents a retry brings back; the others stay ended, as
    they were, and so do the tasks they ended."""
    a = await submit_one(store, key="a")
    elsewhere = await submit_one(store, key="elsewhere", pool="other", dep_keys=["a"])
    behind = await submit_one(store, key="behind", dep_keys=["elsewhere"])
    near = await submit_one(store, key="near", dep_keys=["a"])
    await fail(store, a.seq)
    ended = {s: await row(store, s) for s in (elsewhere.seq, behind.seq)}
    assert [r.state for r in ended.values()] == [F, F]
    rows, restored, changes = await store.retry_tasks([a.seq], NOW, None, 0, restorable=frozenset({"default"}))
    assert ([r.seq for r in rows], restored) == ([a.seq], 1)
    assert sorted(changes) == sorted([(a.seq, P), (near.seq, B)])
    for seq, before in ended.items():
        assert await row(store, seq) == before
    await check_counts_follow_the_events(store)
    # With both pools restorable, the next retry brings them back.
    await fail(store, a.seq, NOW)
    _, restored, changes = await store.retry_tasks(
        [a.seq], NOW + 1, None, 0, restorable=frozenset({"default", "other"})
    )
    assert restored == 3 and {(elsewhere.seq, B), (behind.seq, B), (near.seq, B)} <= set(changes)
    await check_counts_follow_the_events(store)


async def test_a_task_ended_by_its_dependency_waits_for_it_when_both_are_retried(store: Store) -> None:
    a = await submit_one(store, key="a")
    b = await submit_one(store, key="b", dep_keys=["a"])
    await fail(store, a.seq)
    rows, restored, _ = await store.retry_tasks([b.seq], NOW, None, 0)  # a is still FAILED
    assert (rows, restored) == ([], 0)
    assert await states(store, b.seq) == [F]
    rows, restored, changes = await store.retry_tasks([b.seq, a.seq], NOW, None, 0)
    assert sorted(r.seq for r in rows) == [a.seq, b.seq] and restored == 0
    assert sorted(changes) == sorted([(a.seq, P), (b.seq, B)])
    await finish_ok(store, success(await lease_one(store, a.seq, NOW)), NOW)
    assert await states(store, b.seq) == [P]


async def test_restored_dependents_are_released_after_a_sweep_saw_nothing_blocked(store: Store) -> None:
    """A backend's fast finish path (taken while no task is BLOCKED) must see the dependents a
    retry brought back."""
    a = await submit_one(store, key="a")
    b = await submit_one(store, key="b", dep_keys=["a"])
    await fail(store, a.seq)
    await store.expire_leases(T0 + 1)  # the sweep: nothing is BLOCKED
    await store.retry_tasks([a.seq], NOW, None, 0)
    await finish_ok(store, success(await lease_one(store, a.seq, NOW)), NOW)
    assert await states(store, b.seq) == [P]


# -- delete_tasks ---------------------------------------------------------------


async def test_delete_removes_ended_tasks_with_their_deps_and_attempts(store: Store) -> None:
    a = await submit_one(store, key="a")
    b = await submit_one(store, key="b", dep_keys=["a"])
    pending = await submit_one(store, key="p")
    await fail(store, a.seq)  # b FAILED with it
    late = await submit_one(store, T0 + 1, key="late", dep_keys=["b"])  # FAILED at once
    await store.sequence_events()
    recorded = [(e.seq, e.task_seq) for e in await events(store)]
    assert await store.delete_tasks([a.seq, b.seq, late.seq, pending.seq, 999]) == sorted([a.seq, b.seq, late.seq])
    for seq in (a.seq, b.seq, late.seq):
        assert await store.get(seq) is None
        assert await store.attempts(seq) == []
    assert await store.get(pending.seq) is not None
    assert await store.dependents(a.seq, 10) == []
    assert [(e.seq, e.task_seq) for e in await events(store)] == recorded  # left to age out
    assert await store.get_by_key("a") is None  # the key is free again
    again = await submit_one(store, T0 + 2, key="a")
    assert again.seq > late.seq


# -- attempts -------------------------------------------------------------------


async def test_each_ended_attempt_is_kept_with_its_worker_times_outcome_and_error(store: Store) -> None:
    task = await submit_one(store, max_attempts=5)
    first = await lease_one(store, task.seq, T0, worker="w1")
    await finish_ok(store, failure(first, "first"), T0 + SEC)
    second = await lease_one(store, task.seq, T0 + 2 * SEC, worker="w2")
    await finish_ok(store, failure(second, "second"), T0 + 3 * SEC)
    third = await lease_one(store, task.seq, T0 + 4 * SEC, worker="w1")
    await finish_ok(store, success(third), T0 + 5 * SEC)
    got = [
        (a.attempt, a.worker_id, a.started_at, a.ended_at, a.outcome, a.error) for a in await store.attempts(task.seq)
    ]
    assert got == [
        (1, "w1", T0, T0 + SEC, AttemptOutcome.FAILED, "first"),
        (2, "w2", T0 + 2 * SEC, T0 + 3 * SEC, AttemptOutcome.FAILED, "second"),
        (3, "w1", T0 + 4 * SEC, T0 + 5 * SEC, AttemptOutcome.SUCCEEDED, ""),
    ]
    assert all(a.task_seq == task.seq for a in await store.attempts(task.seq))


async def test_lost_cancelled_and_released_attempts(store: Store, settings: StoreSettings) -> None:
    lost = await submit_one(store, key="lost")
    await lease_one(store, lost.seq, T0)
    await store.expire_leases(T0 + settings.lease_ttl_us["default"] + 1)
    cancelled = await submit_one(store, key="cancelled")
    leased = await lease_one(store, cancelled.seq, T0)
    await finish_ok(store, Outcome(cancelled.seq, leased.attempt, OutcomeKind.CANCELLED, error="stop"), T0 + 1)
    released = await submit_one(store, key="released")
    leased = await lease_one(store, released.seq, T0)
    await finish_ok(store, Outcome(released.seq, leased.attempt, OutcomeKind.RELEASED), T0 + 1)
    assert [(a.outcome, a.error) for a in await store.attempts(lost.seq)] == [(AttemptOutcome.LOST, "lease expired")]
    assert [(a.outcome, a.error) for a in await store.attempts(cancelled.seq)] == [(AttemptOutcome.CANCELLED, "stop")]
    assert await store.attempts(released.seq) == []  # given back: not an attempt
    assert await store.attempts(999) == []


async def test_attempts_of_successes_after_a_sweep_saw_nothing_blocked(store: Store) -> None:
    """A backend's fast finish path records attempts too, a cancel request ending one CANCELLED."""
    done = await submit_one(store, key="done")
    stopped = await submit_one(store, key="stopped")
    await store.expire_leases(T0)  # the sweep
    rows, _ = await store.lease("w1", ["default"], 2, T0)
    await store.cancel(stopped.seq, T0 + 1)
    results, _, _, _ = await store.finish_and_lease("w1", [success(r) for r in rows], ["default"], 1, T0 + 2)
    assert all(r.accepted for r in results)
    assert [
        (a.attempt, a.worker_id, a.started_at, a.ended_at, a.outcome, a.error) for a in await store.attempts(done.seq)
    ] == [(1, "w1", T0, T0 + 2, AttemptOutcome.SUCCEEDED, "")]
    assert [(a.outcome, a.error) for a in await store.attempts(stopped.seq)] == [
        (AttemptOutcome.CANCELLED, "cancelled")
    ]


async def test_attempts_continue_after_a_retry(store: Store) -> None:
    task = await submit_one(store, max_attempts=1)
    await fail(store, task.seq, T0, error="first")
    await store.retry_tasks([task.seq], NOW, None, 0)
    await finish_ok(store, success(await lease_one(store, task.seq, NOW)), NOW + 1)
    assert [(a.attempt, a.outcome) for a in await store.attempts(task.seq)] == [
        (1, AttemptOutcome.FAILED),
        (2, AttemptOutcome.SUCCEEDED),
    ]


async def test_purge_removes_attempts(store: Store, settings: StoreSettings) -> None:
    old = await submit_one(store)
    await fail(store, old.seq, T0)
    assert len(await store.attempts(old.seq)) == 1
    assert await store.purge(T0 + settings.retention_us["default"] + 1, 1000) == 1
    assert await store.attempts(old.seq) == []
