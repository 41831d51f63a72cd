"""What routing needs to know of a call beyond its request, and which shards a caller may know of."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..auth import Principal
from ..config import ShardConfig


@dataclass(frozen=True, slots=True)
class Call:
    """Who calls and how, beyond the request: what routing needs from the API layer."""

    caller: Principal
    forwarded: bool = False  # arrived with cronoq-forwarded: answered for this shard only
    timeout: float | None = None  # seconds left before the caller's deadline; None: no deadline
    traceparent: str = ""  # the caller's W3C trace context (metadata or header), for this server's span
    tracestate: str = ""


def may_read(caller: Principal, shard: ShardConfig, permissions: Iterable[str | None] = ("read",)) -> bool:
    """Whether the caller may read (or hold one of `permissions` on) some pool of the shard: a
    caller that may not learns nothing of it (its name, endpoint, leader, or that it is down)."""
    return any(p is not None and caller.may(p, pool) for pool in shard.pools for p in permissions)
