"""WorkerService: registration, lease long polls, heartbeats, fenced finish reports,
and the leader's lease-expiry and retention steps (run by core.maintenance)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable

import grpc

from cronoq.v1 import worker_service_pb2 as pb

from ..auth import Principal
from ..config import Config
from ..errors import ApiError, invalid
from ..ids import make_task_id, seq_of, shard_of
from ..metrics import START_LATENCY, TASKS_LEASED, record_finished
from ..store.base import Outcome, OutcomeKind, Store, TaskRow, WorkerRow
from .convert import to_task, to_worker
from .events import EventBus
from .limits import (
    MAX_CONTENT_TYPE,
    MAX_LABEL_KEY,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_WORKER_NAME,
    cap_error,
    check_text,
)
from .resources import ResourceGate
from .tasks import now_us

log = logging.getLogger("cronoq.leases")


MAX_LEASE_BATCH = 1000
MAX_DONE = 10_000
MAX_LEASE_WAIT_MS = 60_000
# A lease reply holds at most this many bytes of tasks (below the SDKs' 64 MiB receive limit);
# a worker may ask for less with max_bytes. A single larger task is still leased alone.
MAX_LEASE_BYTES = 16 << 20
# Even when no change announces work, the leader has one long poll per pool look at the store
# this often (work written behind the server's back).
NUDGE_EVERY_S = 1.0
# Worker rows kept in memory (a worker not among them is read from the store).
MAX_CACHED_WORKERS = 10_000


class Leases:
    def __init__(
        self,
        config: Config,
        store: Store,
        events: EventBus,
        shard_name: str,
        shard_number: int,
        pools: list[str],
        is_leader: Callable[[], bool] = lambda: True,
        gate: ResourceGate | None = None,
    ):
        self._is_leader = is_leader
        self._gate = gate or ResourceGate([])
        self._resource_lease = asyncio.Lock()
        self._config = config
        self._store = store
        self._events = events
        self._shard_name = shard_name
        self._shard = shard_number
        self._pools = set(pools)
        self._workers: dict[str, WorkerRow] = {}
        self.draining = False

    # -- registration ---------------------------------------------------------

    async def register_worker(self, req: pb.RegisterWorkerRequest, caller: Principal) -> pb.RegisterWorkerResponse:
        if not req.pools:
            raise invalid("pools: a worker needs at least one pool")
        for pool in req.pools:
            caller.require("work", pool)
            if pool not in self._pools:
                raise invalid(f"pools: unknown pool {pool!r}")
        if req.concurrency < 0:
            raise invalid(f"concurrency: {req.concurrency} is negative")
        check_text("name", req.name, MAX_WORKER_NAME)
        if len(req.labels) > MAX_LABELS:
            raise invalid(f"labels: {len(req.labels)} labels, more than {MAX_LABELS}")
        for key, value in req.labels.items():
            check_text("labels key", key, MAX_LABEL_KEY)
            check_text(f"labels[{key!r}]", value, MAX_LABEL_VALUE)
        now = now_us()
        worker = WorkerRow(
            uuid.uuid4().hex, req.name, list(req.pools), req.concurrency, dict(req.labels), now, now, caller.identity
        )
        await self._store.register_worker(worker)
        self._remember(worker)
        ttl = min(self._config.pool(p).lease_ttl for p in req.pools)  # type: ignore[union-attr]
        log.info("worker %s (%r) registered for %s", worker.id, worker.name, ",".join(worker.pools))
        return pb.RegisterWorkerResponse(
            worker_id=worker.id,
            heartbeat_interval_ms=max(int(ttl * 1000 / 3), 100),
            shard=self._shard_name,
            max_result_bytes=self._config.limits.max_result_bytes,
            max_lease_bytes=MAX_LEASE_BYTES,
        )

    def _remember(self, worker: WorkerRow) -> None:
        """Caches a worker's row (its pools and principal), the oldest dropped past the bound."""
        self._workers[worker.id] = worker
        while len(self._workers) > MAX_CACHED_WORKERS:
            del self._workers[next(iter(self._workers))]

    async def _worker(self, worker_id: str, caller: Principal) -> WorkerRow:
        """The registered worker, used by the principal that registered it only."""
        if len(worker_id) > 64:
            raise invalid(f"worker_id: {len(worker_id)} characters; worker ids are 32")
        worker = self._workers.get(worker_id)
        if worker is None:
            worker = await self._store.get_worker(worker_id)
            if worker is None:
                raise ApiError(
                    grpc.StatusCode.NOT_FOUND, f"worker_id: worker {worker_id!r} is not registered; register again"
                )
            self._remember(worker)
        if worker.principal != caller.identity:
            raise ApiError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"worker_id: worker {worker_id!r} was registered by another principal; register your own",
            )
        for pool in worker.pools:
            caller.require("work", pool)
        return worker

    async def deregister_worker(
        self, req: pb.DeregisterWorkerRequest, caller: Principal
    ) -> pb.DeregisterWorkerResponse:
        await self._worker(req.worker_id, caller)
        await self._store.deregister_worker(req.worker_id)
        self._workers.pop(req.worker_id, None)
        return pb.DeregisterWorkerResponse()

    async def list_workers(self, req: pb.ListWorkersRequest, caller: Principal) -> pb.ListWorkersResponse:
        """Workers as far as the caller may read: a worker of mixed pools shows only readable ones."""
        if req.pool:
            caller.require("read", req.pool)
        rows = await self._store.list_workers()
        running = await self._store.running_by_worker()
        visible = []
        for w in rows:
            pools = [p for p in w.pools if caller.may("read", p)]
            if pools and (not req.pool or req.pool in pools):
                worker = dataclasses.replace(w, pools=pools)
                visible.append(to_worker(worker, self._shard_name, running.get(w.id, 0)))
        return pb.ListWorkersResponse(workers=visible)

    # -- leases ---------------------------------------------------------------

    async def lease_tasks(self, req: pb.LeaseTasksRequest, caller: Principal) -> pb.LeaseTasksResponse:
        worker = await self._worker(req.worker_id, caller)
        pools = list(req.pools) or worker.pools
        for pool in pools:
            if pool not in worker.pools:
                raise invalid(f"pools: worker {worker.id!r} did not register for pool {pool!r}")
        if req.max_tasks < 1:
            raise invalid(f"max_tasks: {req.max_tasks} must be at least 1")
        limit = min(req.max_tasks, MAX_LEASE_BATCH)
        if len(req.done) > MAX_DONE:
            raise invalid(f"done: {len(req.done)} attempts, more than {MAX_DONE}")
        if req.done:  # the worker's handlers that returned: their slots are free for this lease
            done = [(seq_of(a.task_id), a.attempt) for a in req.done if shard_of(a.task_id) == self._shard]
            self._ended(done, worker.id)
        max_bytes = min(req.max_bytes or MAX_LEASE_BYTES, MAX_LEASE_BYTES)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(req.wait_ms, MAX_LEASE_WAIT_MS) / 1000
        while not self.draining and self._is_leader():
            waiter = self._events.lease_waiter(pools)
            try:
                now = now_us()
                rows, next_due = await self._lease(worker.id, pools, limit, now, max_bytes)
                if rows:
                    TASKS_LEASED.inc(len(rows))
                    for r in rows:
                        START_LATENCY.observe(max(now - max(r.run_at, r.created_at), 0) / 1e6)
                    await self._events.publish([(r.seq, r.state) for r in rows], rows)
                    return pb.LeaseTasksResponse(tasks=[to_task(r, self._shard) for r in rows])
                remaining = deadline - loop.time()
                if remaining <= 0 or self.draining:
                    break
                timeout = remaining
                if next_due is not None:
                    timeout = min(timeout, max((next_due - now) / 1e6, 0.001))
                token_in = self._gate.next_token_in()
                if token_in is not None:  # a rate resource refills: its tasks may run then
                    timeout = min(timeout, max(token_in, 0.001))
                try:
                    await asyncio.wait_for(waiter.event.wait(), timeout)
                except TimeoutError:
                    pass
            finally:
                self._events.forget_leaser(waiter)
        return pb.LeaseTasksResponse()

    async def _lease(
        self, worker_id: str, pools: list[str], limit: int, now: int, max_bytes: int
    ) -> tuple[list[TaskRow], int | None]:
        """The store's lease; with resources configured, only tasks that fit in what is available
        (one such lease at a time, so what was available is still there when it is taken)."""
        if not self._gate.enabled:
            return await self._store.lease(worker_id, pools, limit, now, max_bytes)
        async with self._resource_lease:
            rows, next_due = await self._store.lease(worker_id, pools, limit, now, max_bytes, self._gate.available())
            self._gate.take(worker_id, ((r.seq, r.attempt, r.resources) for r in rows if r.resources))
        return rows, next_due

    def _ended(self, attempts: list[tuple[int, int]], worker_id: str | None = None) -> None:
        """These attempts ended (of worker_id, when given): their resource slots are free, and
        waiting leases look again."""
        if self._gate.release(attempts, worker_id):
            self._events.nudge_leasers()

    async def heartbeat(self, req: pb.HeartbeatRequest, caller: Principal) -> pb.HeartbeatResponse:
        await self._worker(req.worker_id, caller)
        mine = [(seq_of(t.task_id), t.attempt) for t in req.tasks if shard_of(t.task_id) == self._shard]
        foreign = [t.task_id for t in req.tasks if shard_of(t.task_id) != self._shard]
        cancelled, lost = await self._store.heartbeat(req.worker_id, mine, now_us())
        return pb.HeartbeatResponse(
            cancelled_task_ids=[make_task_id(self._shard, s) for s in cancelled],
            lost_task_ids=[make_task_id(self._shard, s) for s in lost] + foreign,
        )

    async def finish_tasks(self, req: pb.FinishTasksRequest, caller: Principal) -> pb.FinishTasksResponse:
        await self._worker(req.worker_id, caller)
        max_result = self._config.limits.max_result_bytes
        outcomes = []
        for i, o in enumerate(req.outcomes):
            kind = o.WhichOneof("outcome")
            if kind is None:
                raise invalid(f"outcomes[{i}]: give success, failure, cancelled or released")
            if shard_of(o.task_id) != self._shard:
                raise invalid(f"outcomes[{i}].task_id: task {o.task_id} belongs to another shard")
            seq = seq_of(o.task_id)
            if kind == "success" and len(o.success.result) > max_result:
                # Applied as the failure it is, rather than leaving the task to its lease expiry.
                error = f"result of {len(o.success.result)} bytes exceeds max_result_bytes {max_result}"
                outcomes.append(Outcome(seq, o.attempt, OutcomeKind.FAILURE, error=error, retryable=False))
            elif kind == "success":
                check_text(f"outcomes[{i}].success.content_type", o.success.content_type, MAX_CONTENT_TYPE)
                outcomes.append(Outcome(seq, o.attempt, OutcomeKind.SUCCESS, o.success.result, o.success.content_type))
            elif kind == "failure":
                f = o.failure
                outcomes.append(
                    Outcome(
                        seq,
                        o.attempt,
                        OutcomeKind.FAILURE,
                        error=cap_error(f.error),
                        retryable=f.retryable,
                        retry_after_ms=f.retry_after_ms,
                    )
                )
            elif kind == "cancelled":
                outcomes.append(
                    Outcome(seq, o.attempt, OutcomeKind.CANCELLED, error=cap_error(o.cancelled.reason or "cancelled"))
                )
            else:
                outcomes.append(Outcome(seq, o.attempt, OutcomeKind.RELEASED))
        results, changes = await self._store.finish(req.worker_id, outcomes, now_us())
        attempts = {o.seq: o.attempt for o in outcomes}
        self._ended([(r.seq, attempts[r.seq]) for r in results if r.accepted])
        await self._events.publish(changes)
        record_finished(changes)
        return pb.FinishTasksResponse(
            results=[
                pb.FinishTaskResult(
                    task_id=make_task_id(self._shard, r.seq), accepted=r.accepted, code=r.code, message=r.message
                )
                for r in results
            ]
        )

    # -- the leader's services -----------------------------------------------

    async def expire_once(self) -> None:
        """Ends every lease past its expiry (a failed, retryable attempt)."""
        changes, ended = await self._store.expire_leases(now_us())
        self._ended(ended)
        if changes:
            log.info("expired %d lease(s)", len(changes))
            await self._events.publish(changes)

    async def purge_once(self) -> None:
        purged = await self._store.purge(now_us())
        if purged:
            log.info("purged %d task(s) past retention", purged)

    async def reap_once(self) -> None:
        """Removes workers silent for longer than server.worker_reap_after; their tasks were
        already lost to lease expiry. A reaped worker that comes back registers again."""
        cutoff = now_us() - int(self._config.server.worker_reap_after * 1e6)
        reaped = await self._store.reap_workers(cutoff)
        for worker_id in reaped:
            self._workers.pop(worker_id, None)
        if reaped:
            log.info("reaped %d worker(s) silent for over %.0fs", len(reaped), self._config.server.worker_reap_after)

    async def nudge_once(self) -> None:
        """Has one long poll per pool look at the store (work written behind the server's back)."""
        self._events.nudge_leasers()
