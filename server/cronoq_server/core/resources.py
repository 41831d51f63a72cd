"""The leader's resource accounting: concurrency slots held while tasks run, token buckets
for rates, and the places of a pool's groups (max_running_per_group). Enforced at lease time;
rebuilt from the store's RUNNING tasks when a server takes over, so a failover never lets more
run than the capacity or a group's cap.

A lease asks the gate what is available, has the store lease only tasks that fit in it (one
statement), and then takes what the leased tasks name. Leases that name resources run one
at a time (Leases holds a lock), so what was available is still there when they take it. A
slot (or a group's place) is released when its attempt ends: finished, failed, cancelled,
released, or its lease expired.

A keyed resource (per_key) gives each key its own slots or bucket, kept under "name:key" only
while the key uses them (slots held, or a bucket not full again): memory follows the keys in
use. available() gives such a key what it has left, and every other key the full size under
"name:" (an empty key, which a task cannot name).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..config import ResourceConfig
from ..metrics import GROUPS_AT_CAP, GROUPS_RUNNING, RESOURCE_CAPACITY, RESOURCE_IN_USE, RESOURCE_KEYS_AT_LIMIT
from ..store.base import Held


@dataclass(slots=True)
class _Bucket:
    rate: float  # tokens per second
    capacity: float  # burst
    tokens: float
    at: float  # monotonic seconds of the last refill

    @property
    def ceiling(self) -> float:
        """What the bucket may hold while a start is late: a little over the burst, so a start
        that comes late by up to half a token's interval (a busy event loop, a slow lease, the
        lease before it taking its batch's fill) does not lower the rate; never enough for one
        more start in any second than rate + burst allow (floor(burst + rate + slack) =
        floor(burst + rate))."""
        return self.capacity + (1 - (self.rate % 1)) / 2

    def refill(self, now: float) -> None:
        self.tokens = min(self.ceiling, self.tokens + (now - self.at) * self.rate)
        self.at = now


@dataclass(frozen=True, slots=True)
class GroupUsage:
    pool: str
    group_key: str
    running: int


@dataclass(frozen=True, slots=True)
class Usage:
    name: str
    in_use: int  # concurrency: slots held
    capacity: int
    rate: float  # rate: starts per second
    burst: int
    per_key: bool = False
    keys: int = 0  # keyed: keys holding slots or with tokens spent
    keys_at_limit: tuple[str, ...] = ()  # keyed: at most 10, by key


def resource_of(entry: str) -> str:
    """The resource a task's resources entry names ("name" or "name:key")."""
    return entry.partition(":")[0]


