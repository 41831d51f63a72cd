"""EventBus: which long polls a change wakes, and what a Watch stream may hold."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from cronoq_server.core import events as events_module
from cronoq_server.core.events import EventBus
from cronoq_server.errors import ApiError
from cronoq_server.store.base import State, StoreSettings, TaskRow
from cronoq_server.store.sqlite import SqliteStore


def row(seq: int, pool: str = "default", state: State = State.PENDING, payload: bytes = b"") -> TaskRow:
    return TaskRow(
        seq, pool, None, payload, "", 0, 0, 3, [], {}, state, 0, None, None, "", "", 0, None, None, False, None
    )


@pytest.fixture
async def bus(tmp_path: Path) -> EventBus:
    settings = StoreSettings("unsharded", 0, {"default": 1}, {"default": 1}, lambda *a: 0)
    return EventBus(SqliteStore(str(tmp_path / "unused.db"), settings), "unsharded", 0)


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


async def test_a_watcher_that_never_reads_is_bounded_in_bytes_and_ended_with_a_reason(
    bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_module, "WATCH_MAX_BYTES", 1 << 20)
    stalled = bus.watch(None, include_payloads=True)
    bare = bus.watch(None, include_payloads=False)
    for seq in range(1, 101):  # 100 tasks of 64 KiB: 6.4 MiB of payloads
        await bus.publish([(seq, State.PENDING)], [row(seq, payload=b"x" * 65536)])
    await asyncio.sleep(0.05)  # let the fan-out task run
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
