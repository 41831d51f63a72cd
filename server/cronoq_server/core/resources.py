"""The leader's resource accounting: concurrency slots held while tasks run, and token
buckets for rates. Enforced at lease time; rebuilt from the store's RUNNING tasks when a
server takes over, so a failover never lets more run than the capacity.

A lease takes amounts through a Reservation while the store picks tasks (on the store's
thread for SQLite, hence the lock), then either keeps them for the tasks it leased or gives
them back when the lease failed. A slot is released when its attempt ends: finished, failed,
cancelled, released, or its lease expired.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..config import ResourceConfig
from ..metrics import RESOURCE_CAPACITY, RESOURCE_IN_USE


@dataclass(slots=True)
class _Bucket:
    rate: float  # tokens per second
    capacity: float  # burst
    tokens: float
    at: float  # monotonic seconds of the last refill

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now


@dataclass(frozen=True, slots=True)
class Usage:
    name: str
    in_use: int  # concurrency: slots held
    capacity: int
    rate: float  # rate: starts per second
    burst: int


class ResourceGate:
    def __init__(self, resources: Iterable[ResourceConfig], clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._capacity: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        for r in resources:
            if r.concurrency is not None:
                self._capacity[r.name] = r.concurrency
            elif r.rate is not None:
                burst = float(r.burst or 1)
                self._buckets[r.name] = _Bucket(r.rate, burst, burst, clock())
        self._in_use: dict[str, int] = dict.fromkeys(self._capacity, 0)
        # seq -> (attempt, concurrency amounts) of each running attempt holding slots
        self._holders: dict[int, tuple[int, dict[str, int]]] = {}
        for name, capacity in self._capacity.items():
            RESOURCE_CAPACITY.labels(resource=name).set(capacity)
        for name, bucket in self._buckets.items():
            RESOURCE_CAPACITY.labels(resource=name).set(bucket.capacity)

    @property
    def enabled(self) -> bool:
        return bool(self._capacity or self._buckets)

    # -- takeover -------------------------------------------------------------

    def rebuild(self, running: Iterable[tuple[int, int, dict[str, int]]]) -> None:
        """Slots held by the store's RUNNING tasks (seq, attempt, resources); buckets start full."""
        with self._lock:
            self._in_use = dict.fromkeys(self._capacity, 0)
            self._holders.clear()
            for seq, attempt, resources in running:
                self._hold(seq, attempt, resources)
            now = self._clock()
            for bucket in self._buckets.values():
                bucket.tokens, bucket.at = bucket.capacity, now
            self._export()

    # -- leases ---------------------------------------------------------------

    def exhausted(self) -> list[str]:
        """Resources with nothing left now: tasks asking for them need not be looked at."""
        with self._lock:
            now = self._clock()
            names = [n for n, cap in self._capacity.items() if self._in_use[n] >= cap]
            for name, bucket in self._buckets.items():
                bucket.refill(now)
                if bucket.tokens < 1:
                    names.append(name)
            return names

    def reservation(self) -> Reservation:
        return Reservation(self)

    def next_token_in(self) -> float | None:
        """Seconds until an exhausted rate resource has a token again (None: none is exhausted)."""
        with self._lock:
            now = self._clock()
            waits = []
            for bucket in self._buckets.values():
                bucket.refill(now)
                if bucket.tokens < 1:
                    waits.append((1 - bucket.tokens) / bucket.rate)
            return min(waits) if waits else None

    def _try_take(self, amounts: dict[str, int]) -> bool:
        with self._lock:
            now = self._clock()
            for name, amount in amounts.items():
                if name in self._capacity:
                    if self._in_use[name] + amount > self._capacity[name]:
                        return False
                elif name in self._buckets:
                    bucket = self._buckets[name]
                    bucket.refill(now)
                    if bucket.tokens < amount:
                        return False
                else:
                    return False  # no longer configured: never runs here (submit refuses it)
            for name, amount in amounts.items():
                if name in self._capacity:
                    self._in_use[name] += amount
                else:
                    self._buckets[name].tokens -= amount
            return True

    def _give_back(self, amounts: dict[str, int]) -> None:
        with self._lock:
            for name, amount in amounts.items():
                if name in self._capacity:
                    self._in_use[name] -= amount
                elif name in self._buckets:
                    bucket = self._buckets[name]
                    bucket.tokens = min(bucket.capacity, bucket.tokens + amount)

    def _keep(self, taken: list[tuple[int, int, dict[str, int]]]) -> None:
        """Records the leased attempts that hold what their reservation took."""
        with self._lock:
            for seq, attempt, amounts in taken:
                slots = {n: a for n, a in amounts.items() if n in self._capacity}
                previous = self._holders.pop(seq, None)
                if previous is not None:  # an earlier attempt of it ended unannounced: its slots are free
                    self._free(previous[1])
                if slots:
                    self._holders[seq] = (attempt, slots)
            self._export()

    # -- attempts ending ------------------------------------------------------

    def release(self, ended: Iterable[tuple[int, int]]) -> bool:
        """Frees the slots of these ended attempts (seq, attempt); True when any were freed."""
        freed = False
        with self._lock:
            for seq, attempt in ended:
                holder = self._holders.get(seq)
                if holder is not None and holder[0] == attempt:
                    del self._holders[seq]
                    self._free(holder[1])
                    freed = True
            if freed:
                self._export()
        return freed

    def _hold(self, seq: int, attempt: int, resources: dict[str, int]) -> None:
        slots = {n: a for n, a in resources.items() if n in self._capacity}
        if slots:
            self._holders[seq] = (attempt, slots)
            for name, amount in slots.items():
                self._in_use[name] += amount

    def _free(self, slots: dict[str, int]) -> None:
        for name, amount in slots.items():
            self._in_use[name] = max(self._in_use[name] - amount, 0)

    def _export(self) -> None:
        for name, n in self._in_use.items():
            RESOURCE_IN_USE.labels(resource=name).set(n)

    # -- reads ----------------------------------------------------------------

    def usage(self) -> list[Usage]:
        with self._lock:
            out = [Usage(n, self._in_use[n], cap, 0.0, 0) for n, cap in sorted(self._capacity.items())]
            out += [Usage(n, 0, 0, b.rate, int(b.capacity)) for n, b in sorted(self._buckets.items())]
            return out


class Reservation:
    """What one lease takes while its store transaction picks tasks."""

    def __init__(self, gate: ResourceGate):
        self._gate = gate
        self._taken: dict[int, dict[str, int]] = {}  # seq -> amounts

    def admit(self, seq: int, amounts: dict[str, int]) -> bool:
        """Takes the task's amounts if all are available now (called by the store)."""
        if self._gate._try_take(amounts):
            self._taken[seq] = amounts
            return True
        return False

    def keep(self, leased: Iterable[tuple[int, int]]) -> None:
        """The lease committed: (seq, attempt) of the tasks it leased hold what they took;
        anything taken for a task not leased is given back."""
        kept = []
        for seq, attempt in leased:
            amounts = self._taken.pop(seq, None)
            if amounts is not None:
                kept.append((seq, attempt, amounts))
        self.cancel()
        self._gate._keep(kept)

    def cancel(self) -> None:
        """The lease failed: everything it took is given back."""
        for amounts in self._taken.values():
            self._gate._give_back(amounts)
        self._taken.clear()
