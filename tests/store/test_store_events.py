"""Task events (store/base.py, `# -- events`), run against every backend in conftest.BACKENDS.

Every change of a task records an event in the same transaction; sequence_events numbers them
(PostgreSQL) and read_events returns them densely numbered, each task's in the order it changed.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest
from conftest import OpenStore
from test_store import SEC, T0, failure, finish_ok, lease_one, new, row, submit_one, success

from cronoq_server.core.counts import UNFINISHED, TaskCounts
from cronoq_server.store.base import EventColumns, EventRow, NewTask, Outcome, OutcomeKind, State, Store, TaskRow
from cronoq_server.store.postgres import PostgresStore, insert_events


async def events(store: Store, after: int = 0) -> list[EventRow]:
    await store.sequence_events()
    return await store.read_events(after, 10_000)


def history(evs: list[EventRow]) -> list[tuple[int, State, int]]:
    return [(e.task_seq, e.state, e.attempt) for e in evs]


def assert_dense(evs: list[EventRow], first: int = 1) -> None:
    assert [e.seq for e in evs] == list(range(first, first + len(evs))), [e.seq for e in evs]


async def test_every_change_records_an_event_in_order(store: Store) -> None:
    a = await submit_one(store, key="a")
    b = await submit_one(store, key="b", dep_keys=["a"])  # BLOCKED on a
    c = await submit_one(store, key="c", dep_keys=["a"])
    leased = await lease_one(store, a.seq, T0 + 1)
    await finish_ok(store, failure(leased), T0 + 2)  # retried: PENDING again
    leased = await lease_one(store, a.seq, T0 + 3 * SEC)
    cancelled, _ = await store.cancel(c.seq, T0 + 3 * SEC)  # BLOCKED -> CANCELLED
    await finish_ok(store, success(leased), T0 + 4 * SEC)  # a SUCCEEDED, b unblocked
    leased_b = await lease_one(store, b.seq, T0 + 5 * SEC)
    row_b, _ = await store.cancel(b.seq, T0 + 5 * SEC)  # RUNNING: a cancel request
    assert row_b is not None and row_b.cancel_requested
    results, _ = await store.finish(
        "w1", [Outcome(b.seq, leased_b.attempt, OutcomeKind.CANCELLED, error="stop")], T0 + 6 * SEC
    )
    assert results[0].accepted
    evs = await events(store)
    assert_dense(evs)
    assert history(evs) == [
        (a.seq, State.PENDING, 0),
        (b.seq, State.BLOCKED, 0),
        (c.seq, State.BLOCKED, 0),
        (a.seq, State.RUNNING, 1),
        (a.seq, State.PENDING, 1),
        (a.seq, State.RUNNING, 2),
        (c.seq, State.CANCELLED, 0),
        (a.seq, State.SUCCEEDED, 2),
        (b.seq, State.PENDING, 0),
        (b.seq, State.RUNNING, 1),
        (b.seq, State.RUNNING, 1),  # the cancel request
        (b.seq, State.CANCELLED, 1),
    ]
    assert [e.at for e in evs][:4] == [T0, T0, T0, T0 + 1]
    assert cancelled is not None and cancelled.state == State.CANCELLED


async def test_expiry_release_failure_of_dependents_and_batches_record_events(store: Store) -> None:
    subs, _ = await store.submit([new(), new(key="p"), new(key="child", dep_keys=["p"])], T0)
    x, p, child = (s.row for s in subs)
    rows, _ = await store.lease("w1", ["default"], 2, T0)
    assert sorted(r.seq for r in rows) == [x.seq, p.seq]
    by_seq = {r.seq: r for r in rows}
    results, _ = await store.finish(
        "w1",
        [
            Outcome(x.seq, by_seq[x.seq].attempt, OutcomeKind.RELEASED),
            failure(by_seq[p.seq], retryable=False),
        ],
        T0 + 1,
    )
    assert all(r.accepted for r in results)
    await lease_one(store, x.seq, T0 + 2)
    await store.expire_leases(T0 + 2 + 11 * SEC)  # default pool's lease TTL is 10 s
    evs = await events(store)
    assert_dense(evs)
    got = history(evs)
    assert got[:3] == [(x.seq, State.PENDING, 0), (p.seq, State.PENDING, 0), (child.seq, State.BLOCKED, 0)]
    assert sorted(got[3:5]) == sorted([(x.seq, State.RUNNING, 1), (p.seq, State.RUNNING, 1)])
    assert got[5:] == [
        (x.seq, State.PENDING, 0),  # released: the attempt does not count
        (p.seq, State.FAILED, 1),
        (child.seq, State.FAILED, 0),
        (x.seq, State.RUNNING, 1),
        (x.seq, State.PENDING, 1),  # the lease expired
    ]


async def test_no_event_for_what_changes_nothing(store: Store) -> None:
    a = await submit_one(store, key="k")
    before = await events(store)
    await store.submit([new(key="k")], T0)  # deduplicated
    await store.submit([NewTask("default", None, b"", "", 0, None, 3)], T0, request_id="r")
    await store.submit([NewTask("default", None, b"", "", 0, None, 3)], T0, request_id="r")  # replayed
    leased = await lease_one(store, a.seq)
    await store.heartbeat("w1", [(a.seq, leased.attempt)], T0 + 1)
    await store.finish("intruder", [success(leased)], T0 + 2)  # refused
    await store.cancel(a.seq, T0 + 3)
    await store.cancel(a.seq, T0 + 4)  # already requested
    assert [(e.state, e.attempt) for e in (await events(store))[len(before) :]] == [
        (State.PENDING, 0),  # the request r's task, once
        (State.RUNNING, 1),
        (State.RUNNING, 1),  # one cancel request
    ]


async def test_read_events_pages_and_bounds_follow_the_sequence(store: Store) -> None:
    await store.submit([new() for _ in range(25)], T0)
    assert await store.sequence_events() == 25
    assert await store.event_bounds() == (0, 25)
    first = await store.read_events(0, 10)
    second = await store.read_events(10, 10)
    rest = await store.read_events(20, 100)
    assert_dense(first + second + rest)
    assert await store.read_events(25, 10) == []


async def test_purge_by_window_keeps_the_sequence_going(store: Store) -> None:
    for _ in range(5):  # apart: PostgreSQL purges the events one statement recorded together
        await submit_one(store, T0)
    await store.submit([new() for _ in range(3)], T0 + 10 * SEC)
    await store.sequence_events()
    assert await store.purge_events(T0 + 1, 2) == 2  # at most `limit`, oldest first
    assert await store.event_bounds() == (2, 8)
    assert await store.purge_events(T0 + 1, 100) == 3  # the rest before the window; none inside it
    assert await store.event_bounds() == (5, 8)
    assert [e.seq for e in await store.read_events(0, 100)] == [6, 7, 8]
    assert await store.purge_events(T0 + 1, 100) == 0
    assert await store.purge_events(T0 + 11 * SEC, 100) == 3  # every event
    assert await store.event_bounds() == (8, 8)
    await submit_one(store, T0 + 12 * SEC)  # the sequence goes on after the last, never restarts
    assert [e.seq for e in await events(store)] == [9]
    assert await store.event_bounds() == (8, 9)


async def test_a_deleted_task_s_events_are_left_where_they_were(store: Store) -> None:
    """The three tasks' submissions are one statement's events (one row on PostgreSQL): deleting
    one leaves every event as it was, to age out of the window (a Watch passes over them)."""
    first, middle, last = [s.row for s in (await store.submit([new() for _ in range(3)], T0))[0]]
    await store.cancel(middle.seq, T0 + 1)
    await store.sequence_events()
    before = [(e.seq, e.task_seq, e.state) for e in await store.read_events(0, 100)]
    assert await store.delete_tasks([middle.seq]) == [middle.seq]
    assert [(e.seq, e.task_seq, e.state) for e in await store.read_events(0, 100)] == before
    assert [s for _, s, _ in before] == [first.seq, middle.seq, last.seq, middle.seq]


async def test_a_read_passes_over_events_recorded_for_deleted_tasks(open_store: OpenStore) -> None:
    """Events whose task a server before 0.2 deleted had task_seq 0 in PostgreSQL's event log: more
    rows of them than one read takes (read_events reads rows a few at a time), and the read goes
    on past them to the next event."""
    store = await open_store()
    gone = [await submit_one(store, T0) for _ in range(150)]
    kept = await submit_one(store, T0 + 2)
    await store.sequence_events()
    if isinstance(store, PostgresStore):  # as such a server left them
        await store.pool.execute(
            store._sql(
                "UPDATE {s}.event_batches SET task_seq = ARRAY[0]::bigint[] WHERE n = 1 AND task_seq <> ARRAY[$1::bigint]"
            ),
            kept.seq,
        )
        assert [(e.seq, e.task_seq) for e in await store.read_events(0, 10)] == [(151, kept.seq)]
    assert await store.delete_tasks([t.seq for t in gone]) == []  # PENDING: not deleted
    assert (await store.read_events(150, 10))[0].task_seq == kept.seq


async def test_events_survive_reopening(open_store) -> None:
    store = await open_store()
    await store.submit([new() for _ in range(3)], T0)
    await store.sequence_events()
    await store.close()
    again = await open_store()
    await submit_one(again)
    assert [e.seq for e in await events(again)] == [1, 2, 3, 4]


# What of a task changes over its life: an event records it as its change left it.
LIFE = (
    "state", "attempt", "run_at", "worker_id", "error", "started_at", "finished_at", "lease_expires_at",
    "cancel_requested",
)  # fmt: skip


def life(r: EventRow | TaskRow) -> tuple[Any, ...]:
    return tuple(getattr(r, name) for name in LIFE)


async def test_each_event_records_the_task_as_its_change_left_it(store: Store) -> None:
    """Every path that records events, checked against the task's row read right after each
    change: not the row as it is when the events are read."""
    after: list[tuple[Any, ...]] = []

    async def changed(*seqs: int) -> None:
        after.extend([life(await row(store, s)) for s in seqs])

    a = await submit_one(store)  # a plain submission (PostgreSQL: the merged insert)
    await changed(a.seq)
    k = await submit_one(store, key="k", pool="other")  # keyed: the other insert
    await changed(k.seq)
    leased = await lease_one(store, a.seq, T0 + 1, worker="w1")
    await changed(a.seq)
    await finish_ok(store, failure(leased), T0 + 2)  # retried: PENDING, a later run_at, its error
    await changed(a.seq)
    leased = await lease_one(store, a.seq, T0 + SEC, worker="w2")
    await changed(a.seq)
    await store.cancel(a.seq, T0 + 2 * SEC)  # a cancel request while RUNNING
    await changed(a.seq)
    results, _ = await store.finish(
        "w2", [Outcome(a.seq, leased.attempt, OutcomeKind.CANCELLED, error="stop")], T0 + 3 * SEC
    )
    assert results[0].accepted
    await changed(a.seq)
    leased_k = await lease_one(store, k.seq, T0 + 4 * SEC, worker="w3", pool="other")
    await changed(k.seq)
    r = await submit_one(store, now=T0 + 4 * SEC, pool="other")
    await changed(r.seq)
    # A success while nothing is BLOCKED and a lease in one call (PostgreSQL: one statement).
    results, _, rows, _ = await store.finish_and_lease("w3", [success(leased_k)], ["other"], 1, T0 + 5 * SEC)
    assert results[0].accepted and [x.seq for x in rows] == [r.seq]
    await changed(k.seq, r.seq)
    results, _ = await store.finish("w3", [Outcome(r.seq, 1, OutcomeKind.RELEASED)], T0 + 6 * SEC)
    assert results[0].accepted
    await changed(r.seq)

    evs = await events(store)
    assert [life(e) for e in evs] == after
    submitted, started = evs[0], evs[2]
    assert (submitted.worker_id, submitted.started_at, submitted.finished_at) == (None, None, None)
    assert (started.worker_id, started.started_at, started.finished_at) == ("w1", T0 + 1, None)
    assert life(evs[0]) != life(await row(store, a.seq))


# -- PostgreSQL: numbering committed events ------------------------------------------------


@pytest.fixture
async def pg(postgres) -> PostgresStore:
    from conftest import make_settings

    store = PostgresStore(postgres.url, f"ev_{uuid.uuid4().hex[:10]}", make_settings())
    await store.open()
    yield store
    await store.close()


# An event's EVENT_TASK_COLUMNS when the test does not care: NULL, of each column's type.
NO_TASK_COLUMNS = "NULL::bigint, NULL::text, NULL::text, NULL::bigint, NULL::bigint, NULL::bigint, NULL::boolean"


async def test_postgres_an_open_transaction_never_leaves_a_hole_below_a_reader(pg: PostgresStore) -> None:
    """A slow transaction's event is numbered after it commits, past what readers have read:
    nothing is ever numbered below a position already read, and nothing waits for it."""
    t = await submit_one(pg, T0)
    conn = await asyncpg.connect(pg.url)
    try:
        slow = conn.transaction()
        await slow.start()
        await conn.execute(pg._sql("UPDATE {s}.tasks SET cancel_requested = true WHERE seq = $1"), t.seq)
        await conn.execute(
            pg._sql(insert_events(f"SELECT $1::bigint, 1, 0, $2::bigint, 'default', 1, {NO_TASK_COLUMNS}")),
            t.seq,
            T0 + 1,
        )
        others = [(await submit_one(pg, T0 + 2)).seq for _ in range(3)]  # commit after the slow one began
        read = await events(pg)
        assert [(e.seq, e.task_seq) for e in read] == [(1, t.seq), *[(i + 2, s) for i, s in enumerate(others)]]
        await slow.commit()
    finally:
        await conn.close()
    later = await events(pg, after=read[-1].seq)
    assert [(e.seq, e.task_seq, e.at) for e in later] == [(5, t.seq, T0 + 1)]
    assert_dense(await pg.read_events(0, 100))


async def test_postgres_a_task_s_events_are_numbered_in_the_order_its_row_changed(pg: PostgresStore) -> None:
    """Transaction ids are not that order: one that took its id first (as a fenced transaction
    does, locking the leader row) may change the task after another one committed a change."""
    t = await submit_one(pg, T0)
    early = await asyncpg.connect(pg.url)
    try:
        tx = early.transaction()
        await tx.start()
        await early.fetchval("SELECT pg_current_xact_id()")  # takes its xid now, before the lease's
        leased = await lease_one(pg, t.seq, T0 + 1)  # commits with a later xid
        await early.execute(
            pg._sql(
                "WITH ended AS (UPDATE {s}.tasks SET state = 4, finished_at = $2 WHERE seq = $1 AND state = 3"
                " RETURNING seq, pool, state, attempt) "
                + insert_events(f"SELECT seq, state, attempt, $2::bigint, pool, 3, {NO_TASK_COLUMNS} FROM ended")
            ),
            t.seq,
            T0 + 2,
        )
        await tx.commit()
    finally:
        await early.close()
    assert history(await events(pg)) == [
        (t.seq, State.PENDING, 0),
        (t.seq, State.RUNNING, leased.attempt),
        (t.seq, State.SUCCEEDED, leased.attempt),
    ]


async def test_postgres_concurrent_writers_and_sequencers_number_each_event_once(pg: PostgresStore) -> None:
    async def writer(n: int) -> None:
        for _ in range(n):
            await pg.submit([new() for _ in range(3)], T0)

    async def sequencer(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await pg.sequence_events()
            await asyncio.sleep(0)

    stop = asyncio.Event()
    sequencers = [asyncio.create_task(sequencer(stop)) for _ in range(3)]
    await asyncio.gather(*(writer(20) for _ in range(4)))
    stop.set()
    await asyncio.gather(*sequencers)
    evs = await events(pg)
    assert_dense(evs)
    assert len(evs) == 4 * 20 * 3 and len({e.task_seq for e in evs}) == 240


# -- what each event tells the leader's counts: the task's pool and the state it left ---------


def transitions(evs: list[EventRow]) -> list[tuple[int, str, int, State]]:
    """(task, pool, previous state (0: a new task), new state) of each event."""
    return [(e.task_seq, e.pool, e.prev_state, e.state) for e in evs]


def fold_all(evs: list[EventRow]) -> dict[tuple[str, State], int]:
    counts = TaskCounts()
    counts.start(0, {})
    counts.fold(evs)
    return counts.nonzero()


async def unfinished(store: Store) -> dict[tuple[str, State], int]:
    return {k: n for k, n in (await store.count_by_pool_and_state()).items() if k[1] in UNFINISHED}


P, B, R = State.PENDING, State.BLOCKED, State.RUNNING


async def test_events_carry_the_pool_and_the_state_each_change_left(store: Store) -> None:
    subs, _ = await store.submit([new("other"), new("other")], T0)  # no key: PostgreSQL's one-statement submit
    x, y = (s.row for s in subs)
    a = await submit_one(store, key="a", pool="other")
    b = await submit_one(store, key="b", pool="other", dep_keys=["a"])  # BLOCKED on a
    c = await submit_one(store, key="c", pool="other", dep_keys=["b"])  # BLOCKED on b
    d = await submit_one(store, key="d", pool="other", dep_keys=["a"])
    start = len(await events(store))
    assert transitions(await events(store)) == [
        (x.seq, "other", 0, P), (y.seq, "other", 0, P), (a.seq, "other", 0, P), (b.seq, "other", 0, B),
        (c.seq, "other", 0, B), (d.seq, "other", 0, B),
    ]  # fmt: skip
    rows, _ = await store.lease("w1", ["other"], 3, T0)  # x, y, a
    by_seq = {r.seq: r for r in rows}
    assert set(by_seq) == {x.seq, y.seq, a.seq}
    results, _ = await store.finish(
        "w1",
        [
            Outcome(x.seq, by_seq[x.seq].attempt, OutcomeKind.RELEASED),
            failure(by_seq[y.seq]),  # retried
            success(by_seq[a.seq]),  # b and d unblocked
        ],
        T0 + 1,
    )
    assert all(r.accepted for r in results)
    cancelled_d, _ = await store.cancel(d.seq, T0 + 2)  # PENDING -> CANCELLED
    assert cancelled_d is not None and cancelled_d.state == State.CANCELLED
    rows, _ = await store.lease("w1", ["other"], 2, T0 + 3)  # x (released) and b
    leased_b = next(r for r in rows if r.seq == b.seq)
    await store.cancel(b.seq, T0 + 4)  # RUNNING: a request, the state stays
    await finish_ok(store, Outcome(b.seq, leased_b.attempt, OutcomeKind.CANCELLED), T0 + 5)  # c cancelled
    evs = (await events(store))[start:]
    assert sorted(transitions(evs[:3])) == sorted([(s, "other", P, R) for s in (x.seq, y.seq, a.seq)])
    assert transitions(evs[3:9]) == [
        (x.seq, "other", R, P),  # released
        (y.seq, "other", R, P),  # retried
        (a.seq, "other", R, State.SUCCEEDED),
        (b.seq, "other", B, P),  # unblocked
        (d.seq, "other", B, P),
        (d.seq, "other", P, State.CANCELLED),
    ]
    assert sorted(transitions(evs[9:11])) == sorted([(x.seq, "other", P, R), (b.seq, "other", P, R)])
    assert transitions(evs[11:]) == [
        (b.seq, "other", R, R),  # the cancel request
        (b.seq, "other", R, State.CANCELLED),
        (c.seq, "other", B, State.CANCELLED),  # its dependency was cancelled
    ]
    await check_counts_follow_the_events(store)


async def test_events_of_failures_expiry_and_dependencies_ended_at_submit(store: Store) -> None:
    p = await submit_one(store, key="p")
    q = await submit_one(store, key="q", max_attempts=1)
    child = await submit_one(store, key="child", dep_keys=["p"])
    grandchild = await submit_one(store, key="grandchild", dep_keys=["child"])
    blocked = await submit_one(store, key="blocked", dep_keys=["q"])
    await finish_ok(store, failure(await lease_one(store, p.seq, T0), retryable=False), T0 + 1)
    late = await submit_one(store, T0 + 2, key="late", dep_keys=["p"])  # its dependency failed: FAILED at once
    cancelled_dep = await submit_one(store, T0 + 2, key="cd", pool="other")
    await store.cancel(cancelled_dep.seq, T0 + 2)
    orphan = await submit_one(store, T0 + 2, key="orphan", pool="other", dep_keys=["cd"])  # CANCELLED at once
    blocked_cancel = await submit_one(store, T0 + 2, key="bc", dep_keys=["q"])
    await store.cancel(blocked_cancel.seq, T0 + 3)  # BLOCKED -> CANCELLED
    await lease_one(store, q.seq, T0 + 3)
    await store.expire_leases(T0 + 3 + 11 * SEC)  # its last attempt: FAILED, and blocked with it
    evs = await events(store)
    got = transitions(evs)
    d = "default"
    assert got[5:] == [
        (p.seq, d, P, R),
        (p.seq, d, R, State.FAILED),
        (child.seq, d, B, State.FAILED),
        (grandchild.seq, d, B, State.FAILED),
        (late.seq, d, 0, State.FAILED),
        (cancelled_dep.seq, "other", 0, P),
        (cancelled_dep.seq, "other", P, State.CANCELLED),
        (orphan.seq, "other", 0, State.CANCELLED),
        (blocked_cancel.seq, d, 0, B),
        (blocked_cancel.seq, d, B, State.CANCELLED),
        (q.seq, d, P, R),
        (q.seq, d, R, State.FAILED),  # the lease expired
        (blocked.seq, d, B, State.FAILED),
    ]
    await check_counts_follow_the_events(store)


async def test_an_expired_lease_with_attempts_left_is_pending_again(store: Store) -> None:
    t = await submit_one(store)
    await lease_one(store, t.seq, T0)
    await store.expire_leases(T0 + 11 * SEC)
    assert transitions((await events(store))[1:]) == [(t.seq, "default", P, R), (t.seq, "default", R, P)]


async def test_successes_while_nothing_is_blocked_record_the_pool_and_running(store: Store) -> None:
    """PostgreSQL's one-statement finish, taken once a sweep saw no BLOCKED task."""
    t = await submit_one(store, pool="other")
    await store.expire_leases(T0)  # the sweep
    await finish_ok(store, success(await lease_one(store, t.seq, T0, pool="other")), T0 + 1)
    assert transitions(await events(store)) == [
        (t.seq, "other", 0, P),
        (t.seq, "other", P, R),
        (t.seq, "other", R, State.SUCCEEDED),
    ]


