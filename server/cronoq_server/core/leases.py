"""WorkerService: registration, lease long polls, heartbeats, fenced finish reports,
and the leader's lease-expiry and retention steps (run by core.maintenance)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import grpc

from cronoq.v1 import worker_service_pb2 as pb
from cronoq.v1.task_pb2 import Task

from ..auth import Principal
from ..config import Config, PoolConfig
from ..errors import ApiError, invalid
from ..ids import make_task_id, seq_of, shard_of
from ..metrics import START_LATENCY, TASKS_LEASED, TASKS_PURGED, WORK_STREAMS, observe_all
from ..store.base import (
    Changes,
    Held,
    Outcome,
    OutcomeKind,
    OutcomeResult,
    Progress,
    Report,
    State,
    Store,
    StoreUnavailable,
    TaskRow,
    WorkerRow,
)
from ..store.logic import spawn_refused
from .convert import to_task, to_worker
from .events import EventBus, LeaseWaiter
from .limits import (
    MAX_CHECKPOINT_BYTES,
    MAX_CONTENT_TYPE,
    MAX_DONE,
    MAX_HEARTBEAT_TASKS,
    MAX_LABEL_KEY,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_OUTCOMES,
    MAX_PROGRESS_MESSAGE_BYTES,
    MAX_WORK_CREDITS,
    MAX_WORKER_NAME,
    MAX_WORKER_POOLS,
    STORE_CHUNK,
    WORKER_CONCURRENCY,
    cap_error,
    check_count,
    check_range,
    check_text,
)
from .resources import ResourceGate
from .tasks import Tasks, now_us

log = logging.getLogger("cronoq.leases")
# The expired leases of one sweep logged one line each (with task_id), at most.
LOGGED_EXPIRIES = 100
# Retention deletes at most PURGE_BATCH tasks a transaction (a call that meets one waits for it,
# a few ms) and pauses after each, PURGE_DUTY times as long as the batch took: it takes 1% of
# the store's time, so 99 calls in 100 never meet a batch (the p99 of other calls during a purge
# of 1,000,000 tasks: 1.45x quiet on SQLite, 1.34x on PostgreSQL, where batches taking a fifth
# of the time gave 1.75-2.6x); about 1,000 tasks/s on SQLite, 700-870 on PostgreSQL. A purge
# still going after PURGE_BEHIND_S is behind a store that ends tasks faster than that: it then
# takes a twentieth (PURGE_DUTY_BEHIND), and catches up.
# The start_by sweep ends at most EXPIRE_BATCH a transaction.
PURGE_BATCH = 500
PURGE_PAUSE_S = 0.01
PURGE_DUTY = 99.0
PURGE_BEHIND_S = 1800.0
PURGE_DUTY_BEHIND = 19.0
EXPIRE_BATCH = 1000


def purge_pause(batch_s: float, running_s: float) -> float:
    """The pause after a purge batch that took batch_s, in a purge running for running_s."""
    duty = PURGE_DUTY if running_s < PURGE_BEHIND_S else PURGE_DUTY_BEHIND
    return max(PURGE_PAUSE_S, duty * batch_s)


MAX_LEASE_BATCH = 1000
# One step of a Work stream answers the messages received up to this many entries (a message,
# its outcomes, its heartbeat's attempts; one message at least); its reader stops reading (gRPC's
# flow control then holds the worker back) while more than WORK_BACKLOG wait.
WORK_STEP_ENTRIES = MAX_OUTCOMES
WORK_BACKLOG = 4 * MAX_OUTCOMES
# A worker that gives its slots (WorkRequest.slots) holds beyond them, of the credits it gives,
# at most what it starts within HOLD_STEPS of its steps: its tasks reported a second (over the
# last PACE_WINDOW_S or more) times a step's time, smoothed by STEP_SMOOTHING. Enough held
# tasks to cover the round trip of the next step; none for a worker whose handlers are slow,
# so a task never waits behind them while another worker could start it.
HOLD_STEPS = 2.0
PACE_WINDOW_S = 0.1
STEP_SMOOTHING = 0.25
MAX_LEASE_WAIT_MS = 60_000
# A lease reply holds at most this many bytes of tasks (below the SDKs' 64 MiB receive limit);
# a worker may ask for less with max_bytes. A single larger task is still leased alone.
MAX_LEASE_BYTES = 16 << 20
# Even when no change announces work, the leader has one long poll per pool look at the store
# this often (work written behind the server's back).
NUDGE_EVERY_S = 1.0
# Worker rows kept in memory (a worker not among them is read from the store).
MAX_CACHED_WORKERS = 10_000
# A silent worker stays listed at least this long, however short its pools' lease_ttl.
PRESENT_FOR_US = 30_000_000


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
        paused: Callable[[], frozenset[str]] = frozenset,
        tasks: Tasks | None = None,
    ):
        self._tasks = tasks or Tasks(config, store, events, shard_name, shard_number, pools)
        self._is_leader = is_leader
        self._paused = paused  # the pools nothing is leased from (core/pools.py)
        self._gate = gate or ResourceGate([])
        self._resource_lease = asyncio.Lock()
        self._config = config
        self._store = store
        self._events = events
        self._shard_name = shard_name
        self._shard = shard_number
        self._pools = set(pools)
        self._workers: dict[str, WorkerRow] = {}
        # Of each worker of several pools, its leases so far: the pool it starts with (_in_turn).
        self._turns: dict[str, int] = {}
        self.draining = False
        # Set (and replaced) when this server stops leading or drains: Work streams end.
        self._streams_end = asyncio.Event()
        self._streams: set[_WorkStream] = set()

    # -- registration ---------------------------------------------------------

    async def register_worker(self, req: pb.RegisterWorkerRequest, caller: Principal) -> pb.RegisterWorkerResponse:
        if not req.pools:
            raise invalid("pools: a worker needs at least one pool")
        check_count("pools", len(req.pools), MAX_WORKER_POOLS, "pools")
        for pool in req.pools:
            caller.require("work", pool)
            if pool not in self._pools:
                raise invalid(f"pools: unknown pool {pool!r}")
        check_range("concurrency", req.concurrency, WORKER_CONCURRENCY)
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
        log.info(
            "worker %s (%r) registered for %s",
            worker.id,
            worker.name,
            ",".join(worker.pools),
            extra={"worker_id": worker.id},
        )
        return pb.RegisterWorkerResponse(
            worker_id=worker.id,
            heartbeat_interval_ms=max(int(ttl * 1000 / 3), 100),
            shard=self._shard_name,
            max_result_bytes=self._config.limits.max_result_bytes,
            max_lease_bytes=MAX_LEASE_BYTES,
            max_checkpoint_bytes=MAX_CHECKPOINT_BYTES,
        )

    def _remember(self, worker: WorkerRow) -> None:
        """Caches a worker's row (its pools and principal), the oldest dropped past the bound."""
        self._workers[worker.id] = worker
        while len(self._workers) > MAX_CACHED_WORKERS:
            del self._workers[next(iter(self._workers))]

    async def _worker(self, worker_id: str, caller: Principal) -> WorkerRow:
        """The registered worker, used by the principal that registered it only."""
        if not worker_id:
            raise invalid("worker_id: empty; give the id RegisterWorker returned")
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
            if req.pool not in self._pools:  # as ListTasks: an unknown pool is bad input, not an empty list
                raise invalid(f"pool: unknown pool {req.pool!r}")
        rows = await self.present_workers()
        running = await self._store.running_by_worker()
        visible = []
        for w in rows:
            pools = [p for p in w.pools if caller.may("read", p)]
            if pools and (not req.pool or req.pool in pools):
                worker = dataclasses.replace(w, pools=pools)
                visible.append(to_worker(worker, self._shard_name, running.get(w.id, 0)))
        return pb.ListWorkersResponse(workers=visible)

    async def present_workers(self) -> list[WorkerRow]:
        """The workers heard from within twice their leases' time to live (six missed
        heartbeats), and at least PRESENT_FOR_US: one silent for longer lost its tasks, and is
        likely gone with a restarted shard; it stays registered until reaped
        (server.worker_reap_after) and is listed again at its next heartbeat."""
        now = now_us()
        return [
            w
            for w in await self._store.list_workers()
            if now - w.last_seen_at <= max(2 * self._lease_ttl_us(w), PRESENT_FOR_US)
        ]

    def _lease_ttl_us(self, worker: WorkerRow) -> int:
        ttls = [pool.lease_ttl for pool in map(self._config.pool, worker.pools) if pool is not None]
        return int(min(ttls, default=PoolConfig.model_fields["lease_ttl"].default) * 1e6)  # its pools were removed

    # -- leases ---------------------------------------------------------------

    @staticmethod
    def _lease_pools(worker: WorkerRow, asked: Sequence[str]) -> list[str]:
        """The pools a lease of this worker takes from (asked: empty for all it registered for)."""
        check_count("pools", len(asked), MAX_WORKER_POOLS, "pools")
        for pool in asked:
            if pool not in worker.pools:
                raise invalid(f"pools: worker {worker.id!r} did not register for pool {pool!r}")
        return list(asked) or worker.pools

    async def _leased(self, rows: list[TaskRow], now: int) -> list[Task]:
        """Counts, announces and converts the tasks a lease took."""
        if not rows:
            return []
        latencies: dict[str, list[int]] = {}
        for r in rows:
            latencies.setdefault(r.pool, []).append(max(now - max(r.run_at, r.created_at), 0))
        for pool, waited in latencies.items():
            self._events.activity.record_starts(pool, now, waited)
            TASKS_LEASED.labels(pool).inc(len(waited))
            observe_all(START_LATENCY.labels(pool), (us / 1e6 for us in waited))
        await self._events.publish([(r.seq, r.state) for r in rows], rows)
        await self._tasks.fill_dependency_results(rows)
        limit = self._config.limits.max_dependency_results_bytes
        over = {r.seq: size for r in rows if r.dependency_results and (size := dependency_bytes(r)) > limit}
        if over:  # their dependencies ended with more than a handler is given: they fail unrun
            failed = [
                Outcome(
                    r.seq,
                    r.attempt,
                    OutcomeKind.FAILURE,
                    error=f"dependency results: {over[r.seq]} bytes, over limits.max_dependency_results_bytes"
                    f" {limit} ({_largest_dependencies(r, self._shard)})",
                    retryable=False,
                )
                for r in rows
                if r.seq in over
            ]
            await self._finish(rows[0].worker_id or "", failed, now)  # one lease: one worker's rows
            rows = [r for r in rows if r.seq not in over]
        return [to_task(r, self._shard) for r in rows]

    async def lease_tasks(self, req: pb.LeaseTasksRequest, caller: Principal) -> pb.LeaseTasksResponse:
        worker = await self._worker(req.worker_id, caller)
        pools = self._lease_pools(worker, req.pools)
        if req.max_tasks < 1:
            raise invalid(f"max_tasks: {req.max_tasks} must be at least 1")
        limit = min(req.max_tasks, MAX_LEASE_BATCH)
        check_count("done", len(req.done), MAX_DONE, "attempts")
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
                    return pb.LeaseTasksResponse(tasks=await self._leased(rows, now))
                remaining = deadline - loop.time()
                if remaining <= 0 or self.draining:
                    break
                timeout = min(remaining, self._recheck_in(next_due, now))
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
        """The store's lease, of the pools not paused; with resources configured, only tasks that
        fit in what is available (one such lease at a time, so what was available is still there
        when it is taken)."""
        pools = self._in_turn(worker_id, self._unpaused(pools))
        if not pools:
            return [], None
        if not self._gate.enabled:
            return await self._store.lease(worker_id, pools, limit, now, max_bytes)
        async with self._resource_lease:
            free, groups = self._gate.available(), self._gate.group_room(pools)
            token_due = self._token_due()
            rows, next_due = await self._store.lease(worker_id, pools, limit, now, max_bytes, free, groups)
            self._gate.take(worker_id, _held(rows))
            token_due = _sooner(token_due, self._token_due())
        return rows, _sooner(next_due, token_due)

    def _unpaused(self, pools: list[str]) -> list[str]:
        paused = self._paused()
        return [p for p in pools if p not in paused] if paused else pools

    def _in_turn(self, worker_id: str, pools: list[str]) -> list[str]:
        """The pools of a worker's lease in the order the store deals its slots to them (round
        robin, the first given first): each lease of the worker starts one pool further on."""
        if len(pools) < 2:
            return pools
        turn = self._turns.pop(worker_id, 0)
        self._turns[worker_id] = turn + 1  # the most recent last: the oldest goes past the bound
        if len(self._turns) > MAX_CACHED_WORKERS:
            del self._turns[next(iter(self._turns))]
        start = turn % len(pools)
        return pools[start:] + pools[:start]

    def _recheck_in(self, next_due: int | None, now: int) -> float:
        """Seconds until a lease that found nothing may find something without being told: the
        next task due, or a rate resource's next token (inf: only when told)."""
        return float("inf") if next_due is None else max((next_due - now) / 1e6, 0.001)

    def _token_due(self) -> int | None:
        """When (µs) a rate resource (or key) with no whole token has one again; None: none.
        A lease asks as it looks and once it took: a bucket it saw empty may refill while it
        runs, and the tasks behind it are not leased until a lease looks again."""
        token_in = self._gate.next_token_in()
        return None if token_in is None else now_us() + int(token_in * 1e6)

    def _ended(self, attempts: list[tuple[int, int]], worker_id: str | None = None) -> None:
        """These attempts ended (of worker_id, when given): their resource slots are free, and
        waiting leases look again."""
        if self._gate.release(attempts, worker_id):
            self._events.nudge_leasers()

    async def heartbeat(self, req: pb.HeartbeatRequest, caller: Principal) -> pb.HeartbeatResponse:
        await self._worker(req.worker_id, caller)
        check_count("tasks", len(req.tasks), MAX_HEARTBEAT_TASKS, "attempts")
        check_reports("reports", req.reports)
        return await self._beat(req.worker_id, req.tasks, req.reports)

    async def _beat(
        self, worker_id: str, tasks: Sequence[pb.TaskAttempt], reports: Sequence[pb.TaskReport]
    ) -> pb.HeartbeatResponse:
        """Extends the leases of these attempts held by the worker (STORE_CHUNK a transaction),
        keeping the reports (checked) of those still current; the cancelled and lost among them."""
        mine = [(seq_of(t.task_id), t.attempt) for t in tasks if shard_of(t.task_id) == self._shard]
        foreign = [t.task_id for t in tasks if shard_of(t.task_id) != self._shard]
        # The last report of each task of this shard (one of another shard: the task is lost)
        kept = list({r.seq: r for r in (self._report(r) for r in reports) if r is not None}.values())
        cancelled: list[int] = []
        lost: list[int] = []
        for start in range(0, max(len(mine), len(kept), 1), STORE_CHUNK):  # one call with none: the worker was seen
            end = start + STORE_CHUNK
            part = await self._store.heartbeat(worker_id, mine[start:end], now_us(), kept[start:end])
            cancelled += part[0]
            lost += part[1]
        return pb.HeartbeatResponse(
            cancelled_task_ids=[make_task_id(self._shard, s) for s in cancelled],
            lost_task_ids=[make_task_id(self._shard, s) for s in lost] + foreign,
        )

    async def finish_tasks(self, req: pb.FinishTasksRequest, caller: Principal) -> pb.FinishTasksResponse:
        await self._worker(req.worker_id, caller)
        check_count("outcomes", len(req.outcomes), MAX_OUTCOMES, "outcomes")
        outcomes = [self._outcome(f"outcomes[{i}]", o, caller) for i, o in enumerate(req.outcomes)]
        return pb.FinishTasksResponse(results=await self._finish(req.worker_id, outcomes, now_us()))

    async def _finish(self, worker_id: str, outcomes: list[Outcome], now: int) -> list[pb.FinishTaskResult]:
        """Applies these outcomes, STORE_CHUNK a transaction (each is applied or refused on its own)."""
        finished: list[pb.FinishTaskResult] = []
        for start in range(0, len(outcomes), STORE_CHUNK):
            part = outcomes[start : start + STORE_CHUNK]
            results, changes = await self._store.finish(worker_id, part, now)
            finished += await self._finished(part, results, changes)
        return finished

    def _report(self, r: pb.TaskReport) -> Report | None:
        """The store's Report of a checked one (check_reports); None for another shard's task."""
        if shard_of(r.task_id) != self._shard:
            return None
        progress = Progress(r.progress.value, r.progress.message, 0) if r.HasField("progress") else None
        return Report(seq_of(r.task_id), r.attempt, progress, r.checkpoint if r.HasField("checkpoint") else None)

    def _outcome(self, field: str, o: pb.TaskOutcome, caller: Principal) -> Outcome:
        """The store's Outcome of a reported one, with its report and what it spawns (as the
        caller submits); raises INVALID_ARGUMENT naming field."""
        outcome = self._bare_outcome(field, o)
        if outcome.kind is OutcomeKind.SUCCESS and o.success.spawn:
            try:
                outcome.spawn, outcome.spawn_visible = self._tasks.spawned(o.success.spawn, caller)
            except ApiError as err:  # the attempt fails with why
                outcome = spawn_refused(outcome, err)
        if o.HasField("report"):
            check_report(f"{field}.report", o.report)
            report = o.report
            report.task_id, report.attempt = o.task_id, o.attempt  # the outcome's attempt
            outcome.report = self._report(report)
        return outcome

    def _bare_outcome(self, field: str, o: pb.TaskOutcome) -> Outcome:
        kind = o.WhichOneof("outcome")
        if kind is None:
            raise invalid(f"{field}: give success, failure, cancelled, released or snoozed")
        if shard_of(o.task_id) != self._shard:
            raise invalid(f"{field}.task_id: task {o.task_id} belongs to another shard")
        seq = seq_of(o.task_id)
        max_result = self._config.limits.max_result_bytes
        if kind == "success" and len(o.success.result) > max_result:
            # Applied as the failure it is, rather than leaving the task to its lease expiry.
            error = f"result of {len(o.success.result)} bytes exceeds max_result_bytes {max_result}"
            return Outcome(seq, o.attempt, OutcomeKind.FAILURE, error=error, retryable=False)
        if kind == "success":
            check_text(f"{field}.success.content_type", o.success.content_type, MAX_CONTENT_TYPE)
            return Outcome(seq, o.attempt, OutcomeKind.SUCCESS, o.success.result, o.success.content_type)
        if kind == "failure":
            f = o.failure
            return Outcome(
                seq,
                o.attempt,
                OutcomeKind.FAILURE,
                error=cap_error(f.error),
                retryable=f.retryable,
                retry_after_ms=f.retry_after_ms,
            )
        if kind == "cancelled":
            return Outcome(seq, o.attempt, OutcomeKind.CANCELLED, error=cap_error(o.cancelled.reason or "cancelled"))
        if kind == "snoozed":
            s = o.snoozed
            return Outcome(seq, o.attempt, OutcomeKind.SNOOZED, error=cap_error(s.reason), retry_after_ms=s.snooze_ms)
        return Outcome(seq, o.attempt, OutcomeKind.RELEASED)

    async def _finished(
        self, outcomes: list[Outcome], results: list[OutcomeResult], changes: Changes
    ) -> list[pb.FinishTaskResult]:
        """Frees the resource slots of the accepted outcomes, announces the changes (counted as
        the leader folds their events: metrics.record_events); the results as the API gives them."""
        attempts = {o.seq: o.attempt for o in outcomes}
        self._ended([(r.seq, attempts[r.seq]) for r in results if r.accepted])
        await self._events.publish(changes)
        return [
            pb.FinishTaskResult(
                task_id=make_task_id(self._shard, r.seq), accepted=r.accepted, code=r.code, message=r.message
            )
            for r in results
        ]

    # -- the Work stream ------------------------------------------------------

    def end_streams(self) -> None:
        """Has every Work stream answer what it received and end (is_leader or draining say why)."""
        self._streams_end.set()
        self._streams_end = asyncio.Event()

    async def work(
        self,
        requests: AsyncIterator[pb.WorkRequest],
        caller: Principal,
        in_flight: Callable[[], AbstractContextManager[None]],
    ) -> AsyncIterator[pb.WorkResponse]:
        """A worker's Work stream: outcomes and the next tasks in one store call (a step),
        heartbeats, and tasks sent as soon as they are due while the worker has credits.

        Up to the store's work_steps steps run at once, each leasing at most that share of the
        worker's slots: on PostgreSQL (two), the database works on one while the worker runs
        the tasks of the other. Returns when the worker closes its side (after answering what
        it sent), or when this server drains or stops leading (after answering what it
        received: the caller says why); in_flight() covers each step, so a drain waits for
        those under way. The tasks a worker that closed its side was leased and did not report
        are released as its stream ends (see _give_back).
        """
        first = await anext(aiter(requests), None)
        if first is None:
            return
        worker = await self._worker(first.worker_id, caller)
        _check_counts(first)
        pools = self._lease_pools(worker, first.pools)
        max_bytes = min(first.max_bytes or MAX_LEASE_BYTES, MAX_LEASE_BYTES)
        check_range("slots", first.slots, WORKER_CONCURRENCY)
        inbox = _WorkInbox(worker.id, first)
        reader = asyncio.create_task(inbox.read(requests))
        loop = asyncio.get_running_loop()
        stream = _WorkStream()
        self._streams.add(stream)
        WORK_STREAMS.inc()
        most_steps = self._store.work_steps
        credits = 0  # given by the worker, not yet used or reserved by a step
        chunk = 1  # the most one step leases: a share of the most credits seen
        pace = _Pace(first.slots, loop.time())
        # The steps under way, each with the waiter registered before its lease, its limit and
        # when it began.
        steps: dict[asyncio.Task[tuple[pb.WorkResponse, float]], tuple[LeaseWaiter | None, int, float]] = {}

        def room() -> int:
            """Of the credits, what the worker may be sent now (see _Pace)."""
            reserved = sum(limit for _, limit, _ in steps.values())
            return pace.room(credits, len(stream.running) + reserved, loop.time())

        look_again_at: float | None = None  # set: the last lease found less than it asked for
        unused_wake: tuple[str, ...] = ()  # the pools of a wake taken and not yet used by a lease
        try:
            while True:
                if inbox.error is not None:
                    raise inbox.error
                waiter = stream.waiter
                if waiter is not None and waiter.event.is_set():  # work may be available
                    self._events.forget_leaser(waiter)
                    stream.waiter, look_again_at, unused_wake = None, None, waiter.pools
                if look_again_at is not None and (loop.time() >= look_again_at or stream.waiter is None):
                    look_again_at = None  # due; or no waiter left to tell it (see expire_once)
                leading = self._is_leader() and not self.draining
                # A worker that is closing (or closed its side) is stopping: what it sent is
                # answered, and it is leased nothing more (a task submitted meanwhile goes to
                # another worker).
                leasing = leading and not stream.silent and not inbox.closed and not inbox.closing
                may_lease = leasing and look_again_at is None
                if len(steps) < most_steps and (inbox.waiting or (may_lease and room())):
                    received = inbox.take()
                    stream.heard(received)
                    pace.reported(sum(len(r.outcomes) for r in received), loop.time())
                    credits += sum(r.credits for r in received)
                    if credits > MAX_WORK_CREDITS:
                        raise invalid(f"credits: {credits} given and not used, more than {MAX_WORK_CREDITS}")
                    chunk = max(chunk, -(-credits // most_steps))
                    # Outcomes may free what a task waits for (a resource's slot): lease with them.
                    reported = leasing and any(r.outcomes for r in received)
                    limit = min(room(), chunk, MAX_LEASE_BATCH) if may_lease or reported else 0
                    credits -= limit
                    if limit:
                        unused_wake = ()
                    if limit and stream.waiter is None:
                        stream.waiter = self._events.lease_waiter(pools)
                    work = self._work_step(worker, caller, received, pools, limit, max_bytes, in_flight, stream.beating)
                    steps[asyncio.create_task(work)] = (stream.waiter, limit, loop.time())
                    continue
                if not steps and (not leading or (inbox.closed and not inbox.waiting)):
                    if inbox.closing:
                        await self._give_back(worker.id, stream, in_flight)
                    return
                # Until a step ends; with room for another step, also until a message arrives or
                # (credits left) work may be available.
                wakes: set[asyncio.Future[Any]] = set(steps)
                if len(steps) < most_steps:
                    wakes.add(asyncio.ensure_future(inbox.arrived()))
                    if stream.waiter is not None and room():
                        wakes.add(asyncio.ensure_future(stream.waiter.event.wait()))
                if leading:
                    wakes.add(asyncio.ensure_future(self._streams_end.wait()))
                timeout = None if look_again_at is None else max(look_again_at - loop.time(), 0)
                try:
                    await asyncio.wait(wakes, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in wakes - set(steps):
                        w.cancel()
                for step in [t for t in steps if t.done()]:
                    covered, limit, began = steps.pop(step)
                    answer, recheck_s = step.result()
                    credits += limit - len(answer.tasks)
                    if limit:
                        pace.stepped(loop.time() - began)
                    stream.leased(answer.tasks)
                    if inbox.closing:  # leased before the worker's closing was read: released, not sent
                        del answer.tasks[:]
                    # Fewer tasks than asked for: wait to be told, unless a change since the
                    # lease's query was announced (its waiter told: lease again at once).
                    told = covered is not stream.waiter or (covered is not None and covered.event.is_set())
                    if len(answer.tasks) < limit and not _cut_by_bytes(answer, max_bytes) and not told:
                        look_again_at = loop.time() + recheck_s  # or sooner, when the waiter is told
                    if answer.tasks or answer.results or answer.HasField("heartbeat"):
                        yield answer
        finally:
            self._streams.discard(stream)
            WORK_STREAMS.dec()
            for step in steps:
                step.cancel()
            reader.cancel()
            await asyncio.gather(reader, *steps, return_exceptions=True)
            if stream.waiter is not None:
                self._events.forget_leaser(stream.waiter)
                if stream.waiter.event.is_set():
                    unused_wake = stream.waiter.pools
            # A wake this stream took and will not use (its worker closed its side, or went
            # away) goes to the next waiting worker: else a task submitted meanwhile waits.
            for pool in unused_wake:
                self._events.work_available(pool, 1)

    async def _give_back(
        self, worker_id: str, stream: _WorkStream, in_flight: Callable[[], AbstractContextManager[None]]
    ) -> None:
        """Releases what a stream whose worker said it is closing was leased and did not
        report: tasks sent as (or after) it closed, which it drops. As the worker's own release
        would (PENDING again, the attempt not counted, the next waiting worker told), in one
        store call, rather than left to their lease expiry.

        Only on the worker's word (WorkRequest.closing): a stream that is cut, or whose worker
        predates it, ends its requests the same way, and its worker may still be running its
        tasks (it reports them on its next stream)."""
        if not stream.running:
            return
        outcomes = [Outcome(seq, attempt, OutcomeKind.RELEASED) for seq, attempt in sorted(stream.running)]
        try:
            with in_flight():
                results = await self._finish(worker_id, outcomes, now_us())
        except StoreUnavailable as err:  # e.g. no longer the leader: their leases expire instead
            log.warning(
                "worker %s closed its stream; %d task(s) left to expire: %s",
                worker_id,
                len(outcomes),
                err,
                extra={"worker_id": worker_id},
            )
            return
        released = sum(r.accepted for r in results)
        log.info(
            "worker %s closed its stream; released %d task(s) it was sent and did not report",
            worker_id,
            released,
            extra={"worker_id": worker_id},
        )

    async def _work_step(
        self,
        worker: WorkerRow,
        caller: Principal,
        received: list[pb.WorkRequest],
        pools: list[str],
        limit: int,
        max_bytes: int,
        in_flight: Callable[[], AbstractContextManager[None]],
        beating: asyncio.Lock,
    ) -> tuple[pb.WorkResponse, float]:
        """The answer to what a Work stream received, with up to limit tasks leased; and the
        seconds until a lease that found fewer should look again. The stream's heartbeats are
        applied one step at a time, in the order received (beating), so an older report never
        replaces a newer one."""
        answer = pb.WorkResponse()
        outcomes: list[Outcome] = []
        refused: dict[int, pb.FinishTaskResult] = {}  # by position among the outcomes received
        reported = [o for r in received for o in r.outcomes]
        for i, o in enumerate(reported):
            try:
                outcomes.append(self._outcome(f"outcomes (task {o.task_id})", o, caller))
            except ApiError as err:  # a malformed outcome is refused alone
                refused[i] = pb.FinishTaskResult(task_id=o.task_id, code=err.code.name, message=err.message)
        beats = [r.heartbeat for r in received if r.HasField("heartbeat")]
        pools = self._in_turn(worker.id, self._unpaused(pools))
        if not pools:  # a resume wakes the stream's waiter
            limit = 0
        with in_flight():
            if beats:
                tasks = [t for b in beats for t in b.tasks]
                async with beating:
                    beat = await self._beat(worker.id, tasks, [r for b in beats for r in b.reports])
                answer.heartbeat.CopyFrom(beat)
            if not outcomes and limit < 1:
                answer.results.extend(refused.values())
                return answer, float("inf")
            now = now_us()
            # The last STORE_CHUNK outcomes in the lease's transaction, any before in their own.
            # With resources or groups capped, leases go one at a time (see _lease), and this
            # one may take what the outcomes it reports free.
            split = max(len(outcomes) - STORE_CHUNK, 0)
            if self._gate.enabled:
                finished, rows, next_due = await self._gated_step(
                    worker.id, outcomes, split, pools, limit, now, max_bytes
                )
            else:
                finished = await self._finish(worker.id, outcomes[:split], now)
                results, changes, rows, next_due = await self._store.finish_and_lease(
                    worker.id, outcomes[split:], pools, limit, now, max_bytes
                )
                finished += await self._finished(outcomes[split:], results, changes)
            answer.tasks.extend(await self._leased(rows, now))
        applied = iter(finished)
        answer.results.extend(refused[i] if i in refused else next(applied) for i in range(len(reported)))
        return answer, self._recheck_in(next_due, now)

    async def _gated_step(
        self,
        worker_id: str,
        outcomes: list[Outcome],
        split: int,
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int,
    ) -> tuple[list[pb.FinishTaskResult], list[TaskRow], int | None]:
        """A Work step's finish and lease with resources or group caps: the lease may take what
        the outcomes free, and leases go one at a time from what is available to what is held.
        When the store tells what it chose before it writes (the gate then holds it), the next
        lease may begin while this one writes."""
        reserved: list[Held] = []
        handed_on = False  # the lock, once the store chose
        lock = self._resource_lease
        await lock.acquire()
        try:
            ended = [(o.seq, o.attempt) for o in outcomes]
            free, groups = self._gate.room_after(ended, worker_id, pools)
            token_due = self._token_due()

            def chosen(held: list[Held]) -> None:
                # The next lease counts what this one took, and not what the worker said ended
                # (its handlers have returned; the statement under way records them).
                nonlocal handed_on, token_due
                self._ended(ended, worker_id)
                self._gate.take(worker_id, held)
                token_due = _sooner(token_due, self._token_due())
                reserved.extend(held)
                handed_on = True
                lock.release()

            finished = await self._finish(worker_id, outcomes[:split], now)
            results, changes, rows, next_due = await self._store.finish_and_lease(
                worker_id, outcomes[split:], pools, limit, now, max_bytes, free, groups, chosen
            )
            if not handed_on:
                self._gate.take(worker_id, _held(rows))
                token_due = _sooner(token_due, self._token_due())
        except BaseException:
            self._gate.release([(h.seq, h.attempt) for h in reserved], worker_id)
            raise
        finally:
            if not handed_on:
                lock.release()
        if reserved:
            # Of the tasks chosen, those another call changed meanwhile (a cancel) hold nothing;
            # a task taken at another attempt than chosen (cancelled and retried meanwhile) holds
            # what it was taken at.
            leased, held = {(r.seq, r.attempt) for r in rows}, {(h.seq, h.attempt) for h in reserved}
            self._gate.release([a for a in held if a not in leased], worker_id)
            self._gate.take(worker_id, [h for h in _held(rows) if (h.seq, h.attempt) not in held])
        finished += await self._finished(outcomes[split:], results, changes)
        return finished, rows, _sooner(next_due, token_due)

    # -- the leader's services -----------------------------------------------

    async def expire_once(self) -> None:
        """Ends every lease past its expiry (a failed, retryable attempt). A Work stream that
        held one gets no task until its worker sends something again: a hung worker, its
        stream still open, must not be handed the task again (nor any other)."""
        changes, ended = await self._store.expire_leases(now_us())
        if ended:
            expired = set(ended)
            for stream in self._streams:
                if stream.expired(expired) and stream.waiter is not None:
                    self._events.forget_leaser(stream.waiter)  # the wake goes to another worker
                    stream.waiter = None
        self._ended(ended)
        for seq, attempt in ended[:LOGGED_EXPIRIES]:
            task_id = make_task_id(self._shard, seq)
            log.info(
                "task %d: the lease of attempt %d expired (its worker went silent)",
                task_id,
                attempt,
                extra={"task_id": str(task_id), "attempt": attempt},
            )
        if changes:
            log.info("expired %d lease(s)", len(changes))
            await self._events.publish(changes)

    async def purge_once(self) -> None:
        """Deletes the ended tasks past their pool's retention, PURGE_BATCH at a time (each its
        own short transaction), pausing between batches so that other calls seldom meet one."""
        purged, started = 0, time.monotonic()
        while True:
            batch_started = time.monotonic()
            n = await self._store.purge(now_us(), PURGE_BATCH)
            purged += n
            TASKS_PURGED.inc(n)
            if n < PURGE_BATCH:
                break
            await asyncio.sleep(purge_pause(time.monotonic() - batch_started, batch_started - started))
        if purged:
            log.info("purged %d task(s) past retention in %.1fs", purged, time.monotonic() - started)

    async def start_by_once(self) -> None:
        """Ends EXPIRED the tasks no attempt started by their start_by, EXPIRE_BATCH at a time (a
        lease never hands one out meanwhile)."""
        while True:
            changes = await self._store.expire_unstarted(now_us(), EXPIRE_BATCH)
            if not changes:
                return
            expired = sum(1 for _, state in changes if state == State.EXPIRED)
            log.info("%d task(s) not started by their start_by ended EXPIRED", expired)
            await self._events.publish(changes)
            if expired < EXPIRE_BATCH:
                return

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


class _Pace:
    """How many tasks a Work stream's worker may be sent: its free slots, and beyond them what it
    starts within HOLD_STEPS of its steps (measured on this stream: its tasks reported a second
    and the time of its steps that lease). A new stream, or one whose handlers are slow, holds
    nothing beyond its slots; one without slots (0: a worker predating them) is sent every credit."""

    __slots__ = ("_count", "_last_rate", "_since", "slots", "step_s")

    def __init__(self, slots: int, now: float):
        self.slots = slots
        self.step_s = 0.0
        self._since = now  # the window counting the tasks reported
        self._count = 0
        self._last_rate = 0.0  # the last window's tasks reported a second

    def reported(self, count: int, now: float) -> None:
        self._count += count
        if now - self._since >= PACE_WINDOW_S:
            self._last_rate = self._count / (now - self._since)
            self._since, self._count = now, 0

    def stepped(self, seconds: float) -> None:
        self.step_s = seconds if not self.step_s else self.step_s + STEP_SMOOTHING * (seconds - self.step_s)

    def rate(self, now: float) -> float:
        """Tasks reported a second: the last window's, or less when none came for longer."""
        elapsed = now - self._since
        if elapsed < PACE_WINDOW_S:
            return self._last_rate
        return min(self._last_rate, self._count / elapsed)

    def room(self, credits: int, outstanding: int, now: float) -> int:
        """Of credits, what may be sent to a worker with outstanding tasks sent and not reported."""
        if not self.slots:
            return credits
        held = int(self.rate(now) * self.step_s * HOLD_STEPS)
        return max(0, min(credits, self.slots + held - outstanding))


class _WorkStream:
    """What the leader's lease expiry needs to know of a Work stream: the attempts it sent and
    has not heard of since, and whether its worker has gone silent (a lease of it expired)."""

    __slots__ = ("beating", "running", "silent", "waiter")

    def __init__(self) -> None:
        self.running: set[tuple[int, int]] = set()  # (seq, attempt)
        self.silent = False
        self.waiter: LeaseWaiter | None = None  # registered before a lease, so no change is missed
        self.beating = asyncio.Lock()  # held by the step applying a heartbeat (see _work_step)

    def leased(self, tasks: Sequence[Task]) -> None:
        self.running.update((seq_of(t.id), t.attempt) for t in tasks)

    def heard(self, received: list[pb.WorkRequest]) -> None:
        """The worker sent these: it is not silent, and the attempts it reported are over."""
        if received:
            self.silent = False
        for r in received:
            for o in r.outcomes:
                self.running.discard((seq_of(o.task_id), o.attempt))

    def expired(self, attempts: set[tuple[int, int]]) -> bool:
        """Some of these expired leases were this stream's: its worker is silent from now on."""
        mine = self.running & attempts
        if mine:
            self.running -= mine
            self.silent = True
        return bool(mine)


def dependency_bytes(row: TaskRow) -> int:
    return sum(len(d.result or b"") for d in row.dependency_results or ())


def _largest_dependencies(row: TaskRow, shard_number: int) -> str:
    largest = sorted(row.dependency_results or (), key=lambda d: -len(d.result or b""))[:10]
    return ", ".join(f"task {make_task_id(shard_number, d.seq)}: {len(d.result or b'')} bytes" for d in largest)


def _sooner(a: int | None, b: int | None) -> int | None:
    """The earlier of two times, either None (never)."""
    return b if a is None else a if b is None else min(a, b)


def _held(rows: list[TaskRow]) -> list[Held]:
    """What the leased tasks hold while they run (ResourceGate)."""
    return [Held(r.seq, r.attempt, r.resources or {}, r.pool, r.group_key) for r in rows]


def _cut_by_bytes(answer: pb.WorkResponse, max_bytes: int) -> bool:
    """Whether the tasks leased may have been fewer than asked for because of max_bytes."""
    return sum(len(t.payload) for t in answer.tasks) >= max_bytes // 2


def _check_counts(req: pb.WorkRequest) -> None:
    """A message of a Work stream carries no more than the unary calls may."""
    check_count("outcomes", len(req.outcomes), MAX_OUTCOMES, "outcomes")
    check_count("heartbeat.tasks", len(req.heartbeat.tasks), MAX_HEARTBEAT_TASKS, "attempts")
    check_reports("heartbeat.reports", req.heartbeat.reports)


def check_reports(field: str, reports: Sequence[pb.TaskReport]) -> None:
    """A heartbeat's reports: as many as its attempts may be, each as check_report."""
    check_count(field, len(reports), MAX_HEARTBEAT_TASKS, "reports")
    for r in reports:
        check_report(f"{field} (task {r.task_id})", r)


def check_report(field: str, r: pb.TaskReport) -> None:
    """A handler's report: a finite progress with a short message, a bounded checkpoint;
    INVALID_ARGUMENT naming the field and value else."""
    if r.HasField("progress"):
        if not math.isfinite(r.progress.value):
            raise invalid(f"{field}.progress.value: {r.progress.value}, not a finite number")
        check_text(f"{field}.progress.message", r.progress.message, MAX_PROGRESS_MESSAGE_BYTES, in_bytes=True)
    if len(r.checkpoint) > MAX_CHECKPOINT_BYTES:
        raise invalid(f"{field}.checkpoint: {len(r.checkpoint)} bytes, more than {MAX_CHECKPOINT_BYTES}")


def _entries(req: pb.WorkRequest) -> int:
    """What answering a Work stream's message takes, in entries (see WORK_STEP_ENTRIES)."""
    return 1 + len(req.outcomes) + len(req.heartbeat.tasks) + len(req.heartbeat.reports)


class _WorkInbox:
    """What a Work stream received and not yet answered, read by a task of its own."""

    def __init__(self, worker_id: str, first: pb.WorkRequest):
        self._worker_id = worker_id
        self._received = [first]
        self._backlog = _entries(first)  # of the requests received
        self._room = asyncio.Event()  # set when requests are taken
        self._arrived = asyncio.Event()
        self._arrived.set()
        self.closed = False  # the worker closed its side, or the stream failed
        # The worker said it is stopping (WorkRequest.closing): what it is sent from now on it drops.
        self.closing = first.closing
        self.error: ApiError | None = None  # a request that ends the stream

    async def read(self, requests: AsyncIterator[pb.WorkRequest]) -> None:
        try:
            async for req in requests:
                if req.worker_id and req.worker_id != self._worker_id:
                    raise invalid(f"worker_id: {req.worker_id!r} sent on the Work stream of {self._worker_id!r}")
                if req.pools or req.max_bytes or req.slots:
                    raise invalid("pools, max_bytes, slots: given in the first message of a Work stream only")
                _check_counts(req)
                self._received.append(req)
                self._backlog += _entries(req)
                self.closing = self.closing or req.closing
                self._arrived.set()
                while self._backlog > WORK_BACKLOG:
                    self._room.clear()
                    await self._room.wait()
        except ApiError as err:
            self.error = err
        finally:
            self.closed = True
            self._arrived.set()

    @property
    def waiting(self) -> bool:
        """Something to answer: requests received, or one that ends the stream."""
        return bool(self._received) or self.error is not None

    def take(self) -> list[pb.WorkRequest]:
        """The oldest requests received, as many as one step answers (WORK_STEP_ENTRIES)."""
        count, entries = 0, 0
        for req in self._received:
            entries += _entries(req)
            if count and entries > WORK_STEP_ENTRIES:
                break
            count += 1
        taken, self._received = self._received[:count], self._received[count:]
        self._backlog -= sum(_entries(r) for r in taken)
        self._room.set()
        if not self._received:
            self._arrived.clear()
        return taken

    async def arrived(self) -> None:
        """Until a request arrives or the worker closes its side."""
        await self._arrived.wait()
