"""core.retry.make_retry_at: exponential backoff, capped, half fixed and half jitter."""

from __future__ import annotations

import pytest

from cronoq_server.config import PoolConfig
from cronoq_server.core.retry import make_retry_at

NOW = 1_700_000_000_000_000
SAMPLES = 200


def delays_s(pool: PoolConfig, attempt: int) -> list[float]:
    retry_at = make_retry_at({pool.name: pool})
    return [(retry_at(pool.name, attempt, NOW, 0) - NOW) / 1e6 for _ in range(SAMPLES)]


@pytest.mark.parametrize(
    ("attempt", "ceiling"), [(0, 1.0), (1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (20, 30.0)]
)
def test_exponential_within_half_and_full_of_the_capped_backoff(attempt: int, ceiling: float) -> None:
    pool = PoolConfig(name="p", retry_backoff=1.0, retry_backoff_multiplier=2.0, retry_backoff_max=30.0)
    delays = delays_s(pool, attempt)
    assert all(ceiling / 2 - 1e-6 <= d <= ceiling + 1e-6 for d in delays), (min(delays), max(delays))
    assert max(delays) - min(delays) > ceiling / 10  # jittered, not fixed


def test_growth_follows_the_pool() -> None:
    pool = PoolConfig(name="p", retry_backoff=0.05, retry_backoff_multiplier=3.0, retry_backoff_max=10.0)
    for attempt, ceiling in ((1, 0.05), (2, 0.15), (3, 0.45), (10, 10.0)):
        assert all(ceiling / 2 - 1e-6 <= d <= ceiling + 1e-6 for d in delays_s(pool, attempt))


def test_the_last_attempts_of_a_steep_pool_stay_at_the_cap() -> None:
    # multiplier 10 overflows a float past attempt 309; max_attempts allows 1000.
    pool = PoolConfig(name="p", max_attempts=1000, retry_backoff_multiplier=10.0, retry_backoff_max=60.0)
    for attempt in (400, 999):
        assert all(30.0 - 1e-6 <= d <= 60.0 + 1e-6 for d in delays_s(pool, attempt))


def test_retry_after_overrides_the_backoff() -> None:
    pool = PoolConfig(name="p", retry_backoff=100.0)
    retry_at = make_retry_at({"p": pool})
    assert retry_at("p", 1, NOW, 250) == NOW + 250_000
    assert retry_at("p", 7, NOW, 1) == NOW + 1000
    assert retry_at("p", 1, NOW, 0) >= NOW + 50_000_000  # 0 means "use the backoff"