async def test_schedule_fires_record_new_tasks(store: Store) -> None:
    from test_store_schedules import sched, slot_task

    s = await store.put_schedule(sched(pool="other"), T0)
    fired = await store.fire_schedule(s, [slot_task(s, T0 + SEC)], T0 + SEC, T0 + 2 * SEC, T0 + SEC)
    assert fired is not None
    (sub,), _ = fired
    assert transitions(await events(store)) == [(sub.row.seq, "other", 0, P)]


async def check_counts_follow_the_events(store: Store) -> None:
    """Counts from nothing plus every event, and counts at a position plus the events after it,
    both equal the tasks' states."""
    assert fold_all(await events(store)) == await unfinished(store)


async def test_counts_at_a_position_plus_the_later_events_are_the_tasks_counts(store: Store) -> None:
    a = await submit_one(store, key="a")
    await submit_one(store, key="b", dep_keys=["a"], pool="other")
    await submit_one(store, pool="other")
    position, counts = await store.count_unfinished()
    assert position == len(await events(store))
    assert counts == {("default", P): 1, ("other", B): 1, ("other", P): 1}
    leased = await lease_one(store, a.seq, T0 + 1)
    await submit_one(store, T0 + 1, key="c", dep_keys=["b"])
    await finish_ok(store, success(leased), T0 + 2)
    tracked = TaskCounts()
    tracked.start(position, counts)
    tracked.fold(await events(store))  # events up to the position are skipped
    assert tracked.nonzero() == await unfinished(store)
    assert tracked.position == len(await events(store))


