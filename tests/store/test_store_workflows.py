"""The Store contract for workflows: finalizers (run_when), tasks spawned with a success (created
in its transaction, or not at all), dependency results, and cancelling what is under a task;
run against every backend."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from conftest import OpenStore
from test_store import SEC, T0, failure, lease_one, new, row, states, submit_one, success

from cronoq_server.errors import ApiError
from cronoq_server.store.base import RUN_WHEN_ENDED, NewTask, Outcome, OutcomeKind, State, Store, TaskFilter


def finalizer(**kw: object) -> NewTask:
    return dataclasses.replace(new(**kw), run_when=RUN_WHEN_ENDED)  # type: ignore[arg-type]


def spawning(task_seq: int, attempt: int, children: list[NewTask], result: bytes = b"done") -> Outcome:
    return Outcome(task_seq, attempt, OutcomeKind.SUCCESS, result=result, spawn=children)


async def test_a_finalizer_runs_once_every_dependency_ended_whatever_the_outcome(store: Store) -> None:
    a, b = await submit_one(store, key="a"), await submit_one(store, key="b")
    (fin,), _ = await store.submit([finalizer(dep_seqs=[a.seq, b.seq])], T0)
    plain = await submit_one(store, dep_seqs=[a.seq])
    assert fin.row.state == State.BLOCKED and fin.row.run_when == RUN_WHEN_ENDED
    await store.finish("w1", [failure(await lease_one(store, a.seq), retryable=False)], T0 + 1)
    assert await states(store, fin.row.seq, plain.seq) == [State.BLOCKED, State.FAILED]
    await store.finish("w1", [success(await lease_one(store, b.seq))], T0 + 2)
    assert await states(store, fin.row.seq) == [State.PENDING]


async def test_a_finalizer_of_a_cancelled_chain_runs(store: Store) -> None:
    a = await submit_one(store)
    b = await submit_one(store, dep_seqs=[a.seq])  # cancelled with a, never run
    (fin,), _ = await store.submit([finalizer(dep_seqs=[b.seq])], T0)
    _, changes = await store.cancel(a.seq, T0 + 1)
    assert await states(store, a.seq, b.seq, fin.row.seq) == [State.CANCELLED, State.CANCELLED, State.PENDING]
    assert (fin.row.seq, State.PENDING) in changes


async def test_a_finalizer_of_ended_dependencies_is_pending_at_once(store: Store) -> None:
    a = await submit_one(store)
    await store.finish("w1", [failure(await lease_one(store, a.seq), retryable=False)], T0 + 1)
    (fin,), _ = await store.submit([finalizer(dep_seqs=[a.seq])], T0 + 2)
    assert fin.row.state == State.PENDING and fin.row.error == ""


async def test_dependency_rows_give_results_states_and_errors(store: Store) -> None:
    a, b = await submit_one(store, key="a"), await submit_one(store)
    await store.finish("w1", [success(await lease_one(store, a.seq), b"42")], T0 + 1)
    await store.finish("w1", [failure(await lease_one(store, b.seq), "boom", retryable=False)], T0 + 2)
    found = await store.dependency_rows([a.seq, b.seq, 999_999])
    assert set(found) == {a.seq, b.seq}
    assert (found[a.seq].key, found[a.seq].state, found[a.seq].result) == ("a", State.SUCCEEDED, b"42")
    assert (found[b.seq].state, found[b.seq].error) == (State.FAILED, "boom")


async def test_a_submission_whose_ended_dependencies_give_too_much_is_refused(open_store: OpenStore) -> None:
    store = await open_store(max_dependency_results_bytes=100)
    a, b = await submit_one(store), await submit_one(store)
    await store.finish("w1", [success(await lease_one(store, a.seq), b"x" * 60)], T0 + 1)
    await store.finish("w1", [success(await lease_one(store, b.seq), b"y" * 60)], T0 + 2)
    with pytest.raises(ApiError) as err:
        await store.submit([new(key="join", dep_seqs=[a.seq, b.seq])], T0 + 3)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'join'" in err.value.message and "120 bytes" in err.value.message
    assert str(a.seq) in err.value.message and "max_dependency_results_bytes 100" in err.value.message
    assert await store.get_by_key("join") is None
    await store.submit([new(dep_seqs=[a.seq])], T0 + 3)  # one fits


async def test_spawned_tasks_are_created_with_the_success(store: Store) -> None:
    parent = await lease_one(store, (await submit_one(store)).seq)
    children = [new(key="c1"), new(key="c2"), new(key="join", dep_keys=[], dep_batch=[0, 1])]
    with_parent = new(key="after", dep_seqs=[parent.seq])
    results, changes = await store.finish("w1", [spawning(parent.seq, 1, [*children, with_parent])], T0 + SEC)
    assert results[0].accepted
    c1, c2, join, after = [await store.get_by_key(k) for k in ("c1", "c2", "join", "after")]
    assert c1 and c2 and join and after
    assert {t.parent_seq for t in (c1, c2, join, after)} == {parent.seq}
    assert (c1.state, c2.state, join.state, after.state) == (
        State.PENDING,
        State.PENDING,
        State.BLOCKED,
        State.PENDING,  # its parent succeeded in the same transaction
    )
    assert join.depends_on == [c1.seq, c2.seq]
    assert await states(store, parent.seq) == [State.SUCCEEDED]
    assert {(t.seq, t.state) for t in (c1, c2, join, after)} <= set(changes)
    listed = await store.list_matching(TaskFilter(states=frozenset(State), parent_seq=parent.seq), 0, 10)
    assert [t.seq for t in listed] == sorted([c1.seq, c2.seq, join.seq, after.seq])
    for child in (c1, c2):
        await store.finish("w1", [success(await lease_one(store, child.seq, T0 + 2 * SEC))], T0 + 2 * SEC)
    assert await states(store, join.seq) == [State.PENDING]


async def test_a_spawn_that_cannot_be_created_fails_the_attempt_and_creates_nothing(store: Store) -> None:
    await submit_one(store, pool="other", key="taken")
    parent = await lease_one(store, (await submit_one(store, max_attempts=3)).seq)
    children = [new(key="fresh"), new(key="taken")]  # a key of another pool
    results, changes = await store.finish("w1", [spawning(parent.seq, 1, children)], T0 + SEC)
    assert results[0].accepted
    ended = await row(store, parent.seq)
    assert ended.state == State.FAILED and "spawn:" in ended.error and "taken" in ended.error
    assert await store.get_by_key("fresh") is None
    assert (parent.seq, State.FAILED) in changes


async def test_a_stale_attempt_spawns_nothing(store: Store) -> None:
    parent = await lease_one(store, (await submit_one(store)).seq)
    results, _ = await store.finish("w1", [spawning(parent.seq, 2, [new(key="ghost")])], T0 + SEC)
    assert not results[0].accepted
    results, _ = await store.finish("w2", [spawning(parent.seq, 1, [new(key="ghost")])], T0 + SEC)
    assert not results[0].accepted
    assert await store.get_by_key("ghost") is None
    assert await states(store, parent.seq) == [State.RUNNING]


async def test_a_success_after_a_cancel_request_spawns_nothing(store: Store) -> None:
    parent = await lease_one(store, (await submit_one(store)).seq)
    await store.cancel(parent.seq, T0 + 1)
    await store.finish("w1", [spawning(parent.seq, 1, [new(key="ghost")])], T0 + SEC)
    assert await states(store, parent.seq) == [State.CANCELLED]
    assert await store.get_by_key("ghost") is None


async def test_cancel_workflow_cancels_children_their_children_and_dependents(store: Store) -> None:
    root = await lease_one(store, (await submit_one(store)).seq)
    await store.finish("w1", [spawning(root.seq, 1, [new(key="c1"), new(key="c2", pool="other")])], T0 + 1)
    c1 = await store.get_by_key("c1")
    assert c1 is not None
    leased = await lease_one(store, c1.seq, T0 + 1)
    await store.finish("w1", [spawning(leased.seq, 1, [new(key="g1")])], T0 + 2)
    (outside,), _ = await store.submit([new(key="outside", dep_keys=["g1"])], T0 + 3)
    unrelated = await submit_one(store, key="unrelated")
    updated, n, _ = await store.cancel_workflow(root.seq, T0 + 4, frozenset({"default"}))
    assert updated is not None and updated.state == State.SUCCEEDED  # ended already: left as it is
    g1, c2 = await store.get_by_key("g1"), await store.get_by_key("c2")
    assert g1 and c2
    assert await states(store, g1.seq, outside.row.seq, c2.seq, unrelated.seq) == [
        State.CANCELLED,
        State.CANCELLED,
        State.PENDING,  # a pool the caller may not cancel
        State.PENDING,
    ]
    assert n == 2


async def test_a_finalizer_waits_while_its_dependency_is_retried(store: Store) -> None:
    a = await submit_one(store, max_attempts=3)
    (fin,), _ = await store.submit([finalizer(dep_seqs=[a.seq])], T0)
    await store.finish("w1", [failure(await lease_one(store, a.seq))], T0 + 1)
    assert await states(store, a.seq, fin.row.seq) == [State.PENDING, State.BLOCKED]


async def test_a_waiting_finalizer_waits_again_for_a_retried_dependency(store: Store) -> None:
    a, b = await submit_one(store, max_attempts=1), await submit_one(store)
    (fin,), _ = await store.submit([finalizer(dep_seqs=[a.seq, b.seq])], T0)
    await store.finish("w1", [failure(await lease_one(store, a.seq), retryable=False)], T0 + 1)
    await store.retry_tasks([a.seq], T0 + 2, None, 1)
    await store.finish("w1", [success(await lease_one(store, b.seq, T0 + 3))], T0 + 3)
    assert await states(store, a.seq, fin.row.seq) == [State.PENDING, State.BLOCKED]
    await store.finish("w1", [success(await lease_one(store, a.seq, T0 + 4))], T0 + 4)
    assert await states(store, fin.row.seq) == [State.PENDING]
