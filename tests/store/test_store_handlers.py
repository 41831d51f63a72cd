"""The Store contract for what handlers report: snoozes (not attempts, bounded by the pool's
max_snoozes), progress and checkpoints (kept by heartbeats and with outcomes, a progress an
event), run against every backend."""

from __future__ import annotations

from conftest import OpenStore
from test_store import SEC, T0, failure, finish_ok, lease_one, row, submit_one, success

from cronoq_server.store.base import AttemptOutcome, Outcome, OutcomeKind, Progress, Report, State, Store


def snooze(task_seq: int, attempt: int, ms: int, reason: str = "") -> Outcome:
    return Outcome(task_seq, attempt, OutcomeKind.SNOOZED, error=reason, retry_after_ms=ms)


async def test_a_snooze_is_pending_later_and_not_an_attempt(store: Store) -> None:
    sub = await submit_one(store, max_attempts=1)
    task = await lease_one(store, sub.seq)
    results, changes = await store.finish("w1", [snooze(task.seq, 1, 30_000, "rate limited")], T0 + SEC)
    assert results[0].accepted and changes == [(task.seq, State.PENDING)]
    again = await row(store, task.seq)
    assert (again.state, again.attempt, again.snoozes, again.worker_id, again.started_at) == (
        State.PENDING,
        0,
        1,
        None,
        None,
    )
    assert again.run_at == T0 + SEC + 30_000 * 1000
    assert (await store.lease("w2", ["default"], 1, T0 + 2 * SEC))[0] == []  # not due yet
    second = await lease_one(store, task.seq, T0 + 31 * SEC, worker="w2")
    assert second.attempt == 1  # max_attempts 1: the snooze did not use it up
    await finish_ok(store, success(second), T0 + 32 * SEC)
    history = [(a.attempt, a.outcome, a.error) for a in await store.attempts(task.seq)]
    assert history == [
        (1, AttemptOutcome.SNOOZED, "snoozed for 30000 ms: rate limited"),
        (1, AttemptOutcome.SUCCEEDED, ""),
    ]


async def test_a_snooze_past_max_snoozes_is_a_failure_that_counts(open_store: OpenStore) -> None:
    store = await open_store(max_snoozes={"default": 1})
    task = await lease_one(store, (await submit_one(store, max_attempts=2)).seq)
    await finish_ok(store, snooze(task.seq, 1, 0), T0 + 1)
    task = await lease_one(store, task.seq, T0 + 2)
    await finish_ok(store, snooze(task.seq, 1, 0), T0 + 3)  # the limit: a failed attempt, retried
    again = await row(store, task.seq)
    assert (again.state, again.attempt, again.snoozes) == (State.PENDING, 1, 1)
    assert again.error == "snoozed 1 times, the pool's max_snoozes"
    task = await lease_one(store, task.seq, T0 + 1000 * SEC)
    await finish_ok(store, snooze(task.seq, 2, 0), T0 + 1001 * SEC)
    assert (await row(store, task.seq)).state == State.FAILED  # out of attempts


async def test_a_snooze_of_a_task_cancelled_meanwhile_ends_it_cancelled(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    await store.cancel(task.seq, T0 + 1)
    _, changes = await store.finish("w1", [snooze(task.seq, 1, 1000)], T0 + 2)
    assert changes == [(task.seq, State.CANCELLED)]


async def test_heartbeat_reports_keep_progress_and_checkpoint_for_the_next_attempt(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    report = Report(task.seq, 1, Progress(0.5, "half", 0), b"page-3")
    assert await store.heartbeat("w1", [(task.seq, 1)], T0 + SEC, [report]) == ([], [])
    kept = await row(store, task.seq)
    assert (kept.progress, kept.checkpoint) == (Progress(0.5, "half", T0 + SEC), b"page-3")
    # A progress alone leaves the checkpoint; an empty checkpoint clears it.
    await store.heartbeat("w1", [(task.seq, 1)], T0 + 2 * SEC, [Report(task.seq, 1, Progress(0.75, "", 0))])
    assert (await row(store, task.seq)).checkpoint == b"page-3"
    await finish_ok(store, failure(task), T0 + 3 * SEC)
    second = await lease_one(store, task.seq, T0 + 100 * SEC, worker="w2")
    assert (second.checkpoint, second.progress) == (b"page-3", Progress(0.75, "", T0 + 2 * SEC))
    await store.heartbeat("w2", [(task.seq, 2)], T0 + 101 * SEC, [Report(task.seq, 2, None, b"")])
    assert not (await row(store, task.seq)).checkpoint


async def test_a_report_of_an_attempt_that_is_not_current_changes_nothing(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    stale = [Report(task.seq, 2, Progress(1, "stale", 0), b"x"), Report(task.seq, 1, Progress(1, "other", 0), b"y")]
    await store.heartbeat("w1", [], T0 + 1, stale[:1])
    await store.heartbeat("w2", [], T0 + 1, stale[1:])  # another worker's
    kept = await row(store, task.seq)
    assert (kept.progress, kept.checkpoint) == (None, None)


async def test_a_report_with_an_outcome_is_kept_before_it(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    outcome = failure(task)
    outcome.report = Report(task.seq, 1, Progress(0.9, "nearly", 0), b"almost")
    await finish_ok(store, outcome, T0 + SEC)
    kept = await row(store, task.seq)
    assert (kept.state, kept.progress, kept.checkpoint) == (
        State.PENDING,
        Progress(0.9, "nearly", T0 + SEC),
        b"almost",
    )


async def test_a_progress_is_an_event_and_a_checkpoint_alone_is_not(store: Store) -> None:
    task = await lease_one(store, (await submit_one(store)).seq)
    last = await store.sequence_events()
    await store.heartbeat("w1", [(task.seq, 1)], T0 + SEC, [Report(task.seq, 1, None, b"c")])
    await store.heartbeat("w1", [(task.seq, 1)], T0 + 2 * SEC, [Report(task.seq, 1, Progress(0.1, "a", 0))])
    await store.sequence_events()
    events = await store.read_events(last, 10)
    assert [(e.task_seq, e.prev_state, e.state, e.at) for e in events] == [
        (task.seq, State.RUNNING, State.RUNNING, T0 + 2 * SEC)
    ]