def counted(read: list[EventColumns], after: int) -> list[tuple[Any, ...]]:
    """The events read as columns after a position, as (pos, COUNTED_COLUMNS) each."""
    fresh = [f for c in read if (f := c.after(after)) is not None]
    return [
        e
        for f in fresh
        for e in zip(f.pos, f.task_seq, f.state, f.prev_state, f.pool, f.at, f.started_at, f.error, strict=True)
    ]


async def test_events_read_as_columns_are_the_events_and_fold_alike(store: Store) -> None:
    """What the leader counts from (read_event_columns): the same events as read_events, a
    deleted task's passed over, from any position, and the same counts."""
    a = await submit_one(store, key="a")
    await submit_one(store, key="b", dep_keys=["a"], pool="other")
    first, middle, _ = [s.row for s in (await store.submit([new() for _ in range(3)], T0))[0]]
    await finish_ok(store, failure(await lease_one(store, a.seq, T0 + 1)), T0 + 2)
    await store.cancel(middle.seq, T0 + 3)
    leased = await lease_one(store, first.seq, T0 + 4)
    await finish_ok(store, success(leased), T0 + 5)
    assert await store.delete_tasks([middle.seq]) == [middle.seq]
    evs = await events(store)
    last = await store.sequence_events()
    for after in range(last + 1):
        expected = [
            (e.seq, e.task_seq, e.state, e.prev_state, e.pool, e.at, e.started_at, e.error)
            for e in evs
            if e.seq > after
        ]
        assert counted(await store.read_event_columns(after, 10_000), after) == expected, after
        pos, paged = after, []
        while (read := await store.read_event_columns(pos, 2)) and counted(read, pos):
            paged += counted(read, pos)
            pos = paged[-1][0]
        assert paged == expected, after
    by_columns = TaskCounts()
    by_columns.start(0, {})
    assert by_columns.fold_columns(await store.read_event_columns(0, 10_000))
    assert by_columns.nonzero() == fold_all(evs) == await unfinished(store)


