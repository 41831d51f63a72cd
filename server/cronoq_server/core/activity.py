"""The leader's recent activity per pool, for the snapshot (the dashboard's charts).

Fixed buckets of BUCKET_MS over the last WINDOW_BUCKETS: tasks submitted, started, succeeded
and failed, and the submit-to-start latency of the tasks started. Submissions and outcomes come
from the events as the leader folds them (each event once, by its commit time); starts and
their latency from the leases as they are handed out. Memory only: a new leader starts empty.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from ..store.base import EventColumns, State

BUCKET_MS = 5_000
BUCKET_US = BUCKET_MS * 1000
WINDOW_BUCKETS = 120  # ten minutes
# The outcomes a bucket counts.
COUNTED = (State.SUCCEEDED, State.FAILED)


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
        return self._bucket_at(pool, at_us // BUCKET_US)

    def _bucket_at(self, pool: str, index: int) -> _Bucket:
        buckets = self._pools.setdefault(pool, {})
        bucket = buckets.get(index)
        if bucket is None:
            bucket = buckets[index] = _Bucket()
            for old in [i for i in buckets if i <= index - WINDOW_BUCKETS]:
                del buckets[old]
        return bucket

    def record_events(self, read: Sequence[EventColumns], moves: Mapping[tuple[str, int, int], int]) -> None:
        """Submissions (an event with no previous state) and outcomes, at their commit time
        (moves: how many of the events went from each (pool, state) to each state)."""
        if not any(prev != state and (prev == 0 or state in COUNTED) for _, prev, state in moves):
            return
        tally: Counter[tuple[str, int, int, int]] = Counter()
        for c in read:
            tally.update(
                (pool, prev, state, at // BUCKET_US)
                for pool, prev, state, at in zip(c.pool, c.prev_state, c.state, c.at, strict=True)
                if prev != state and (prev == 0 or state in COUNTED)
            )
        for (pool, prev, state, index), n in tally.items():
            bucket = self._bucket_at(pool, index)
            if prev == 0:
                bucket.submitted += n
            elif state == State.SUCCEEDED:
                bucket.succeeded += n
            else:
                bucket.failed += n

    def record_starts(self, pool: str, now_us: int, latencies_us: Sequence[int]) -> None:
        """Tasks of a pool leased now, each after waiting its latency since it was due."""
        bucket = self._bucket(pool, now_us)
        bucket.started += len(latencies_us)
        bucket.start_latency_sum_ms += sum(latencies_us) / 1000
        bucket.start_latency_max_ms = max(bucket.start_latency_max_ms, max(latencies_us) / 1000)

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
