"""TaskService: submit (with keys, dependencies and batches), get, wait, cancel, retry, delete,
list, watch."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections import Counter
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as pb

from ..auth import Principal
from ..config import Config, PoolConfig
from ..errors import failed_precondition, invalid, not_found
from ..ids import MAX_ID, make_task_id, seq_of, shard_of
from ..metrics import TASK_RETRIES
from ..store.base import (
    KEY_DEBOUNCE,
    KEY_RETURN_EXISTING,
    TERMINAL,
    AttemptOutcome,
    AttemptRow,
    NewTask,
    ScanTimedOut,
    State,
    Store,
    Submitted,
    TaskFilter,
    TaskRow,
    Trace,
)
from ..store.logic import ENDED_UNSUCCESSFULLY, scans_far
from .convert import to_attempt, to_task
from .events import EventBus, Watcher, parse_cursor
from .limits import (
    KEY_RANGES,
    MAX_CONTENT_TYPE,
    MAX_DEBOUNCE_MS,
    MAX_GROUP_KEY_BYTES,
    MAX_KEY_LENGTH,
    MAX_REQUEST_ID,
    MAX_TIMEOUT_MS,
    MAX_TRACESTATE_BYTES,
    RETRY_EXTRA_ATTEMPTS,
    SCHEDULE_KEY_PREFIX,
    TASK_RANGES,
    Range,
    check_range,
    check_text,
)
from .scans import ScanCalls

# google.protobuf.Timestamp's range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999999Z.
MIN_TIMESTAMP_S = -62_135_596_800
MAX_TIMESTAMP_S = 253_402_300_799

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
MAX_CHILDREN = 1000  # GetTaskResponse.children at most (ListTasks' filter.parent_id pages through all)
RUN_WHEN_VALUES = frozenset(task_pb2.RunWhen.values())
KEY_MODES = {"return_existing": 1, "replace_pending": 2, "debounce": 3}  # a pool's default_key_mode
KEY_MODE_VALUES = frozenset(task_pb2.KeyMode.values())
DEFAULT_WAIT_MS = 30_000
MAX_WAIT_MS = 3_600_000
MAX_DEPENDENTS = 100  # listed by GetTask with include_dependents


class TaskTemplate(Protocol):
    """The fields a SubmitTaskRequest and a Schedule share: what each task carries."""

    @property
    def payload(self) -> bytes: ...
    @property
    def content_type(self) -> str: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def resources(self) -> Mapping[str, int]: ...
    @property
    def timeout_ms(self) -> int: ...
    @property
    def group_key(self) -> str: ...
    @property
    def trace(self) -> task_pb2.TraceContext: ...


def now_us() -> int:
    return time.time_ns() // 1000


# W3C trace context: version, trace id, parent id, flags (lowercase hex).
TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def check_trace(field: str, t: task_pb2.TraceContext, where: str = "") -> None:
    """A trace context given with a task: unset, or a W3C traceparent (version 00's form; not
    version ff, not all-zero ids) with a tracestate of at most MAX_TRACESTATE_BYTES (a refusal
    names `where` + field)."""
    if not t.traceparent:
        return
    field = where + field
    version, trace_id, parent_id, _ = t.traceparent.split("-") if TRACEPARENT.fullmatch(t.traceparent) else [""] * 4
    if not version or version == "ff" or trace_id == "0" * 32 or parent_id == "0" * 16:
        shown = t.traceparent[:80]
        raise invalid(f"{field}.traceparent: {shown!r} is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)")
    check_text(f"{field}.tracestate", t.tracestate, MAX_TRACESTATE_BYTES, in_bytes=True)


def trace_of(req: TaskTemplate, link: bool = False) -> Trace | None:
    """The trace context a submission or a schedule carries (checked), None when unset."""
    t = req.trace
    return Trace(t.traceparent, t.tracestate, link) if t.traceparent else None


def wait_ms(asked_ms: int) -> int:
    """How long a WaitTask asking `asked_ms` waits (0: the default)."""
    return min(asked_ms or DEFAULT_WAIT_MS, MAX_WAIT_MS)


def _timeout_ms(asked_ms: int, pool_timeout_s: float | None) -> int:
    """A task's timeout: what it asks, capped by its pool's; the pool's when it asks none (0: none).
    At most MAX_TIMEOUT_MS, also for a schedule stored before that bound."""
    pool_ms = int(pool_timeout_s * 1000) if pool_timeout_s is not None else 0
    if asked_ms and pool_ms:
        return min(asked_ms, pool_ms, MAX_TIMEOUT_MS)
    return min(asked_ms or pool_ms, MAX_TIMEOUT_MS)


# A keyed resource's key ("name:key" in a task's resources), in UTF-8 bytes.
MAX_RESOURCE_KEY_BYTES = 128


class Tasks:
    def __init__(
        self, config: Config, store: Store, events: EventBus, shard_name: str, shard_number: int, pools: list[str]
    ):
        self._config = config
        self._store = store
        self._events = events
        self._shard_name = shard_name
        self._shard = shard_number
        self._pools = {p: config.pool(p) for p in pools}
        self._resources = {r.name: r for r in config.resources if r.shard in (None, shard_name)}
        self.scans = ScanCalls(config.limits, shard_name)  # filtered listings and bulk actions

    def _task(self, row: TaskRow) -> task_pb2.Task:
        return to_task(row, self._shard)

    # -- submit ---------------------------------------------------------------

    def _validate(self, req: pb.SubmitTaskRequest, where: str, caller: Principal) -> NewTask:
        if not req.pool:
            raise invalid(f"{where}pool: required")
        caller.require("submit", req.pool)
        pool = self._pools.get(req.pool)
        if pool is None:
            raise invalid(f"{where}pool: unknown pool {req.pool!r}")
        check_text("key", req.key, MAX_KEY_LENGTH, where=where)
        if req.key.startswith(SCHEDULE_KEY_PREFIX):
            raise invalid(
                f"{where}key: {req.key!r}: keys starting with {SCHEDULE_KEY_PREFIX!r} are reserved for schedules"
            )
        self.check_template(req, where)
        task = NewTask(
            pool=req.pool,
            key=req.key or None,
            payload=req.payload,
            content_type=req.content_type,
            priority=req.priority,
            run_at=timestamp_us(f"{where}run_at", req.run_at) if req.HasField("run_at") else None,
            max_attempts=req.max_attempts or pool.max_attempts,
            resources=dict(req.resources) if req.resources else {},
            timeout_ms=_timeout_ms(req.timeout_ms, pool.timeout),
            group_key=req.group_key,
            trace=trace_of(req),
            run_when=req.run_when,
            start_by=timestamp_us(f"{where}start_by", req.start_by) if req.HasField("start_by") else None,
        )
        if req.run_when not in RUN_WHEN_VALUES:
            raise invalid(f"{where}run_when: unknown value {req.run_when}")
        if task.start_by is not None and task.run_at is not None and task.start_by <= task.run_at:
            raise invalid(
                f"{where}start_by: {req.start_by.ToJsonString()} is not after run_at {req.run_at.ToJsonString()}"
            )
        self._key_options(req, where, pool, task)
        for i, ref in enumerate(req.depends_on):
            kind = ref.WhichOneof("ref")
            if kind == "id":
                if ref.id == 0:
                    raise invalid(f"{where}depends_on[{i}].id: 0 is not a task id")
                if shard_of(ref.id) != self._shard:
                    raise invalid(
                        f"{where}depends_on[{i}]: task {ref.id} belongs to shard number {shard_of(ref.id)}; "
                        f"a task can only depend on tasks of its own shard ({self._shard})"
                    )
                task.dep_seqs.append(seq_of(ref.id))
            elif kind == "key":
                check_text(f"{where}depends_on[{i}].key", ref.key, MAX_KEY_LENGTH)
                task.dep_keys.append(ref.key)
            else:
                raise invalid(f"{where}depends_on[{i}]: give an id or a key")
        return task

    def _key_options(self, req: pb.SubmitTaskRequest, where: str, pool: PoolConfig, task: NewTask) -> None:
        """Sets what the task's key does when it names a task (key_mode; not given: the pool's
        default_key_mode), refusing the options that need a key, or a mode, they lack."""
        _check_ranges(req, where, KEY_RANGES)
        if req.key_mode not in KEY_MODE_VALUES:
            raise invalid(f"{where}key_mode: unknown value {req.key_mode}")
        if not req.key:
            asked = {"key_mode": req.key_mode > KEY_RETURN_EXISTING, "key_ttl_ms": req.key_ttl_ms}
            asked |= {"debounce_ms": req.debounce_ms, "max_debounce_ms": req.max_debounce_ms}
            for field, value in asked.items():
                if value:
                    raise invalid(f"{where}key: required with {field} {_key_option(req, field)}")
            return
        mode = req.key_mode or KEY_MODES[pool.default_key_mode]
        if mode != KEY_DEBOUNCE:
            for field in ("debounce_ms", "max_debounce_ms"):
                if value := getattr(req, field):
                    named = task_pb2.KeyMode.Name(mode)  # type: ignore[arg-type]
                    raise invalid(f"{where}{field}: {value} applies only with KEY_MODE_DEBOUNCE, not {named}")
        else:
            debounce_ms = req.debounce_ms or _ms(pool.debounce)
            max_debounce_ms = req.max_debounce_ms or (0 if req.debounce_ms else _ms(pool.max_debounce))
            if not debounce_ms:
                raise invalid(f"{where}debounce_ms: required with KEY_MODE_DEBOUNCE (1 to {MAX_DEBOUNCE_MS})")
            if max_debounce_ms and max_debounce_ms < debounce_ms:
                raise invalid(f"{where}max_debounce_ms: {max_debounce_ms} is less than debounce_ms {debounce_ms}")
            if req.HasField("run_at"):
                raise invalid(f"{where}run_at: not with KEY_MODE_DEBOUNCE (debounce_ms says when it runs)")
            task.debounce_us, task.max_debounce_us = debounce_ms * 1000, max_debounce_ms * 1000
        task.key_mode = mode
        task.key_ttl_ms = req.key_ttl_ms

    def check_template(self, req: TaskTemplate, where: str) -> None:
        """What a task carries beyond its pool, key, run_at and dependencies, checked alike for a
        submission and for a schedule's template (each field named with `where` before it)."""
        check_text("content_type", req.content_type, MAX_CONTENT_TYPE, where=where)
        check_text("group_key", req.group_key, MAX_GROUP_KEY_BYTES, in_bytes=True, where=where)
        check_trace("trace", req.trace, where=where)
        limit = self._config.limits.max_payload_bytes
        if len(req.payload) > limit:
            raise invalid(f"{where}payload: {len(req.payload)} bytes exceeds limits.max_payload_bytes {limit}")
        _check_ranges(req, where, TASK_RANGES)
        for name, amount in req.resources.items():
            base, colon, key = name.partition(":")
            res = self._resources.get(base)
            if res is None:
                raise invalid(f"{where}resources: unknown resource {base!r} in shard {self._shard_name!r}")
            if res.per_key and not key:
                raise invalid(f"{where}resources: {name!r}: resource {base!r} is per key: name it as '{base}:<key>'")
            if colon and not res.per_key:
                raise invalid(f"{where}resources: {name!r}: resource {base!r} is not per key: name it alone")
            if key:
                check_text(f"{where}resources[{base!r}] key", key, MAX_RESOURCE_KEY_BYTES, in_bytes=True)
            # A rate resource's capacity is its burst: a task needing more tokens could never start.
            capacity = res.concurrency if res.concurrency is not None else (res.burst or 1)
            if not 1 <= amount <= capacity:
                raise invalid(
                    f"{where}resources[{name!r}]: amount {amount} is not between 1 and its capacity {capacity}"
                )

    def pool_defaults(self, pool: str, max_attempts: int, timeout_ms: int) -> tuple[int, int]:
        """A task's max_attempts and timeout_ms as stored: what it asks (0: the pool's), the timeout
        capped by the pool's."""
        config = self._pools[pool]
        assert config is not None, f"pool {pool!r} is not configured"
        return max_attempts or config.max_attempts, _timeout_ms(timeout_ms, config.timeout)

    def _request_id(self, request_id: str, caller: Principal) -> str | None:
        """The stored form of a request_id: scoped to the caller, so one cannot replay another's."""
        if not request_id:
            return None
        check_text("request_id", request_id, MAX_REQUEST_ID)
        return f"{len(caller.identity)}:{caller.identity}:{request_id}"

    def _visible(self, caller: Principal) -> frozenset[str] | None:
        """The pools whose tasks the caller may name as dependencies (None: every pool)."""
        return self._pools_where(caller, "read")

    def _pools_where(self, caller: Principal, permission: str) -> frozenset[str] | None:
        """The pools where the caller holds the permission (None: every pool)."""
        if caller.pools is None and permission in caller.permissions:
            return None
        return frozenset(p for p in self._pools if caller.may(permission, p))

    def _submitted(self, sub: Submitted, caller: Principal) -> task_pb2.Task:
        """A deduplicated submission shows the existing task whole only to a caller who may read it."""
        if (sub.deduplicated or sub.replaced) and not caller.may("read", sub.row.pool):
            return task_pb2.Task(id=make_task_id(self._shard, sub.row.seq), pool=sub.row.pool, key=sub.row.key or "")
        return self._task(sub.row)

    async def submit_task(self, req: pb.SubmitTaskRequest, caller: Principal) -> pb.SubmitTaskResponse:
        task = self._validate(req, "", caller)
        if task.key is not None and task.key in task.dep_keys:
            raise invalid(f"depends_on: task depends on its own key {task.key!r}")
        subs, changes = await self._store.submit(
            [task], now_us(), self._request_id(req.request_id, caller), self._visible(caller)
        )
        _check_replay(req.request_id, subs, 1)
        sub = subs[0]
        await self._events.publish(changes, [sub.row])
        return pb.SubmitTaskResponse(
            task=self._submitted(sub, caller), deduplicated=sub.deduplicated, replaced=sub.replaced
        )

    def _batch(
        self, reqs: Sequence[pb.SubmitTaskRequest], field: str, caller: Principal
    ) -> tuple[list[NewTask], dict[int, int]]:
        """A batch validated, in an order where each task follows the batch tasks it depends on,
        and each one's position in that order."""
        n = len(reqs)
        if n > self._config.limits.max_batch_size:
            raise invalid(f"{field}: batch of {n} exceeds limits.max_batch_size {self._config.limits.max_batch_size}")
        tasks = [self._validate(r, f"{field}[{i}].", caller) for i, r in enumerate(reqs)]
        order = _batch_order(tasks)
        position = {original: pos for pos, original in enumerate(order)}
        ordered = [tasks[i] for i in order]
        key_index = {t.key: i for i, t in enumerate(tasks) if t.key is not None}
        for t in ordered:
            # Keys of the batch's own tasks become batch references; the rest are stored keys.
            t.dep_batch = [position[key_index[k]] for k in t.dep_keys if k in key_index]
            t.dep_keys = [k for k in t.dep_keys if k not in key_index]
        return ordered, position

    def spawned(
        self, reqs: Sequence[pb.SubmitTaskRequest], caller: Principal
    ) -> tuple[list[NewTask], frozenset[str] | None]:
        """A success's TaskSuccess.spawn as the store creates it, with the pools its dependencies
        may name; raises ApiError (the attempt fails with it) when it cannot be: each task must
        be of this shard, and the worker's principal may submit to its pool."""
        for i, req in enumerate(reqs):
            if req.pool and req.pool not in self._pools:
                owner = next((s.name for s in self._config.shards if req.pool in s.pools), None)
                raise failed_precondition(
                    f"spawn[{i}].pool: pool {req.pool!r} is "
                    + (f"served by shard {owner!r}" if owner else "not a pool of any shard")
                    + f", not by this task's shard {self._shard_name!r}; a handler spawns tasks in its own shard"
                )
        return self._batch(reqs, "spawn", caller)[0], self._visible(caller)

    async def submit_batch(self, req: pb.SubmitBatchRequest, caller: Principal) -> pb.SubmitBatchResponse:
        n = len(req.tasks)
        if n == 0:
            raise invalid("tasks: a batch needs at least one task")
        ordered, position = self._batch(req.tasks, "tasks", caller)
        request_id = self._request_id(req.request_id, caller)
        subs, changes = await self._store.submit(ordered, now_us(), request_id, self._visible(caller))
        await self._events.publish(changes, [s.row for s in subs if not s.deduplicated])
        _check_replay(req.request_id, subs, n)
        by_original = [subs[position[i]] for i in range(n)]
        return pb.SubmitBatchResponse(
            tasks=[self._submitted(s, caller) for s in by_original],
            deduplicated_ids=[make_task_id(self._shard, s.row.seq) for s in by_original if s.deduplicated],
            replaced_ids=[make_task_id(self._shard, s.row.seq) for s in by_original if s.replaced],
        )

    # -- lookups --------------------------------------------------------------

    async def find(self, ref: task_pb2.TaskRef, caller: Principal, permission: str) -> TaskRow:
        """The task a ref names. One the caller may not read is, to that caller, a missing task."""
        kind = ref.WhichOneof("ref")
        if kind == "id":
            if ref.id == 0:
                raise invalid("task.id: 0 is not a task id")
            row = await self._store.get(seq_of(ref.id)) if shard_of(ref.id) == self._shard else None
            if row is None or not caller.may("read", row.pool):
                raise not_found(f"task {ref.id} not found")
        elif kind == "key":
            check_text("task.key", ref.key, MAX_KEY_LENGTH)
            row = await self._store.get_by_key(ref.key)
            if row is None or not caller.may("read", row.pool):
                raise not_found(f"no task with key {ref.key!r}")
        else:
            raise invalid("task: give an id or a key")
        caller.require(permission, row.pool)
        return row

    async def get_task(self, req: pb.GetTaskRequest, caller: Principal) -> pb.GetTaskResponse:
        row = await self.find(req.task, caller, "read")
        if req.include_dependency_results:
            await self.fill_dependency_results([row])
        response = pb.GetTaskResponse(task=self._task(row))
        if req.include_children:
            match = TaskFilter(states=frozenset(State), pools=self.readable_pools("", caller), parent_seq=row.seq)
            children = await self._store.list_matching(match, 0, MAX_CHILDREN)
            for child in children:
                child.payload, child.result, child.checkpoint = b"", None, None
            response.children.extend(self._task(c) for c in children)
        if req.include_dependents:
            found = await self._store.dependents(row.seq, MAX_DEPENDENTS * 10)
            readable = [make_task_id(self._shard, s) for s, pool in found if caller.may("read", pool)]
            response.dependents.extend(readable[:MAX_DEPENDENTS])
        if req.include_attempts:
            response.attempts.extend(await self._attempts(row))
        return response

    async def fill_dependency_results(self, rows: list[TaskRow]) -> None:
        """Sets each task's dependency_results, in depends_on order (one store read for all;
        nothing for tasks without dependencies)."""
        wanted = list({seq for r in rows for seq in r.depends_on})
        if not wanted:
            return
        found = await self._store.dependency_rows(wanted)
        for r in rows:
            if r.depends_on:
                r.dependency_results = [found[seq] for seq in r.depends_on if seq in found]

    async def _attempts(self, row: TaskRow) -> list[task_pb2.Attempt]:
        """The task's attempts, oldest first, and the one running now last; each named by the
        worker's registered name while the shard still knows that worker."""
        attempts = await self._store.attempts(row.seq)
        if row.state == State.RUNNING:
            attempts.append(
                AttemptRow(row.seq, row.attempt, row.worker_id, row.started_at, None, AttemptOutcome.RUNNING, "")
            )
        names: dict[str, str] = {}
        for worker_id in {a.worker_id for a in attempts if a.worker_id}:
            worker = await self._store.get_worker(worker_id)
            if worker is not None:
                names[worker_id] = worker.name
        now = now_us()
        return [to_attempt(a, names.get(a.worker_id or "", ""), now) for a in attempts]

    async def wait_task(self, req: pb.WaitTaskRequest, caller: Principal) -> pb.WaitTaskResponse:
        timeout_ms = wait_ms(req.timeout_ms)
        row = await self.find(req.task, caller, "read")
        if row.state not in TERMINAL:
            fut = self._events.wait_terminal(row.seq)
            try:
                row = await self._store.get(row.seq) or row  # it may have ended before we listened
                if row.state not in TERMINAL:
                    try:
                        await asyncio.wait_for(asyncio.shield(fut), timeout_ms / 1000)
                    except TimeoutError:
                        pass
                    row = await self._store.get(row.seq) or row
            finally:
                self._events.forget_waiter(row.seq, fut)
        return pb.WaitTaskResponse(task=self._task(row), done=row.state in TERMINAL)

    async def cancel_task(self, req: pb.CancelTaskRequest, caller: Principal) -> pb.CancelTaskResponse:
        row = await self.find(req.task, caller, "cancel")
        descendants = 0
        if req.include_descendants:
            cancellable = self._pools_where(caller, "cancel")
            updated, descendants, changes = await self._store.cancel_workflow(row.seq, now_us(), cancellable)
        else:
            updated, changes = await self._store.cancel(row.seq, now_us())
        if updated is None:
            raise not_found(f"task {make_task_id(self._shard, row.seq)} not found")
        await self._events.publish(changes)
        return pb.CancelTaskResponse(task=self._task(updated), descendants_cancelled=descendants)

    async def retry_task(self, req: pb.RetryTaskRequest, caller: Principal) -> pb.RetryTaskResponse:
        run_at = timestamp_us("run_at", req.run_at) if req.HasField("run_at") else None
        check_range("extra_attempts", req.extra_attempts, RETRY_EXTRA_ATTEMPTS)
        row = await self.find(req.task, caller, "submit")
        rows, restored = (
            await self.retry_seqs([row.seq], run_at, req.extra_attempts, caller) if _retryable(row) else ([], 0)
        )
        if not rows:
            await self._not_retried(row)
        return pb.RetryTaskResponse(task=self._task(rows[0]), dependents_restored=restored)

    async def retry_seqs(
        self, seqs: list[int], run_at: int | None, extra_attempts: int, caller: Principal
    ) -> tuple[list[TaskRow], int]:
        """Retries the FAILED and CANCELLED tasks among these (one transaction; see
        Store.retry_tasks), tells whoever waits, and counts them; (rows retried, dependents
        restored). The dependents brought back are those the caller could retry itself (it may
        submit to their pool); the others stay ended. For callers that checked the request and
        the caller's permissions on the tasks among seqs."""
        restorable = self._pools_where(caller, "submit")
        rows, restored, changes = await self._store.retry_tasks(seqs, now_us(), run_at, extra_attempts, restorable)
        await self._events.publish(changes, rows)
        for pool, count in Counter(r.pool for r in rows).items():
            TASK_RETRIES.labels(pool=pool, reason="manual").inc(count)
        return rows, restored

    async def _not_retried(self, row: TaskRow) -> None:
        """Raises why a task was not retried: its state (now), or a dependency still ended."""
        task_id = make_task_id(self._shard, row.seq)
        now = await self._store.get(row.seq)
        if now is None:
            raise not_found(f"task {task_id} not found")
        if not _retryable(now):
            raise failed_precondition(
                f"task {task_id} is {now.state.name}; only a FAILED or CANCELLED task can be retried"
            )
        deps = [d for d in await self._store.get_many(now.depends_on) if d.state in ENDED_UNSUCCESSFULLY]
        dep = min(deps, key=lambda d: d.seq)
        raise failed_precondition(
            f"task {task_id} depends on task {make_task_id(self._shard, dep.seq)}, which is {dep.state.name}: "
            "retry that one (the tasks it ended wait for it again)"
        )

    async def delete_task(self, req: pb.DeleteTaskRequest, caller: Principal) -> pb.DeleteTaskResponse:
        row = await self.find(req.task, caller, "admin")
        task_id = make_task_id(self._shard, row.seq)
        if row.state in TERMINAL and await self.delete_seqs([row.seq]):
            return pb.DeleteTaskResponse(id=task_id)
        now = await self._store.get(row.seq)
        if now is None:
            raise not_found(f"task {task_id} not found")
        raise failed_precondition(
            f"task {task_id} is {now.state.name}; only an ended task (SUCCEEDED, FAILED or CANCELLED) can be "
            "deleted: cancel it first"
        )

    async def delete_seqs(self, seqs: list[int]) -> list[int]:
        """Deletes the ended tasks among these (one transaction; see Store.delete_tasks); the seqs
        deleted. For callers that checked permissions."""
        return await self._store.delete_tasks(seqs)

    def readable_pools(self, pool: str, caller: Principal) -> list[str] | None:
        if pool:
            caller.require("read", pool)
            if pool not in self._pools:
                raise invalid(f"pool: unknown pool {pool!r}")
            return [pool]
        if caller.pools is None and "read" in caller.permissions:
            return None
        return [p for p in self._pools if caller.may("read", p)]

    async def list_tasks(self, req: pb.ListTasksRequest, caller: Principal) -> pb.ListTasksResponse:
        from .bulk import LIST, store_filter  # bulk imports this module

        wanted = pb.TaskFilter()
        wanted.CopyFrom(req.filter)
        if req.pool:
            if wanted.pool and wanted.pool != req.pool:
                raise invalid(f"pool: {req.pool!r} and filter.pool {wanted.pool!r} differ; give one of them")
            self.readable_pools(req.pool, caller)  # refused here, under the field's own name
            wanted.pool = req.pool
        if req.state:
            if wanted.states:
                raise invalid("state: give state or filter.states, not both")
            if req.state not in State.__members__.values():
                raise invalid(f"state: unknown state {req.state}")
            wanted.states.append(req.state)
        match = store_filter(wanted, LIST, caller, list(self._pools), self._shard)
        size = page_size(req.page_size)
        after = self._page_after(req.page_token) if req.page_token else 0
        if req.key:
            check_text("key", req.key, MAX_KEY_LENGTH)
            row = await self._store.get_by_key(req.key)
            if row is None or match is None or (match.seqs is not None and row.seq not in match.seqs):
                match = None
            else:  # the keyed task, if the rest of the filter matches it
                match = dataclasses.replace(match, seqs=[row.seq])
        rows = [] if match is None else await self._list_matching(match, after, size + 1, req.newest_first, caller)
        more = len(rows) > size
        rows = rows[:size]
        token = str(make_task_id(self._shard, rows[-1].seq)) if more else ""
        return pb.ListTasksResponse(tasks=[self._task(r) for r in rows], next_page_token=token)

    async def _list_matching(
        self, match: TaskFilter, after: int, limit: int, newest_first: bool, caller: Principal
    ) -> list[TaskRow]:
        """A listing by a filter no index serves is one of the caller's scanning calls, read
        where bulk actions' scans are, and stopped past limits.bulk_scan_timeout."""
        if not scans_far(match):
            return await self._store.list_matching(match, after, limit, newest_first)
        with self.scans.admitted(caller):
            try:
                return await self._store.list_matching(match, after, limit, newest_first)
            except ScanTimedOut:
                raise self.scans.timed_out("nothing listed") from None

    def _page_after(self, token: str) -> int:
        """The sequence a page token continues after; a token this shard did not issue is refused."""
        after = page_token_id(token)
        if shard_of(after) != self._shard:
            raise invalid(f"page_token: {_shown(token)!r} was issued by another shard (number {shard_of(after)})")
        return seq_of(after)

    async def watch(
        self, req: pb.WatchRequest, caller: Principal
    ) -> tuple[int, AsyncGenerator[pb.WatchResponse, None]]:
        """Checks the request (and that its cursor can be resumed) now; returns the event seq the
        stream starts after (the cursor's, or the last event's when live) and the iterator of
        its events."""
        pools = self.readable_pools(req.pool, caller)
        after = parse_cursor(req.cursor, self._shard) if req.cursor else None
        watcher = await self._events.open_watch(
            None if pools is None else frozenset(pools), req.include_payloads, after, req.cursor
        )
        return watcher.pos, self._stream(watcher)

    async def _stream(self, watcher: Watcher) -> AsyncGenerator[pb.WatchResponse, None]:
        """Events until the stream ends; one ended with an error (ABORTED when it fell behind)
        raises that ApiError last."""
        events = self._events.stream(watcher)
        try:
            async for event in events:
                yield pb.WatchResponse(event=event)
        finally:
            await events.aclose()


