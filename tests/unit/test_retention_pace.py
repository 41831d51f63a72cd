"""Retention's purge takes about 1% of the store's time (a pause 99 times each batch's length
after it), and a twentieth once a purge has run PURGE_BEHIND_S, so that it catches up."""

from __future__ import annotations

from typing import Any

import pytest

from cronoq_server.core import leases
from cronoq_server.core.leases import PURGE_BEHIND_S, Leases


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


class SlowStore:
    """Each purge takes batch_s of the clock's time; full batches until `batches` are done."""

    def __init__(self, clock: Clock, batch_s: float, batches: int) -> None:
        self.clock, self.batch_s, self.left = clock, batch_s, batches

    async def purge(self, now: int, limit: int) -> int:
        self.clock.now += self.batch_s
        self.left -= 1
        return limit if self.left > 0 else 0


async def purged(monkeypatch: pytest.MonkeyPatch, batch_s: float, batches: int) -> Clock:
    """The clock after one run of the retention service on a SlowStore."""
    clock = Clock()
    monkeypatch.setattr(leases.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(leases.asyncio, "sleep", clock.sleep)
    service: Any = Leases.__new__(Leases)  # the purge uses the store alone
    service._store = SlowStore(clock, batch_s, batches)
    await service.purge_once()
    return clock


async def test_a_purge_takes_one_percent_of_the_stores_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = await purged(monkeypatch, 0.005, 101)
    assert clock.pauses == pytest.approx([0.495] * 100)
    assert 101 * 0.005 / (clock.now - 1000.0) == pytest.approx(0.01, rel=0.01)


async def test_a_short_batch_still_pauses_ten_ms(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = await purged(monkeypatch, 0.00001, 3)
    assert clock.pauses == [0.01, 0.01]


async def test_a_purge_behind_after_half_an_hour_takes_a_twentieth(monkeypatch: pytest.MonkeyPatch) -> None:
    batch_s = 0.01
    batches = int(PURGE_BEHIND_S / (100 * batch_s)) + 50  # 50 batches past the half hour
    clock = await purged(monkeypatch, batch_s, batches)
    assert clock.pauses[0] == pytest.approx(0.99) and clock.pauses[-1] == pytest.approx(0.19)
    assert sum(p == pytest.approx(0.19) for p in clock.pauses) >= 45
