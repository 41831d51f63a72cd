"""AdminService's PausePool and ResumePool: the pools of the shard an operator paused.

The pause is stored (it holds across restarts and failovers); the leader keeps the paused
pools in memory, read when it takes over, so a lease reads nothing more to skip them.
"""

from __future__ import annotations

from collections.abc import Iterable

from cronoq.v1 import admin_service_pb2 as pb

from ..auth import Principal
from ..errors import invalid
from ..metrics import POOL_PAUSED
from ..store.base import PoolPause, Store
from .events import EventBus
from .tasks import now_us


class PoolPauses:
    """The handlers of PausePool and ResumePool, and the paused pools of the shard's leader."""

    def __init__(self, store: Store, events: EventBus, pools: Iterable[str]):
        self._store = store
        self._events = events
        self._pools = tuple(pools)
        self.paused: frozenset[str] = frozenset()  # the leader's; empty on a standby

    async def load(self) -> None:
        """On taking over: the pauses as stored."""
        self._set({p.pool for p in await self._store.paused_pools()})

    def step_down(self) -> None:
        """Not leading: the gauge drops its series rather than show a pause that may change."""
        self.paused = frozenset()
        POOL_PAUSED.clear()

    async def pause_pool(self, req: pb.PausePoolRequest, caller: Principal) -> pb.PausePoolResponse:
        """Nothing of the pool is leased from now on; its running tasks finish normally."""
        pause = await self._change(req.pool, True, caller)
        return pb.PausePoolResponse(pause=to_pool_pause(pause))

    async def resume_pool(self, req: pb.ResumePoolRequest, caller: Principal) -> pb.ResumePoolResponse:
        """The pool is leased again: workers waiting for its tasks are told at once."""
        pause = await self._change(req.pool, False, caller)
        self._events.wake_pool_leasers(req.pool)
        return pb.ResumePoolResponse(pause=to_pool_pause(pause))

    async def _change(self, pool: str, paused: bool, caller: Principal) -> PoolPause:
        caller.require("admin", pool)
        if pool not in self._pools:
            raise invalid(f"pool: unknown pool {pool!r}")
        pause = await self._store.set_pool_paused(pool, paused, now_us(), caller.name)
        self._set(self.paused | {pool} if paused else self.paused - {pool})
        return pause

    def _set(self, paused: Iterable[str]) -> None:
        self.paused = frozenset(paused)
        for pool in self._pools:
            POOL_PAUSED.labels(pool=pool).set(1 if pool in self.paused else 0)


def to_pool_pause(pause: PoolPause) -> pb.PoolPause:
    out = pb.PoolPause(pool=pause.pool, paused=pause.paused, paused_by=pause.paused_by)
    if pause.paused_at is not None:
        out.paused_at.FromMicroseconds(pause.paused_at)
    return out
