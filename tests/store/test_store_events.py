"""Task events (store/base.py, `# -- events`), run against every backend in conftest.BACKENDS.

Every change of a task records an event in the same transaction; sequence_events numbers them
(PostgreSQL) and read_events returns them densely numbered, each task's in the order it changed.
"""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
from test_store import SEC, T0, failure, finish_ok, lease_one, new, submit_one, success

from cronoq_server.store.base import EventRow, NewTask, Outcome, OutcomeKind, State, Store
from cronoq_server.store.postgres import PostgresStore


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
    await store.submit([new() for _ in range(5)], T0)
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


async def test_events_survive_reopening(open_store) -> None:
    store = await open_store()
    await store.submit([new() for _ in range(3)], T0)
    await store.sequence_events()
    await store.close()
    again = await open_store()
    await submit_one(again)
    assert [e.seq for e in await events(again)] == [1, 2, 3, 4]


# -- PostgreSQL: numbering committed events ------------------------------------------------


@pytest.fixture
async def pg(postgres) -> PostgresStore:
    from conftest import make_settings

    store = PostgresStore(postgres.url, f"ev_{uuid.uuid4().hex[:10]}", make_settings())
    await store.open()
    yield store
    await store.close()


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
            pg._sql("INSERT INTO {s}.events (task_seq, state, attempt, at) VALUES ($1, 1, 0, $2)"), t.seq, T0 + 1
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
                " RETURNING seq, state, attempt)"
                " INSERT INTO {s}.events (task_seq, state, attempt, at) SELECT seq, state, attempt, $2 FROM ended"
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