def _ms(seconds: float | None) -> int:
    """A configured duration in ms (None: 0)."""
    return round(seconds * 1000) if seconds else 0


def _key_option(req: pb.SubmitTaskRequest, field: str) -> str:
    """A key option's value as a refusal shows it."""
    return task_pb2.KeyMode.Name(req.key_mode) if field == "key_mode" else str(getattr(req, field))


def timestamp_us(field: str, ts: Timestamp) -> int:
    """A Timestamp in µs; INVALID_ARGUMENT naming field outside the Timestamp range."""
    if not (MIN_TIMESTAMP_S <= ts.seconds <= MAX_TIMESTAMP_S and 0 <= ts.nanos < 1_000_000_000):
        raise invalid(
            f"{field}: seconds {ts.seconds}, nanos {ts.nanos} is outside the Timestamp range (0001-01-01 to 9999-12-31)"
        )
    return ts.ToMicroseconds()


def _retryable(row: TaskRow) -> bool:
    return row.state in ENDED_UNSUCCESSFULLY


def page_size(requested: int) -> int:
    """A ListTasks page's size: the default for 0, at most MAX_PAGE_SIZE."""
    if requested < 0:
        raise invalid(f"page_size: {requested} is negative")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def page_token_id(token: str) -> int:
    """The task id a ListTasks page token continues after (the last id of the page before,
    whatever shard it is of: a listing across shards is in id order too)."""
    if not (token.isascii() and token.isdigit() and len(token) <= 20) or not 0 < int(token) <= MAX_ID:
        raise invalid(f"page_token: {_shown(token)!r} is not a token this server issued")
    return int(token)


