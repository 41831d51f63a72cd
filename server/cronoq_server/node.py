"""One server of one shard: leadership, the store, the core services, and the one
call path that both APIs (gRPC and HTTP) go through."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from cronoq.v1 import admin_service_pb2 as admin_pb
from cronoq.v1 import worker_service_pb2

from . import __version__
from .auth import Authenticator, Principal
from .config import PERMISSIONS, UNSHARDED, Config
from .core.bulk import Bulk
from .core.events import EVENT_RETENTION_EVERY_S, SEQUENCE_EVERY_S, EventBus
from .core.leases import NUDGE_EVERY_S, Leases
from .core.maintenance import Periodic, Services
from .core.outbox import OutboxRelay
from .core.pools import PoolPauses
from .core.resources import ResourceGate
from .core.retry import make_retry_at
from .core.schedules import Schedules
from .core.tasks import Tasks, now_us
from .errors import ApiError
from .leader import FileLeadership, PgLeadership
from .metrics import LEADER, LEADER_TERM, OLDEST_PENDING_AGE, TASKS_SUBMITTED, WORKERS
from .registry import RegistryError, registry
from .store.base import State, Store, StoreSettings, StoreUnavailable
from .store.postgres import PostgresStore
from .store.sqlite import SqliteStore

log = logging.getLogger("cronoq.node")
T = TypeVar("T")

# The leader recounts registered workers by pool, and reads each pool's oldest due task, this
# often (never for a scrape); tasks by pool and state are kept from the events (core/counts.py).
WORKER_GAUGES_EVERY_S = 5.0
PENDING_AGE_EVERY_S = 5.0
RETENTION_EVERY_S = 60.0  # the retention service at most (a step deletes all that is due, in batches)
START_BY_EVERY_S = 0.5  # the start_by sweep (a lease never hands out a task past it meanwhile)
# The groups a pool that caps them shows in GetSnapshot (most tasks pending and running first).
TOP_GROUPS = 10


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
        self.events = EventBus(
            self.store, self.shard_name, self.shard_number, config.server.watch_window, pools=self.pools
        )
        self.leadership: FileLeadership | PgLeadership
        if isinstance(self.store, PostgresStore):
            self.leadership = PgLeadership(
                self.store.url, self.store.schema, self.advertise, self.server_id, self.events.nudge_leasers
            )
        else:
            self.leadership = FileLeadership(self._store_path(), self.advertise, self.server_id)
        self.tasks = Tasks(config, self.store, self.events, self.shard_name, self.shard_number, self.pools)
        self.pauses = PoolPauses(self.store, self.events, self.pools)
        resources = (r for r in config.resources if r.shard in (None, self.shard_name))
        self.gate = ResourceGate(resources, group_caps=self._group_caps())
        self.leases = Leases(
            config,
            self.store,
            self.events,
            self.shard_name,
            self.shard_number,
            self.pools,
            lambda: self.is_leader,
            self.gate,
            lambda: self.pauses.paused,
            self.tasks,
        )
        self.bulk = Bulk(
            self.tasks,
            self.store,
            self.events,
            self.shard_name,
            self.shard_number,
            self.pools,
            config.server.forward_timeout / 2,
            config.limits,
            self.tasks.scans,
        )
        self.schedules = Schedules(config, self.store, self.events, self.tasks, self.pools)
        self.is_leader = False
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._store_open = False
        # The leader's periodic work: started on taking over, stopped on stepping down.
        self.services = Services()
        self.services.add(Periodic("lease expiry", 0.5, self.leases.expire_once))
        self.services.add(Periodic("long poll nudge", NUDGE_EVERY_S, self.leases.nudge_once))
        self.services.add(Periodic("retention", self._retention_every(), self.leases.purge_once))
        self.services.add(Periodic("start deadlines", START_BY_EVERY_S, self.leases.start_by_once))
        reap_every = min(max(config.server.worker_reap_after / 4, 1.0), 60.0)
        self.services.add(Periodic("worker reaper", reap_every, self.leases.reap_once))
        self.services.add(Periodic("worker gauges", WORKER_GAUGES_EVERY_S, self._set_worker_gauges))
        self.services.add(Periodic("pending age gauge", PENDING_AGE_EVERY_S, self._set_pending_age_gauge))
        self.services.add(Periodic("event sequencer", SEQUENCE_EVERY_S, self.events.sequence_once))
        purge_every = min(EVENT_RETENTION_EVERY_S, max(config.server.watch_window / 4, 0.1))
        self.services.add(Periodic("event retention", purge_every, self.events.purge_once))
        self.schedules.wake = self.services.add(Periodic("schedules", 1.0, self.schedules.fire_due)).poke
        # Each outbox's relay, by this shard's leader (its connection is closed on stepping down).
        self.outboxes = [OutboxRelay(config, o, self.tasks, self.pools) for o in config.outboxes]
        for relay in self.outboxes:
            relay.resolve_url(dict(os.environ))
            periodic = Periodic(f"outbox {relay.name}", relay.outbox.poll_interval, relay.step, relay.close)
            relay.poke = self.services.add(periodic).poke
        self._unary: dict[str, Callable[[Any, Principal], Awaitable[Message]]] = {
            "SubmitTask": self.tasks.submit_task,
            "SubmitBatch": self.tasks.submit_batch,
            "GetTask": self.tasks.get_task,
            "WaitTask": self.tasks.wait_task,
            "CancelTask": self.tasks.cancel_task,
            "RetryTask": self.tasks.retry_task,
            "DeleteTask": self.tasks.delete_task,
            "ListTasks": self.tasks.list_tasks,
            "CancelTasks": self.bulk.cancel_tasks,
            "RetryTasks": self.bulk.retry_tasks,
            "DeleteTasks": self.bulk.delete_tasks,
            "RegisterWorker": self.leases.register_worker,
            "LeaseTasks": self.leases.lease_tasks,
            "Heartbeat": self.leases.heartbeat,
            "FinishTasks": self.leases.finish_tasks,
            "DeregisterWorker": self.leases.deregister_worker,
            "ListWorkers": self.leases.list_workers,
            "PutSchedule": self.schedules.put_schedule,
            "DeleteSchedule": self.schedules.delete_schedule,
            "ListSchedules": self.schedules.list_schedules,
            "GetServerInfo": self.get_server_info,
            "GetSnapshot": self.get_snapshot,
            "PausePool": self.pauses.pause_pool,
            "ResumePool": self.pauses.resume_pool,
            **{name: _not_yet(name) for name in _NOT_YET},
        }
        self.rpcs = registry()
        unhandled = [r.path for r in self.rpcs.values() if not r.server_streaming and r.name not in self._unary]
        if unhandled:
            raise RegistryError(f"RPCs without a handler: {', '.join(unhandled)}")

    def _group_caps(self) -> dict[str, int]:
        """max_running_per_group of this shard's pools that set it."""
        pools = (p for p in self.config.pools if p.name in self.pools)
        return {p.name: p.max_running_per_group for p in pools if p.max_running_per_group}

    def _store_path(self) -> str:
        return self.config.store.path.replace("{shard}", self.shard_name)

    def _make_store(self) -> Store:
        settings = StoreSettings(
            shard_name=self.shard_name,
            shard_number=self.shard_number,
            lease_ttl_us={p.name: int(p.lease_ttl * 1e6) for p in self.config.pools if p.name in self.pools},
            retention_us={p.name: int(p.retention * 1e6) for p in self.config.pools if p.name in self.pools},
            retention_failed_us={
                p.name: int((p.retention if p.retention_failed is None else p.retention_failed) * 1e6)
                for p in self.config.pools
                if p.name in self.pools
            },
            retry_at=make_retry_at({p.name: p for p in self.config.pools}),
            max_pending_total=self.config.limits.max_pending_total,
            max_pending_per_pool=self.config.limits.max_pending_per_pool,
            group_pools=frozenset(self._group_caps()),
            max_snoozes={p.name: p.max_snoozes for p in self.config.pools if p.name in self.pools},
            bulk_scans=self.config.store.bulk_scans,
            bulk_scan_timeout_us=int(self.config.limits.bulk_scan_timeout * 1e6),
            max_dependency_results_bytes=self.config.limits.max_dependency_results_bytes,
        )
        store = self.config.store
        if store.kind == "sqlite":
            return SqliteStore(self._store_path(), settings, store.synchronous)
        url = store.url or os.environ.get(store.url_env)
        if not url:
            raise ValueError(f"store.url_env: environment variable {store.url_env!r} is not set (or give store.url)")
        default_schema = "cronoq_{shard}" if self.config.sharded else "cronoq"
        schema = (store.schema_ or default_schema).replace("{shard}", self.shard_name)
        return PostgresStore(url, schema, settings, store.pool_size, store.step_pool_size)

    def describe_store(self) -> str:
        if isinstance(self.store, PostgresStore):
            return f"postgres schema {self.store.schema}"
        return f"sqlite {self._store_path()}"

    # -- leadership -----------------------------------------------------------

    async def run_leadership(self, on_change: Callable[[bool], Awaitable[None]] | None = None) -> None:
        """Leads whenever it holds the lock; steps down the moment it loses it, then tries again."""
        while True:
            if not await self.leadership.try_acquire():
                log.info("shard %s: standby, waiting for leadership (%s)", self.shard_name, self.leadership.describe)
                await self.leadership.acquire()
            try:
                await self._lead()
                if on_change:
                    await on_change(True)
                await self.leadership.lost()
                log.error("shard %s: lost leadership (term %d); stepping down", self.shard_name, self.leadership.term)
            finally:
                await self._step_down()
                if on_change:
                    await on_change(False)

    async def open_store(self) -> None:
        """Opens (creating or migrating) the store, waiting while it is unreachable.

        Raises StoreRefused when the store holds another shard's tasks or a newer schema.
        """
        while not self._store_open:
            try:
                await self.store.open()
                self._store_open = True
            except StoreUnavailable as err:
                log.warning("shard %s: %s; retrying", self.shard_name, err)
                await self.store.close()
                await asyncio.sleep(1.0)

    async def _lead(self) -> None:
        # A newer server may have migrated the store while this one waited: never lead on it.
        await self._retrying("schema version not checked", self.store.check_schema)
        if isinstance(self.store, PostgresStore):
            self.store.term = self.leadership.term
            self.store.on_fenced = self.leadership.mark_lost
        if self.gate.enabled:
            # Slots held by tasks that were running under the previous leader stay held.
            self.gate.rebuild(await self._retrying("resources not rebuilt", self.store.running_resources))
            await self._retrying("ranks not rebuilt", self.store.load_ranks)
        await self._retrying("paused pools not read", self.pauses.load)
        self.events.lead()
        self.is_leader = True
        LEADER.set(1)
        LEADER_TERM.set(self.leadership.term)
        self.services.start()
        log.info(
            "shard %s: leader (term %d) at %s, store %s",
            self.shard_name, self.leadership.term, self.advertise, self.describe_store(),
        )  # fmt: skip

    async def _retrying(self, what: str, read: Callable[[], Awaitable[T]]) -> T:
        """read(), again every 0.5 s while the store is unreachable."""
        while True:
            try:
                return await read()
            except StoreUnavailable as err:
                log.warning("shard %s: %s yet: %s; retrying", self.shard_name, what, err)
                await asyncio.sleep(0.5)

    async def _step_down(self) -> None:
        self.is_leader = False
        LEADER.set(0)
        self.events.wake_leasers()  # long polls see they no longer lead and return
        self.leases.end_streams()
        self.events.fail_watchers(  # Watch streams resume from their cursors on the next leader
            ApiError(
                grpc.StatusCode.UNAVAILABLE,
                f"this server no longer leads shard {self.shard_name!r}; watch again with the last cursor",
                reason="NOT_LEADER",
                retry_delay=0.1,
            )
        )
        await self.services.stop()
        self.pauses.step_down()
        OLDEST_PENDING_AGE.clear()
        self.events.step_down()  # after the sequencer stopped: nothing counts on

    async def drain(self) -> None:
        """Stops serving: new calls are refused with UNAVAILABLE (callers move to another server),
        open waits are answered with the task as it is, long polls return empty, Watch streams end."""
        self.draining = True
        self.leases.draining = True
        self.events.drain()
        self.leases.end_streams()

    async def wait_idle(self, timeout: float) -> bool:
        """Until every call in flight is answered, or timeout seconds pass; True when idle."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        await self._step_down()
        await self.leadership.release()
        if self._store_open:
            await self.store.close()
            self._store_open = False

    # -- the one call path ----------------------------------------------------

    def authenticate(self, authorization: str | None, cert_subject: str | None) -> Principal:
        return self.auth.authenticate(authorization, cert_subject)

    def admit(self, method: str, caller: Principal, *, leading: bool = True) -> None:
        """What every call passes before its request is looked at: this server must be able to
        answer it (the leader, or a standby for calls declared so), and the caller must hold
        the permission the RPC declares on some pool (each pool is checked again by the call).

        leading=False leaves out the leader check, for a call the shard router may forward
        (a standby forwards to another shard as well as the leader does)."""
        rpc = self.rpcs[method]
        if self.draining and not rpc.standby:
            # No leader named: it is about to change, so the caller tries its next endpoint.
            raise ApiError(
                grpc.StatusCode.UNAVAILABLE,
                f"this server of shard {self.shard_name!r} is shutting down",
                reason="SHUTTING_DOWN",
                retry_delay=0.1,
            )
        if leading and not self.is_leader and not rpc.standby:
            leader = self.leadership.current_leader()
            raise ApiError(
                grpc.StatusCode.UNAVAILABLE,
                f"this server is a standby of shard {self.shard_name!r}; the leader is {leader or 'not known yet'}",
                {"cronoq-leader": leader} if leader else {},
                reason="NOT_LEADER",
                retry_delay=0.1,
            )
        if not rpc.admits(caller.permissions):
            wanted = repr(rpc.permission) + (f" or {rpc.or_permission!r}" if rpc.or_permission else "")
            raise ApiError(grpc.StatusCode.PERMISSION_DENIED, f"{caller.name!r} lacks permission {wanted} ({method})")

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Counts a call as in flight until it is answered: drain waits for these."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def call(self, method: str, request: Message, caller: Principal) -> Message:
        with self.in_flight():
            return await self._call(method, request, caller)

    async def _call(self, method: str, request: Message, caller: Principal) -> Message:
        try:
            self.admit(method, caller)
            response = await self._unary[method](request, caller)
            if method in ("SubmitTask", "SubmitBatch"):
                _count_submitted(method, request, response)
            return response
        except StoreUnavailable as err:
            raise self._store_unavailable(err) from None

    def _store_unavailable(self, err: StoreUnavailable) -> ApiError:
        leader = self.leadership.current_leader()
        metadata = {"cronoq-leader": leader} if leader else {}
        return ApiError(grpc.StatusCode.UNAVAILABLE, str(err), metadata, reason="STORE_UNAVAILABLE", retry_delay=0.5)

    async def work(
        self, requests: AsyncIterator[worker_service_pb2.WorkRequest], caller: Principal
    ) -> AsyncIterator[worker_service_pb2.WorkResponse]:
        """A worker's Work stream (see Leases.work); when this server stops leading or drains,
        the stream ends with the UNAVAILABLE any call would get."""
        self.admit("Work", caller)
        try:
            async for answer in self.leases.work(requests, caller, self.in_flight):
                yield answer
        except StoreUnavailable as err:
            raise self._store_unavailable(err) from None
        self.admit("Work", caller)

    async def open_watch(self, request: Message, caller: Principal) -> tuple[int, AsyncGenerator[Message, None]]:
        """Admits and checks a Watch (its cursor too): the event seq the stream starts after (the
        cursor's; live, the last event's), and the iterator the events come from."""
        self.admit("Watch", caller)
        try:
            return await self.tasks.watch(request, caller)  # type: ignore[arg-type]
        except StoreUnavailable as err:
            raise self._store_unavailable(err) from None

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
            term=self.leadership.term if self.is_leader else 0,
            caller=admin_pb.Caller(
                name=caller.name,
                all_pools=caller.pools is None,
                pools=sorted(caller.pools or ()),
                permissions=[p for p in PERMISSIONS if p in caller.permissions],
            ),
        )

    async def _top_groups(self, pool: str) -> list[admin_pb.GroupCounts]:
        """The groups of a pool that caps them with the most tasks pending and running."""
        running = {g.group_key: g.running for g in self.gate.group_usage(pool, TOP_GROUPS)}
        pending = await self.store.pending_by_group(pool, TOP_GROUPS, sorted(running))
        totals = sorted(set(running) | set(pending), key=lambda g: (-(running.get(g, 0) + pending.get(g, 0)), g))
        return [
            admin_pb.GroupCounts(group_key=g, pending=pending.get(g, 0), running=running.get(g, 0))
            for g in totals[:TOP_GROUPS]
        ]

    async def get_snapshot(self, req: admin_pb.GetSnapshotRequest, caller: Principal) -> admin_pb.GetSnapshotResponse:
        """The pools the caller may read or administer, the workers that serve them, and (with
        admin) the shard's resources; nothing of a shard where it may read or administer no pool."""
        shown = [p for p in self.pools if caller.may("read", p) or caller.may("admin", p)]
        if not shown and self.config.sharded:  # its name, leader, term and standbys are not the caller's to know
            return admin_pb.GetSnapshotResponse()
        counts = await self.store.count_by_pool_and_state()
        snap = admin_pb.ShardSnapshot(
            shard=self.shard_name, number=self.shard_number, leader=self.advertise, term=self.leadership.term
        )
        caps = self._group_caps()
        for pool in shown:
            pc = admin_pb.PoolCounts(pool=pool, paused=pool in self.pauses.paused)
            for state in State:
                setattr(pc, state.name.lower(), counts.get((pool, state), 0))
            if pool in caps:
                pc.max_running_per_group = caps[pool]
                pc.groups.extend(await self._top_groups(pool))
            snap.pools.append(pc)
        for series in self.events.activity.series(shown, now_us()):
            snap.activity.append(
                admin_pb.PoolActivity(
                    pool=series.pool, start_unix_ms=series.start_unix_ms, bucket_ms=series.bucket_ms, **series.columns
                )
            )
        if "admin" in caller.permissions:
            for usage in self.gate.usage():
                snap.resources.append(
                    admin_pb.ResourceUsage(
                        name=usage.name,
                        in_use=usage.in_use,
                        capacity=usage.capacity,
                        rate=usage.rate,
                        burst=usage.burst,
                        per_key=usage.per_key,
                        keys=usage.keys,
                        keys_at_limit=usage.keys_at_limit,
                    )
                )
        workers = await self.leases.list_workers(worker_service_pb2.ListWorkersRequest(), caller)
        snap.workers.extend(workers.workers)
        snap.standbys.extend(await self.leadership.standbys())
        for relay in self.outboxes:
            if self.is_leader and any(caller.may("read", p) for p in relay.outbox.pools):
                snap.outboxes.append(relay.status())
        return admin_pb.GetSnapshotResponse(shards=[snap])

    def _retention_every(self) -> float:
        """How often the retention service runs: every minute, or a quarter of the shortest
        retention of this shard's pools (at least a second)."""
        pools = [p for p in self.config.pools if p.name in self.pools]
        kept = [k for p in pools for k in (p.retention, p.retention_failed) if k]
        return min([RETENTION_EVERY_S, *(max(k / 4, 1.0) for k in kept)])

    async def _set_worker_gauges(self) -> None:
        """Workers by pool, as listed: the workers table is small (one row a worker process)."""
        per_pool: dict[str, int] = {p: 0 for p in self.pools}
        for w in await self.leases.present_workers():
            for p in w.pools:
                per_pool[p] = per_pool.get(p, 0) + 1
        for pool, n in per_pool.items():
            WORKERS.labels(pool=pool).set(n)

    async def _set_pending_age_gauge(self) -> None:
        """How long each pool's earliest-due PENDING task has waited (0: none due)."""
        now = now_us()
        due_since = await self.store.oldest_due_pending(self.pools, now)
        for pool in self.pools:
            OLDEST_PENDING_AGE.labels(pool=pool).set(max(now - due_since.get(pool, now), 0) / 1e6)


def _count_submitted(method: str, request: Any, response: Any) -> None:
    if method == "SubmitTask":
        if not response.deduplicated:
            TASKS_SUBMITTED.labels(pool=request.pool).inc()
        return
    dedup = set(response.deduplicated_ids)
    for pool, n in Counter(t.pool for t in response.tasks if t.id not in dedup).items():
        TASKS_SUBMITTED.labels(pool=pool).inc(n)


# RPCs declared in the protos whose handlers are being built (answered UNIMPLEMENTED until then).
_NOT_YET: tuple[str, ...] = ()


def _not_yet(name: str) -> Callable[[Any, Principal], Awaitable[Message]]:
    async def refuse(request: Any, caller: Principal) -> Message:
        raise ApiError(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served by this build yet")

    return refuse
