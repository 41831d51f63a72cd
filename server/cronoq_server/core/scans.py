"""Calls that scan the tasks table far (bulk actions, and listings by a filter no index
serves): a caller has limits.max_bulk_calls of them in progress on a shard at most
(RESOURCE_EXHAUSTED beyond, with when to retry), and the store stops a scan past
limits.bulk_scan_timeout (DEADLINE_EXCEEDED)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import grpc

from ..auth import Principal
from ..config import LimitsConfig
from ..errors import ApiError


class ScanCalls:
    """The scanning calls in progress on a shard, by caller (Principal.identity)."""

    def __init__(self, limits: LimitsConfig, shard_name: str):
        self._limits = limits
        self._shard_name = shard_name
        self._in_progress: Counter[str] = Counter()

    @contextlib.contextmanager
    def admitted(self, caller: Principal) -> Iterator[None]:
        """One more scanning call of caller in progress, unless it has limits.max_bulk_calls already."""
        most = self._limits.max_bulk_calls
        if self._in_progress[caller.identity] >= most:
            raise ApiError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"limits.max_bulk_calls: {caller.name!r} has {most} bulk calls in progress on shard "
                f"{self._shard_name!r}, the most it may (limit {most}); retry once one has answered",
                reason="BULK_CALLS_LIMIT",
                retry_delay=1.0,
            )
        self._in_progress[caller.identity] += 1
        try:
            yield
        finally:
            self._in_progress[caller.identity] -= 1
            if not self._in_progress[caller.identity]:
                del self._in_progress[caller.identity]

    def timed_out(self, done: str) -> ApiError:
        """The answer to a scan the store stopped (ScanTimedOut); done: what the call did before."""
        return ApiError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "filter: finding the tasks it matches took longer than limits.bulk_scan_timeout "
            f"({self._limits.bulk_scan_timeout:g} s) on shard {self._shard_name!r} and was stopped "
            f"({done}); narrow it (pool, states, created or finished bounds, ids)",
            reason="BULK_SCAN_TIMEOUT",
        )