async def test_postgres_released_dependents_record_blocked_to_pending(pg: PostgresStore) -> None:
    """The release that follows a one-statement finish racing a blocking submission."""
    a = await submit_one(pg, T0, key="a")
    b = await submit_one(pg, T0, key="b", dep_keys=["a"], pool="other")
    await finish_ok(pg, success(await lease_one(pg, a.seq, T0)), T0 + 1)  # b PENDING already
    async with pg.pool.acquire() as conn:  # as if b were still BLOCKED when a ended
        await conn.execute(pg._sql("UPDATE {s}.tasks SET state = 2 WHERE seq = $1"), b.seq)
    start = len(await events(pg))
    assert await pg._tx(lambda c: pg._release_unblocked(c, [a.seq], T0 + 2)) == [(b.seq, State.PENDING)]
    assert transitions((await events(pg))[start:]) == [(b.seq, "other", B, P)]


async def test_postgres_counts_at_a_position_under_concurrent_changes(pg: PostgresStore) -> None:
    """Whatever commits while the counts are read is either in them (an event up to the
    position) or not (an event after it), never both or neither."""
    stop = asyncio.Event()

    async def churn(pool: str) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            await pg.submit([new(pool, key=f"{pool}-{n}")], T0)
            if n % 2:
                rows, _ = await pg.lease(f"w-{pool}", [pool], 1, T0)
                if rows:
                    await pg.finish(f"w-{pool}", [success(rows[0])], T0)

    workers = [asyncio.create_task(churn(p)) for p in ("default", "other")]
    try:
        starts = []
        for _ in range(5):
            await asyncio.sleep(0.05)
            starts.append(await pg.count_unfinished())
    finally:
        stop.set()
        await asyncio.gather(*workers)
    evs = await events(pg)
    for position, counts in starts:
        tracked, by_columns = TaskCounts(), TaskCounts()
        tracked.start(position, counts)
        tracked.fold(evs)
        assert tracked.nonzero() == await unfinished(pg), position
        by_columns.start(position, counts)  # rows read whole: the first may begin before the position
        assert by_columns.fold_columns(await pg.read_event_columns(position, 100_000))
        assert by_columns.nonzero() == await unfinished(pg), position
