"""The leader's recent activity per pool, for the snapshot (the dashboard's charts).

Fixed buckets of BUCKET_MS over the last WINDOW_BUCKETS: tasks submitted, started, succeeded
and failed, and the submit-to-start latency of the tasks started. Submissions and outcomes come
from the events as the leader folds them (each event once, by its commit time); starts and
their latency from the leases as they are handed out. Memory only: a new leader starts empty.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..store.base import EventRow, State

BUCKET_MS = 5_000
WINDOW_BUCKETS = 120  # ten minutes


class _Bucket:
    __slots__ = ("failed", "start_latency_max_ms", "start_latency_sum_ms", "started", "submitted", "succeeded")

    def __init__(self) -> None:
        self.submitted = self.started = self.succeeded = self.failed = 0
        self.start_latency_sum_ms = self.start_latency_max_ms = 0.0


class PoolSeries:
    """One pool's buckets as parallel lists, oldest first, starting at start_unix_ms."""

    FIELDS = _Bucket.__slots__

    def __init__(self, pool: str, start_unix_ms: int, buckets: list[_Bucket]):
        self.pool = pool
        self.start_unix_ms = start_unix_ms
        self.bucket_ms = BUCKET_MS
        self.columns = {f: [getattr(b, f) for b in buckets] for f in self.FIELDS}


class Activity:
    def __init__(self) -> None:
        self._pools: dict[str, dict[int, _Bucket]] = {}

    def clear(self) -> None:
        self._pools = {}

    def _bucket(self, pool: str, at_us: int) -> _Bucket:
        index = at_us // (BUCKET_MS * 1000)
        buckets = self._pools.setdefault(pool, {})
        bucket = buckets.get(index)
        if bucket is None:
            bucket = buckets[index] = _Bucket()
            for old in [i for i in buckets if i <= index - WINDOW_BUCKETS]:
                del buckets[old]
        return bucket

    def record_events(self, events: Iterable[EventRow]) -> None:
        """Submissions (an event with no previous state) and outcomes, at their commit time."""
        for e in events:
            if e.prev_state == e.state:
                continue
            if e.prev_state == 0:
                self._bucket(e.pool, e.at).submitted += 1
            elif e.state == State.SUCCEEDED:
                self._bucket(e.pool, e.at).succeeded += 1
            elif e.state == State.FAILED:
                self._bucket(e.pool, e.at).failed += 1

    def record_start(self, pool: str, now_us: int, latency_us: int) -> None:
        bucket = self._bucket(pool, now_us)
        latency_ms = latency_us / 1000
        bucket.started += 1
        bucket.start_latency_sum_ms += latency_ms
        bucket.start_latency_max_ms = max(bucket.start_latency_max_ms, latency_ms)

    def series(self, pools: Iterable[str], now_us: int) -> list[PoolSeries]:
        """The window that ends with the bucket holding now_us, for each of `pools`."""
        last = now_us // (BUCKET_MS * 1000)
        first = last - WINDOW_BUCKETS + 1
        out = []
        for pool in pools:
            buckets = self._pools.get(pool, {})
            out.append(
                PoolSeries(pool, first * BUCKET_MS, [buckets.get(i) or _Bucket() for i in range(first, last + 1)])
            )
        return out
