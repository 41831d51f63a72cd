"""Bulk actions' store half: match_tasks (a filter, in seq order, in batches) and cancel_tasks."""

from __future__ import annotations

from test_store import SEC, T0, failure, finish_ok, lease_one, new, run_to_failure, run_to_success, states, submit_one

from cronoq_server.store.base import TERMINAL, State, Store, TaskFilter

EVERY_STATE = frozenset(State)


def match(**kw: object) -> TaskFilter:
    return TaskFilter(**{"states": EVERY_STATE, **kw})  # type: ignore[arg-type]


async def seqs_of(store: Store, f: TaskFilter, after: int = 0, limit: int = 100) -> list[int]:
    return [seq for seq, _, _ in await store.match_tasks(f, after, limit)]


async def test_match_by_pool_and_state_in_seq_order_after_a_seq(store: Store) -> None:
    a = await submit_one(store)
    b = await submit_one(store, pool="other")
    c = await submit_one(store)
    await run_to_failure(store, a.seq, T0 + 1)
    got = await store.match_tasks(match(), 0, 100)
    assert got == [(a.seq, State.FAILED, "default"), (b.seq, State.PENDING, "other"), (c.seq, State.PENDING, "default")]
    assert await seqs_of(store, match(pools=["default"])) == [a.seq, c.seq]
    assert await seqs_of(store, match(pools=["default", "other"], states=frozenset({State.PENDING}))) == [b.seq, c.seq]
    assert await seqs_of(store, match(), after=a.seq, limit=1) == [b.seq]
    assert await seqs_of(store, match(pools=[])) == []


async def test_match_by_created_and_finished_bounds(store: Store) -> None:
    early = await submit_one(store, now=T0)
    late = await submit_one(store, now=T0 + 10 * SEC)
    await run_to_failure(store, early.seq, T0 + 20 * SEC)
    assert await seqs_of(store, match(created_after=T0 + 10 * SEC)) == [late.seq]  # inclusive
    assert await seqs_of(store, match(created_before=T0 + 10 * SEC)) == [early.seq]  # exclusive
    assert await seqs_of(store, match(finished_after=T0)) == [early.seq]  # the unfinished never match
    assert await seqs_of(store, match(finished_before=T0 + 20 * SEC)) == []
    assert await seqs_of(store, match(finished_after=T0 + 20 * SEC, finished_before=T0 + 21 * SEC)) == [early.seq]


async def test_match_key_prefix_is_text_not_a_pattern(store: Store) -> None:
    pct = await submit_one(store, key="50%_off/1")
    lookalike = await submit_one(store, key="50xyoff/2")
    upper = await submit_one(store, key="50%_OFF/3")
    await submit_one(store)  # no key
    assert await seqs_of(store, match(key_prefix="50%_off")) == [pct.seq]
    assert await seqs_of(store, match(key_prefix="50")) == [pct.seq, lookalike.seq, upper.seq]
    assert await seqs_of(store, match(key_prefix="é")) == []


async def test_match_error_contains_is_case_sensitive_text(store: Store) -> None:
    tasks = [await submit_one(store) for _ in range(3)]
    for task, error in zip(tasks, ["HTTP 503 from api", "100% _done_ wrong", "http 503"], strict=True):
        leased = await lease_one(store, task.seq, T0 + 1)
        await finish_ok(store, failure(leased, error=error, retryable=False), T0 + 2)
    assert await seqs_of(store, match(error_contains="503 from")) == [tasks[0].seq]
    assert await seqs_of(store, match(error_contains="HTTP")) == [tasks[0].seq]
    assert await seqs_of(store, match(error_contains="% _")) == [tasks[1].seq]
    assert await seqs_of(store, match(error_contains="%")) == [tasks[1].seq]


async def test_match_by_seqs(store: Store) -> None:
    tasks = [await submit_one(store) for _ in range(4)]
    wanted = [tasks[3].seq, tasks[1].seq, 999_999]
    assert await seqs_of(store, match(seqs=wanted)) == [tasks[1].seq, tasks[3].seq]
    many = list(range(1, 1001))  # more than SQLite's host parameters per statement
    assert await seqs_of(store, match(seqs=many)) == [t.seq for t in tasks]