def _shown(token: str) -> str:
    return token if len(token) <= 24 else token[:24] + "…"


def _check_replay(request_id: str, subs: list[Submitted], expected: int) -> None:
    """A repeated request_id answers with what the first call made: it must still fit this call."""
    if len(subs) != expected:
        raise failed_precondition(
            f"request_id {request_id!r}: already used for a call that created {len(subs)} task(s) still stored, "
            f"not {expected}; use a new request_id per call"
        )


def _check_ranges(req: object, where: str, ranges: Mapping[str, Range]) -> None:
    """check_range of each field of req named in ranges."""
    for field, allowed in ranges.items():
        check_range(field, getattr(req, field), allowed, where=where)


def _batch_order(tasks: list[NewTask]) -> list[int]:
    """Indices in an order where each task follows the batch tasks it depends on."""
    key_index: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if t.key is not None:
            if t.key in key_index:
                raise invalid(f"tasks[{i}].key: {t.key!r} already names tasks[{key_index[t.key]}] of this batch")
            key_index[t.key] = i
    if not any(t.dep_keys for t in tasks):
        return list(range(len(tasks)))
    edges = [[key_index[k] for k in t.dep_keys if k in key_index] for t in tasks]
    order: list[int] = []
    state = [0] * len(tasks)  # 0 new, 1 on the path, 2 placed
    for root in range(len(tasks)):
        if state[root]:
            continue
        path, stack = [root], [iter(edges[root])]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done = path.pop()
                state[done] = 2
                order.append(done)
            elif state[nxt] == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise invalid(
                    "depends_on: dependency cycle in batch: " + " -> ".join(repr(tasks[j].key) for j in cycle)
                )
            elif state[nxt] == 0:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(edges[nxt]))
    return order