class ResourceGate:
    def __init__(
        self,
        resources: Iterable[ResourceConfig],
        clock: Callable[[], float] = time.monotonic,
        group_caps: Mapping[str, int] | None = None,
    ):
        """group_caps: pool -> max_running_per_group, of the pools that cap their groups."""
        self._clock = clock
        self._group_caps = dict(group_caps or {})
        # pool -> group -> attempts running (groups with none are dropped)
        self._group_running: dict[str, dict[str, int]] = {p: {} for p in self._group_caps}
        self._capacity: dict[str, int] = {}  # resource -> slots
        self._rates: dict[str, tuple[float, float]] = {}  # resource -> (rate, burst)
        resources = list(resources)
        self._per_key = frozenset(r.name for r in resources if r.per_key)
        for r in resources:
            if r.concurrency is not None:
                self._capacity[r.name] = r.concurrency
            elif r.rate is not None:
                self._rates[r.name] = (r.rate, float(r.burst or 1))
        # Slots held and buckets, by resource or "resource:key" (keys only while in use).
        self._in_use: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._reset(clock())
        # seq -> (attempt, worker id, concurrency amounts, (pool, group) or None) of each running
        # attempt holding slots or a group's place
        self._holders: dict[int, tuple[int, str, dict[str, int], tuple[str, str] | None]] = {}
        for name, capacity in self._capacity.items():
            RESOURCE_CAPACITY.labels(resource=name).set(capacity)
        for name, (_, burst) in self._rates.items():
            RESOURCE_CAPACITY.labels(resource=name).set(burst)
        for pool in self._group_caps:
            GROUPS_RUNNING.labels(pool=pool).set(0)
            GROUPS_AT_CAP.labels(pool=pool).set(0)

    @property
    def enabled(self) -> bool:
        return bool(self._capacity or self._rates or self._group_caps)

    # -- takeover -------------------------------------------------------------

    def rebuild(self, running: Iterable[tuple[str, Held]]) -> None:
        """Slots and places held by the store's RUNNING tasks (worker id, what the attempt
        holds); buckets start full."""
        self._reset(self._clock())
        self._group_running = {p: {} for p in self._group_caps}
        self._holders.clear()
        for worker_id, held in running:
            self._hold(worker_id, held)
        self._export()

    def _reset(self, now: float) -> None:
        """No slot held, every bucket full (a keyed resource's keys: none)."""
        self._in_use = {n: 0 for n in self._capacity if n not in self._per_key}
        self._buckets = {
            n: _Bucket(rate, burst, burst, now) for n, (rate, burst) in self._rates.items() if n not in self._per_key
        }

    # -- leases ---------------------------------------------------------------

    def available(self) -> dict[str, int]:
        """What a lease may take now: free slots, and whole tokens; resources with none left
        are left out (tasks naming them are not looked at). A keyed resource: each key in use
        with what it has left (0 too), and "name:" with the full size for every other key."""
        free = {f"{n}:": cap for n, cap in self._capacity.items() if n in self._per_key}
        free.update({f"{n}:": int(burst) for n, (_, burst) in self._rates.items() if n in self._per_key})
        for entry, held in self._in_use.items():
            left = self._capacity[resource_of(entry)] - held
            if left > 0 or entry not in self._capacity:
                free[entry] = max(left, 0)
        for entry, bucket in self._refilled().items():
            if bucket.tokens >= 1 or entry not in self._rates:
                free[entry] = max(int(bucket.tokens), 0)
        return free

    def _refilled(self) -> dict[str, _Bucket]:
        """The buckets refilled to now; a key's bucket full again (to its ceiling: until then it
        keeps what a late start banked) is dropped."""
        now = self._clock()
        for entry, bucket in list(self._buckets.items()):
            bucket.refill(now)
            if bucket.tokens >= bucket.ceiling and entry not in self._rates:
                del self._buckets[entry]
        return self._buckets

    def group_room(self, pools: Iterable[str]) -> dict[str, tuple[int, dict[str, int]]]:
        """Of these pools, those that cap their groups: pool -> (the cap, what runs per group;
        a group not named runs nothing)."""
        return {p: (self._group_caps[p], dict(self._group_running[p])) for p in pools if p in self._group_caps}

    def room_after(
        self, ended: Iterable[tuple[int, int]], worker_id: str, pools: Iterable[str]
    ) -> tuple[dict[str, int], dict[str, tuple[int, dict[str, int]]]]:
        """available() and group_room(pools) once these attempts (seq, attempt) of worker_id end:
        for a lease in the transaction that reports them. Only what the gate holds for exactly
        that attempt of that worker counts; the store refuses no such outcome."""
        free, groups = self.available(), self.group_room(pools)
        for seq, attempt in ended:
            holder = self._holders.get(seq)
            if holder is None or holder[:2] != (attempt, worker_id):
                continue
            for name, amount in holder[2].items():
                free[name] = free.get(name, 0) + amount
            if holder[3] is not None and holder[3][0] in groups:
                running = groups[holder[3][0]][1]
                left = running.pop(holder[3][1], 0) - 1
                if left > 0:
                    running[holder[3][1]] = left
        return free, groups

    def take(self, worker_id: str, leased: Iterable[Held]) -> None:
        """The attempts leased to worker_id take what they hold: slots and group places until
        the attempt ends, tokens spent."""
        for held in leased:
            previous = self._holders.pop(held.seq, None)
            if previous is not None:  # an earlier attempt of it ended unannounced: its slots are free
                self._free(previous)
            for entry, amount in held.resources.items():
                rate = self._rates.get(resource_of(entry))
                if rate is None:
                    continue
                bucket = self._buckets.get(entry)
                if bucket is None:  # a key's first use: a full bucket of its own
                    bucket = self._buckets[entry] = _Bucket(rate[0], rate[1], rate[1], self._clock())
                bucket.tokens -= amount
            self._hold(worker_id, held)
        self._export()

    def next_token_in(self) -> float | None:
        """Seconds until an exhausted rate resource has a token again (None: none is exhausted)."""
        waits = []
        for bucket in self._refilled().values():
            if bucket.tokens < 1:
                waits.append((1 - bucket.tokens) / bucket.rate)
        return min(waits) if waits else None

    # -- attempts ending ------------------------------------------------------

    def release(self, ended: Iterable[tuple[int, int]], worker_id: str | None = None) -> bool:
        """Frees the slots of these ended attempts (seq, attempt) — only of worker_id's when it
        is given (a worker telling of its own handlers that returned); True when any were freed."""
        freed = False
        for seq, attempt in ended:
            holder = self._holders.get(seq)
            if holder is not None and holder[0] == attempt and worker_id in (None, holder[1]):
                del self._holders[seq]
                self._free(holder)
                freed = True
        if freed:
            self._export()
        return freed

    def _hold(self, worker_id: str, held: Held) -> None:
        slots = {n: a for n, a in held.resources.items() if resource_of(n) in self._capacity}
        group = (held.pool, held.group_key) if held.pool in self._group_caps else None
        if slots or group:
            self._holders[held.seq] = (held.attempt, worker_id, slots, group)
            for entry, amount in slots.items():
                self._in_use[entry] = self._in_use.get(entry, 0) + amount
        if group:
            running = self._group_running[group[0]]
            running[group[1]] = running.get(group[1], 0) + 1

    def _free(self, holder: tuple[int, str, dict[str, int], tuple[str, str] | None]) -> None:
        _, _, slots, group = holder
        for entry, amount in slots.items():
            left = max(self._in_use.get(entry, 0) - amount, 0)
            if left or entry in self._capacity:
                self._in_use[entry] = left
            else:  # a key holding no slot: dropped
                self._in_use.pop(entry, None)
        if group:
            running = self._group_running[group[0]]
            left = running.pop(group[1], 0) - 1
            if left > 0:
                running[group[1]] = left

    def _export(self) -> None:
        for name in self._capacity:
            in_use, _, at_limit = self._keys(name)
            RESOURCE_IN_USE.labels(resource=name).set(in_use)
            if name in self._per_key:
                RESOURCE_KEYS_AT_LIMIT.labels(resource=name).set(len(at_limit))
        for name in self._per_key & self._rates.keys():
            RESOURCE_KEYS_AT_LIMIT.labels(resource=name).set(len(self._keys(name)[2]))
        for pool, running in self._group_running.items():
            GROUPS_RUNNING.labels(pool=pool).set(len(running))
            GROUPS_AT_CAP.labels(pool=pool).set(sum(1 for n in running.values() if n >= self._group_caps[pool]))

    # -- reads ----------------------------------------------------------------

    def group_usage(self, pool: str, most: int = 10) -> list[GroupUsage]:
        """The groups of a pool with the most attempts running, most first (then by key)."""
        running = self._group_running.get(pool, {})
        top = sorted(running.items(), key=lambda kv: (-kv[1], kv[0]))[:most]
        return [GroupUsage(pool, key, n) for key, n in top]

    def _keys(self, name: str) -> tuple[int, int, list[str]]:
        """A resource's slots held (summed over its keys), its keys in use, and those at their
        limit (no slot or no whole token left)."""
        if name not in self._per_key:
            return self._in_use.get(name, 0), 0, []
        prefix = f"{name}:"
        if name in self._capacity:
            held = {e[len(prefix) :]: n for e, n in self._in_use.items() if e.startswith(prefix)}
            cap = self._capacity[name]
            return sum(held.values()), len(held), [k for k, n in held.items() if n >= cap]
        spent = {e[len(prefix) :]: b.tokens for e, b in self._buckets.items() if e.startswith(prefix)}
        return 0, len(spent), [k for k, t in spent.items() if t < 1]

    def usage(self, most: int = 10) -> list[Usage]:
        """Each resource's use; of a keyed one, the first `most` keys at their limit (by key)."""
        self._refilled()
        out = []
        for name in sorted(self._capacity.keys() | self._rates.keys()):
            in_use, keys, at_limit = self._keys(name)
            rate, burst = self._rates.get(name, (0.0, 0))
            out.append(
                Usage(
                    name,
                    in_use,
                    self._capacity.get(name, 0),
                    rate,
                    int(burst),
                    per_key=name in self._per_key,
                    keys=keys,
                    keys_at_limit=tuple(sorted(at_limit)[:most]),
                )
            )
        return out