async def test_cancel_tasks_pending_blocked_running_in_one_call(store: Store) -> None:
    running = await lease_one(store, (await submit_one(store)).seq)
    pending = await submit_one(store)
    dep = await submit_one(store)
    blocked = await submit_one(store, dep_seqs=[dep.seq])
    done = await submit_one(store, pool="other")
    await run_to_success(store, done.seq, T0 + 1, pool="other")
    changed, changes = await store.cancel_tasks([done.seq, running.seq, pending.seq, dep.seq, 12345], T0 + 5)
    assert changed == [running.seq, pending.seq, dep.seq]
    assert sorted(changes) == sorted(
        [
            (pending.seq, State.CANCELLED),
            (dep.seq, State.CANCELLED),
            (running.seq, State.RUNNING),
            (blocked.seq, State.CANCELLED),  # a dependent ended with its dependency
        ]
    )
    assert await states(store, pending.seq, running.seq, dep.seq, blocked.seq, done.seq) == [
        State.CANCELLED,
        State.RUNNING,
        State.CANCELLED,
        State.CANCELLED,
        State.SUCCEEDED,
    ]
    got = await store.get(running.seq)
    assert got is not None and got.cancel_requested
    # Safe to repeat: nothing left to change.
    assert await store.cancel_tasks([pending.seq, running.seq, dep.seq], T0 + 6) == ([], [])


async def test_cancel_tasks_records_an_event_per_change(store: Store) -> None:
    a, b = await submit_one(store), await submit_one(store)
    before = await store.sequence_events()
    await store.cancel_tasks([a.seq, b.seq], T0 + 1)
    await store.sequence_events()
    events = await store.read_events(before, 10)
    assert [(e.task_seq, e.state, e.prev_state) for e in events] == [
        (a.seq, State.CANCELLED, State.PENDING),
        (b.seq, State.CANCELLED, State.PENDING),
    ]


async def test_cancel_tasks_of_many_in_one_batch(store: Store) -> None:
    subs, _ = await store.submit([new() for _ in range(1200)], T0)
    seqs = [s.row.seq for s in subs]
    changed, changes = await store.cancel_tasks(seqs, T0 + 1)
    assert changed == seqs and len(changes) == 1200
    ended = await store.match_tasks(match(states=frozenset(TERMINAL)), 0, 2000)
    assert len(ended) == 1200


async def test_list_matching_pages_a_filter_either_way(store: Store) -> None:
    tasks = [await submit_one(store, key=f"{prefix}-{i}") for i, prefix in enumerate(["a", "b", "a", "a"])]
    await run_to_failure(store, tasks[0].seq, T0 + 1)
    keyed_a = match(key_prefix="a-")

    async def listed(f: TaskFilter, after: int = 0, limit: int = 100, newest_first: bool = False) -> list[int]:
        return [r.seq for r in await store.list_matching(f, after, limit, newest_first)]

    assert await listed(keyed_a) == [tasks[0].seq, tasks[2].seq, tasks[3].seq]
    assert await listed(keyed_a, limit=2, newest_first=True) == [tasks[3].seq, tasks[2].seq]
    assert await listed(keyed_a, after=tasks[2].seq, newest_first=True) == [tasks[0].seq]
    assert await listed(keyed_a, after=tasks[0].seq, limit=1) == [tasks[2].seq]
    assert await listed(match(key_prefix="a-", states=frozenset({State.FAILED}))) == [tasks[0].seq]
    assert await listed(match(states=frozenset({State.FAILED, State.PENDING}), seqs=[tasks[1].seq])) == [tasks[1].seq]
    # list_tasks is list_matching of pools and one state: the same rows.
    assert [r.seq for r in await store.list_tasks(None, State.PENDING, 0, 100, True)] == await listed(
        match(states=frozenset({State.PENDING})), newest_first=True
    )
