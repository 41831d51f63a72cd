"""One server of one shard: leadership, the store, the core services, and the one
call path that both APIs (gRPC and HTTP) go through."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from cronoq.v1 import admin_service_pb2 as admin_pb
from cronoq.v1 import worker_service_pb2

from . import __version__
from .auth import Authenticator, Principal
from .config import UNSHARDED, Config
from .core.events import EventBus
from .core.leases import Leases
from .core.retry import make_retry_at
from .core.tasks import Tasks
from .errors import ApiError
from .leader import FileLeadership
from .metrics import CALLS, LEADER, TASKS_BY_STATE, TASKS_SUBMITTED, WORKERS
from .store.base import State, Store, StoreSettings
from .store.sqlite import SqliteStore

log = logging.getLogger("cronoq.node")

# Calls a standby answers itself; every other call needs the leader.
STANDBY_CALLS = {"GetServerInfo"}


class Node:
    def __init__(self, config: Config, shard: str | None = None):
        self.config = config
        if config.sharded:
            spec = next((s for s in config.shards if s.name == shard), None)
            if spec is None:
                raise ValueError(f"--shard: unknown shard {shard!r}")
            self.shard_name, self.shard_number, self.pools = spec.name, spec.number, list(spec.pools)
        else:
            self.shard_name, self.shard_number = UNSHARDED, 0
            self.pools = [p.name for p in config.pools]
        scheme = "https" if config.server.tls else "http"
        self.advertise = config.server.advertise or f"{scheme}://{config.server.listen}"
        self.server_id = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.auth = Authenticator(config)
        self.store: Store = self._make_store()
        self.leadership = FileLeadership(self._store_path(), self.advertise)
        self.events = EventBus(self.store, self.shard_name, self.shard_number)
        self.tasks = Tasks(config, self.store, self.events, self.shard_name, self.shard_number, self.pools)
        self.leases = Leases(config, self.store, self.events, self.shard_name, self.shard_number, self.pools)
        self.is_leader = False
        self._background: list[asyncio.Task[None]] = []
        self._unary: dict[str, Callable[[Any, Principal], Awaitable[Message]]] = {
            "SubmitTask": self.tasks.submit_task,
            "SubmitBatch": self.tasks.submit_batch,
            "GetTask": self.tasks.get_task,
            "WaitTask": self.tasks.wait_task,
            "CancelTask": self.tasks.cancel_task,
            "ListTasks": self.tasks.list_tasks,
            "RegisterWorker": self.leases.register_worker,
            "LeaseTasks": self.leases.lease_tasks,
            "Heartbeat": self.leases.heartbeat,
            "FinishTasks": self.leases.finish_tasks,
            "DeregisterWorker": self.leases.deregister_worker,
            "ListWorkers": self.leases.list_workers,
            "GetServerInfo": self.get_server_info,
            "GetSnapshot": self.get_snapshot,
        }

    def _store_path(self) -> str:
        return self.config.store.path.replace("{shard}", self.shard_name)

    def _make_store(self) -> Store:
        settings = StoreSettings(
            shard_name=self.shard_name,
            shard_number=self.shard_number,
            lease_ttl_us={p.name: int(p.lease_ttl * 1e6) for p in self.config.pools if p.name in self.pools},
            retention_us={p.name: int(p.retention * 1e6) for p in self.config.pools if p.name in self.pools},
            retry_at=make_retry_at({p.name: p for p in self.config.pools}),
            max_pending_total=self.config.limits.max_pending_total,
            max_pending_per_pool=self.config.limits.max_pending_per_pool,
        )
        if self.config.store.kind != "sqlite":
            raise ValueError(f"store.kind: {self.config.store.kind!r} is not available in this build")
        return SqliteStore(self._store_path(), settings, self.config.store.synchronous)

    # -- leadership -----------------------------------------------------------

    async def run_leadership(self, became_leader: Callable[[], None] | None = None) -> None:
        """Waits for the lock, then opens the store and starts the leader's work."""
        if not self.leadership.try_acquire():
            log.info("shard %s: standby, waiting for leadership (lock %s)", self.shard_name, self.leadership.path)
            await self.leadership.acquire()
        await self.store.open()
        self.is_leader = True
        LEADER.set(1)
        self._background.append(asyncio.create_task(self.leases.sweep_forever()))
        log.info("shard %s: leader at %s (store %s)", self.shard_name, self.advertise, self._store_path())
        if became_leader:
            became_leader()

    async def drain(self) -> None:
        """Stops leasing: long polls return empty and Watch streams end."""
        self.leases.draining = True
        self.events.wake_leasers()
        self.events.close_watchers()

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.is_leader:
            await self.store.close()
        self.is_leader = False
        LEADER.set(0)
        self.leadership.release()

    # -- the one call path ----------------------------------------------------

    def authenticate(self, authorization: str | None, cert_subject: str | None) -> Principal:
        return self.auth.authenticate(authorization, cert_subject)

    def _require_leader(self, method: str) -> None:
        if not self.is_leader and method not in STANDBY_CALLS:
            leader = self.leadership.current_leader()
            raise ApiError(
                grpc.StatusCode.UNAVAILABLE,
                f"this server is a standby of shard {self.shard_name!r}; the leader is {leader or 'not known yet'}",
                {"cronoq-leader": leader} if leader else {},
            )

    async def call(self, method: str, request: Message, caller: Principal) -> Message:
        code = "OK"
        try:
            self._require_leader(method)
            response = await self._unary[method](request, caller)
            if method in ("SubmitTask", "SubmitBatch"):
                _count_submitted(method, request, response)
            return response
        except ApiError as err:
            code = err.code.name
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            CALLS.labels(method=method, code=code).inc()

    def watch(self, request: Message, caller: Principal) -> AsyncIterator[Message]:
        self._require_leader("Watch")
        return self.tasks.watch(request, caller)  # type: ignore[arg-type]

    # -- admin ----------------------------------------------------------------

    async def get_server_info(
        self, req: admin_pb.GetServerInfoRequest, caller: Principal
    ) -> admin_pb.GetServerInfoResponse:
        return admin_pb.GetServerInfoResponse(
            version=__version__,
            shard=self.shard_name,
            shard_number=self.shard_number,
            role=admin_pb.ROLE_LEADER if self.is_leader else admin_pb.ROLE_STANDBY,
            server_id=self.server_id,
            advertise=self.advertise,
            leader=self.advertise if self.is_leader else self.leadership.current_leader(),
        )

    async def get_snapshot(self, req: admin_pb.GetSnapshotRequest, caller: Principal) -> admin_pb.GetSnapshotResponse:
        counts = await self.store.count_by_pool_and_state()
        snap = admin_pb.ShardSnapshot(shard=self.shard_name, number=self.shard_number, leader=self.advertise)
        for pool in self.pools:
            if not caller.may("read", pool):
                continue
            pc = admin_pb.PoolCounts(pool=pool)
            for state in State:
                setattr(pc, state.name.lower(), counts.get((pool, state), 0))
            snap.pools.append(pc)
        workers = await self.leases.list_workers(worker_service_pb2.ListWorkersRequest(), caller)
        snap.workers.extend(workers.workers)
        return admin_pb.GetSnapshotResponse(shards=[snap])

    async def refresh_gauges(self) -> None:
        if not self.is_leader:
            return
        counts = await self.store.count_by_pool_and_state()
        for pool in self.pools:
            for state in State:
                TASKS_BY_STATE.labels(pool=pool, state=state.name.lower()).set(counts.get((pool, state), 0))
        per_pool: dict[str, int] = {p: 0 for p in self.pools}
        for w in await self.store.list_workers():
            for p in w.pools:
                per_pool[p] = per_pool.get(p, 0) + 1
        for pool, n in per_pool.items():
            WORKERS.labels(pool=pool).set(n)


def _count_submitted(method: str, request: Any, response: Any) -> None:
    if method == "SubmitTask":
        if not response.deduplicated:
            TASKS_SUBMITTED.labels(pool=request.pool).inc()
        return
    dedup = set(response.deduplicated_ids)
    for task in response.tasks:
        if task.id not in dedup:
            TASKS_SUBMITTED.labels(pool=task.pool).inc()
