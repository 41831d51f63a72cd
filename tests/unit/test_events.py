"""EventBus: which long polls a change wakes, and what a Watch stream may hold."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from cronoq.v1 import task_pb2
from cronoq_server.core import events as events_module
from cronoq_server.core.events import EventBus, as_changed, parse_cursor
from cronoq_server.core.tasks import now_us
from cronoq_server.errors import ApiError
from cronoq_server.store.base import EventRow, NewTask, Outcome, OutcomeKind, State, StoreSettings, TaskRow
from cronoq_server.store.sqlite import SqliteStore


def row(seq: int, pool: str = "default", state: State = State.PENDING, payload: bytes = b"") -> TaskRow:
    return TaskRow(
        seq, pool, None, payload, "", 0, 0, 3, [], {}, state, 0, None, None, "", "", 0, None, None, False, None
    )


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    settings = StoreSettings("unsharded", 0, {"default": 10**7, "other": 10**7}, {"default": 10**9}, lambda *a: 0)
    opened = SqliteStore(str(tmp_path / "events.db"), settings, "normal")
    await opened.open()
    yield opened
    await opened.close()


@pytest.fixture
async def bus(store: SqliteStore) -> EventBus:
    return EventBus(store, "unsharded", 0, watch_window_s=60)


async def test_a_submission_wakes_only_as_many_long_polls_of_its_pool_as_it_made_tasks(bus: EventBus) -> None:
    idle = [bus.lease_waiter(["default"]) for _ in range(1000)]
    others = [bus.lease_waiter(["other"]) for _ in range(10)]
    await bus.publish([(1, State.PENDING)], [row(1)])
    assert sum(w.event.is_set() for w in idle) == 1 and idle[0].event.is_set()  # the longest waiting
    await bus.publish([(2, State.PENDING), (3, State.PENDING)], [row(2), row(3)])
    assert sum(w.event.is_set() for w in idle) == 3
    assert not any(w.event.is_set() for w in others)


async def test_changes_of_unknown_pools_wake_as_many_long_polls_as_tasks(bus: EventBus) -> None:
    idle = [bus.lease_waiter(["default"]) for _ in range(50)]
    await bus.publish([(1, State.PENDING), (2, State.SUCCEEDED)])  # a retry, say: no rows given
    assert sum(w.event.is_set() for w in idle) == 1


async def test_drain_answers_every_long_poll_and_wait(bus: EventBus) -> None:
    idle = [bus.lease_waiter(["default"]) for _ in range(5)]
    wait = bus.wait_terminal(7)
    bus.drain()
    assert all(w.event.is_set() for w in idle) and wait.done()
    assert bus.wait_terminal(8).done()  # a wait that starts while draining is answered at once


async def submit(
    store: SqliteStore, bus: EventBus, n: int = 1, pool: str = "default", payload: bytes = b""
) -> list[int]:
    subs, changes = await store.submit([NewTask(pool, None, payload, "", 0, None, 3) for _ in range(n)], now_us())
    await bus.publish(changes, [s.row for s in subs])
    return [s.row.seq for s in subs]


async def run_once(store: SqliteStore, bus: EventBus, ok: bool = True) -> None:
    rows, _ = await store.lease("w", ["default", "other"], 1, now_us())
    await bus.publish([(r.seq, r.state) for r in rows], rows)
    kind = OutcomeKind.SUCCESS if ok else OutcomeKind.FAILURE
    _, changes = await store.finish("w", [Outcome(rows[0].seq, rows[0].attempt, kind, error="x")], now_us())
    await bus.publish(changes)


async def take(stream: AsyncIterator[task_pb2.TaskEvent], n: int) -> list[task_pb2.TaskEvent]:
    return [await asyncio.wait_for(anext(stream), 2) for _ in range(n)]


def seen(events: list[task_pb2.TaskEvent]) -> list[tuple[int, int, int]]:
    return [(e.task.id, e.task.state, e.task.attempt) for e in events]


async def test_a_watcher_that_never_reads_is_bounded_in_bytes_and_ended_with_a_reason(
    store: SqliteStore, bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_module, "WATCH_MAX_BYTES", 1 << 20)
    stalled = await bus.open_watch(None, include_payloads=True)
    bare = await bus.open_watch(None, include_payloads=False)
    for _ in range(100):  # 100 tasks of 64 KiB: 6.4 MiB of payloads
        await submit(store, bus, payload=b"x" * 65536)
    for _ in range(50):  # let the fan-out task read and send them
        await asyncio.sleep(0.01)
        if len(bare._events) == 100:
            break
    assert stalled._bytes <= 1 << 20 and stalled.ended is not None
    got = 0
    with pytest.raises(ApiError) as err:
        while await stalled.next() is not None:
            got += 1
    assert err.value.code == grpc.StatusCode.ABORTED and "fell behind" in err.value.message
    assert 0 < got < 100
    # Without include_payloads, events carry no payload: all 100 fit.
    assert bare.ended is None and len(bare._events) == 100 and bare._bytes < 100 * 1024
    first = await bare.next()
    assert first is not None and first.task.payload == b""


async def test_events_carry_each_change_in_order_with_seq_cursor_and_time(store: SqliteStore, bus: EventBus) -> None:
    stream = bus.stream(await bus.open_watch(None, include_payloads=True))
    before = now_us()
    (seq,) = await submit(store, bus, payload=b"p")
    await run_once(store, bus, ok=False)  # retried
    await store.cancel(seq, now_us())  # not leased: cancelled
    await bus.publish([(seq, State.CANCELLED)])
    got = await take(stream, 4)
    assert seen(got) == [(seq, State.PENDING, 0), (seq, State.RUNNING, 1), (seq, State.PENDING, 1),
                         (seq, State.CANCELLED, 1)]  # fmt: skip
    assert [e.seq for e in got] == [1, 2, 3, 4] and [e.cursor for e in got] == ["0:1", "0:2", "0:3", "0:4"]
    assert all(e.shard == "unsharded" and e.task.payload == b"p" for e in got)
    assert before <= got[0].time.ToMicroseconds() <= got[-1].time.ToMicroseconds() <= now_us()
    await stream.aclose()


async def test_a_cursor_replays_exactly_what_was_missed_then_goes_live(store: SqliteStore, bus: EventBus) -> None:
    first = bus.stream(await bus.open_watch(None, False))
    await submit(store, bus, 2)
    got = await take(first, 2)
    await first.aclose()
    cursor = got[-1].cursor
    missed = await submit(store, bus, 3)  # while nobody watches
    await run_once(store, bus)
    after = parse_cursor(cursor, 0)
    resumed = bus.stream(await bus.open_watch(None, False, after, cursor))
    replayed = await take(resumed, 5)
    assert [e.seq for e in replayed] == [3, 4, 5, 6, 7]
    assert [e.task.id for e in replayed[:3]] == missed
    live = await submit(store, bus, 1)
    (event,) = await take(resumed, 1)
    assert (event.seq, event.task.id) == (8, live[0])
    await resumed.aclose()


async def test_the_handover_from_replay_to_live_repeats_and_skips_nothing(store: SqliteStore, bus: EventBus) -> None:
    await submit(store, bus, 1)
    live_watcher = bus.stream(await bus.open_watch(None, False))  # keeps the fan-out going
    await submit(store, bus, 50)
    resumed = bus.stream(await bus.open_watch(None, False, 0, "0:0"))
    got = [await asyncio.wait_for(anext(resumed), 2)]
    for _ in range(30):  # changes keep coming while it replays
        await submit(store, bus, 3)
        got += await take(resumed, 2)
    got += await take(resumed, 51 + 90 - len(got))
    assert [e.seq for e in got] == list(range(1, 142))
    await resumed.aclose()
    await live_watcher.aclose()


async def test_a_cursor_filtered_by_pool_still_resumes_where_it_was(store: SqliteStore, bus: EventBus) -> None:
    await submit(store, bus, 2, pool="other")
    mine = await submit(store, bus, 1, pool="default")
    stream = bus.stream(await bus.open_watch(frozenset({"default"}), False, 0, "0:0"))
    (event,) = await take(stream, 1)
    assert (event.seq, event.task.id) == (3, mine[0])
    await submit(store, bus, 1, pool="other")
    later = await submit(store, bus, 1, pool="default")
    (event,) = await take(stream, 1)
    assert (event.seq, event.task.id) == (5, later[0])
    await stream.aclose()


async def test_a_purged_cursor_is_out_of_range_and_names_the_window(store: SqliteStore, bus: EventBus) -> None:
    await submit(store, bus, 3)
    await store.purge_events(now_us() + 1, 2)  # the two oldest
    with pytest.raises(ApiError) as err:
        await bus.open_watch(None, False, 1, "0:1")
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert "'0:1'" in err.value.message and "watch_window is 60s" in err.value.message
    stream = bus.stream(await bus.open_watch(None, False, 2, "0:2"))  # from the purge point on: all kept
    assert [e.seq for e in await take(stream, 1)] == [3]
    await stream.aclose()


async def test_a_cursor_past_the_last_event_is_out_of_range(store: SqliteStore, bus: EventBus) -> None:
    await submit(store, bus, 2)
    with pytest.raises(ApiError) as err:
        await bus.open_watch(None, False, 3, "0:3")
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE and "reset" in err.value.message


@pytest.mark.parametrize("cursor", ["", "7", "0:", ":5", "0:x", "0:-1", "a:1", "0:1:2", "0:" + "9" * 30, "٣:1"])
def test_a_malformed_cursor_is_invalid_naming_the_field(cursor: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_cursor(cursor, 0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.message.startswith("cursor: ")


def test_a_cursor_of_another_shard_is_invalid() -> None:
    assert parse_cursor("3:42", 3) == 42
    with pytest.raises(ApiError) as err:
        parse_cursor("2:42", 3)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "shard number 2" in err.value.message


def test_an_event_shows_its_task_as_its_change_left_it_and_an_older_one_its_row_now() -> None:
    now = dataclasses.replace(
        row(7, state=State.SUCCEEDED), attempt=2, worker_id="w2", result=b"out", result_content_type="text/plain",
        started_at=30, finished_at=40, run_at=20,
    )  # fmt: skip
    leased = EventRow(5, 7, State.RUNNING, 1, 10, "default", 1, 0, "w1", "", 10, None, 99, False)
    shown = as_changed(leased, now)
    assert (shown.state, shown.attempt, shown.worker_id, shown.started_at, shown.finished_at) == (
        State.RUNNING, 1, "w1", 10, None,
    )  # fmt: skip
    assert (shown.run_at, shown.lease_expires_at, shown.result, shown.result_content_type) == (0, 99, None, "")
    ended = EventRow(9, 7, State.SUCCEEDED, 2, 40, "default", 3, 20, "w2", "", 30, 40, None, False)
    assert as_changed(ended, now) == now  # the result of the change that ended it
    # Recorded before the store kept the task's fields with its events: the row now, at its state.
    older = EventRow(5, 7, State.RUNNING, 1, 10, "default", 1)
    assert as_changed(older, now) == dataclasses.replace(now, state=State.RUNNING, attempt=1)
