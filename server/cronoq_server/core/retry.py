"""Retry backoff for failed attempts: exponential with equal jitter (half fixed, half random), per pool."""

from __future__ import annotations

import random

from ..config import PoolConfig


def make_retry_at(pools: dict[str, PoolConfig]):  # type: ignore[no-untyped-def]
    def retry_at(pool: str, attempt: int, now: int, retry_after_ms: int) -> int:
        if retry_after_ms > 0:
            return now + retry_after_ms * 1000
        cfg = pools[pool]
        try:
            growth = cfg.retry_backoff * cfg.retry_backoff_multiplier ** max(attempt - 1, 0)
        except OverflowError:  # e.g. multiplier 10 past attempt 309: far beyond any cap
            growth = cfg.retry_backoff_max
        ceiling = min(cfg.retry_backoff_max, growth)
        # Half fixed, half jitter: never sooner than half the backoff, spread to avoid herds.
        delay = ceiling / 2 + random.uniform(0, ceiling / 2)
        return now + int(delay * 1e6)

    return retry_at
