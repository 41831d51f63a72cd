"""Bulk actions: cancel, retry or delete the tasks of this shard that match a filter.

The filter is checked whole before anything changes. Then the matching tasks are taken in
bounded batches in seq order, each changed in one transaction and published, the event loop
yielded to between batches (so other callers stay fast), for half of server.forward_timeout
at most: then the answer says incomplete, and the same call again continues. A task that changed
meanwhile is matched, not changed; a repeated call matches what is left and changes only that.

A caller has limits.max_bulk_calls in progress on a shard at most, and the store stops a scan past
limits.bulk_scan_timeout (core/scans.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from cronoq.v1 import task_service_pb2 as pb

from ..auth import Principal
from ..config import LimitsConfig
from ..errors import invalid
from ..ids import seq_of, shard_of
from ..store.base import TERMINAL, ScanTimedOut, State, Store, TaskFilter
from .events import EventBus
from .limits import RETRY_EXTRA_ATTEMPTS, check_range, check_text
from .scans import ScanCalls
from .tasks import Tasks, now_us, timestamp_us

# Tasks matched and changed per transaction: sized as it goes so that changing a batch takes
# about the store's bulk_batch_s (a caller queued behind one waits no longer; matching is read
# aside), from a moving average of the time a task took (COST_WEIGHT: the newest batch's part),
# then BATCH_YIELD times as long is left to other callers before the next one.
BATCH_FIRST = 100
BATCH_MIN, BATCH_MAX = 10, 2000
BATCH_YIELD = 1.0
COST_WEIGHT = 0.3
MAX_IDS = 1000
MAX_KEY_PREFIX_BYTES = 256
MAX_ERROR_CONTAINS_BYTES = 1024


@dataclass(frozen=True, slots=True)
class Action:
    """A bulk action: its name in messages, the permission it needs, the states it applies to."""

    name: str
    permission: str
    states: frozenset[State]


CANCEL = Action("cancel", "cancel", frozenset({State.PENDING, State.BLOCKED, State.RUNNING}))
RETRY = Action("retry", "submit", frozenset({State.FAILED, State.CANCELLED}))
DELETE = Action("delete", "admin", TERMINAL)
# ListTasks' filter: any state may be named.
LIST = Action("list", "read", frozenset(State))

# Changes a batch of matched tasks (their seqs) in one transaction and publishes the changes;
# returns how many of them it changed.
Apply = Callable[[list[int]], Awaitable[int]]
BulkResponse = TypeVar("BulkResponse", pb.CancelTasksResponse, pb.RetryTasksResponse, pb.DeleteTasksResponse)


def _names(states: frozenset[State]) -> str:
    return ", ".join(s.name for s in sorted(states))


class Bulk:
    def __init__(
        self,
        tasks: Tasks,
        store: Store,
        events: EventBus,
        shard_name: str,
        shard_number: int,
        pools: list[str],
        budget_s: float,
        limits: LimitsConfig,
        scans: ScanCalls | None = None,
    ):
        """budget_s: how long one call goes on before it answers what it did, incomplete (so that
        a shard asked by another answers within server.forward_timeout); scans: the shard's
        scanning calls in progress, which filtered listings count too (Tasks.scans)."""
        self._budget_s = budget_s
        self._scans = scans or ScanCalls(limits, shard_name)
        self._tasks = tasks
        self._store = store
        self._events = events
        self._shard_name = shard_name
        self._shard = shard_number
        self._pools = pools

    async def cancel_tasks(self, req: pb.CancelTasksRequest, caller: Principal) -> pb.CancelTasksResponse:
        async def cancel(seqs: list[int]) -> int:
            changed, changes = await self._store.cancel_tasks(seqs, now_us())
            await self._events.publish(changes)
            return len(changed)

        result = await self.run(self.task_filter(req.filter, CANCEL, caller), req.dry_run, cancel, caller)
        return _answer(pb.CancelTasksResponse(), result)

    async def retry_tasks(self, req: pb.RetryTasksRequest, caller: Principal) -> pb.RetryTasksResponse:
        match = self.task_filter(req.filter, RETRY, caller)
        run_at = timestamp_us("run_at", req.run_at) if req.HasField("run_at") else None
        check_range("extra_attempts", req.extra_attempts, RETRY_EXTRA_ATTEMPTS)

        async def retry(seqs: list[int]) -> int:
            rows, _ = await self._tasks.retry_seqs(seqs, run_at, req.extra_attempts, caller)
            return len(rows)

        return _answer(pb.RetryTasksResponse(), await self.run(match, req.dry_run, retry, caller))

    async def delete_tasks(self, req: pb.DeleteTasksRequest, caller: Principal) -> pb.DeleteTasksResponse:
        async def delete(seqs: list[int]) -> int:
            return len(await self._tasks.delete_seqs(seqs))

        result = await self.run(self.task_filter(req.filter, DELETE, caller), req.dry_run, delete, caller)
        return _answer(pb.DeleteTasksResponse(), result)

    def task_filter(self, f: pb.TaskFilter, action: Action, caller: Principal) -> TaskFilter | None:
        """The store's filter for this shard's part of the request, checked whole (None: it
        matches nothing here). Pools: the one named (the caller must hold the action's permission
        and `read` on it), else those of this shard where the caller holds both."""
        if not (
            f.pool
            or f.states
            or f.key_prefix
            or f.error_contains
            or f.ids
            or f.parent_id
            or any(f.HasField(b) for b in ("created_after", "created_before", "finished_after", "finished_before"))
        ):
            raise invalid(
                "filter: nothing set, which would match every task; set at least one field (to "
                f"{action.name} every task it applies to, name the states: {_names(action.states)})"
            )
        return store_filter(f, action, caller, self._pools, self._shard)

    async def run(self, match: TaskFilter | None, dry_run: bool, apply: Apply, caller: Principal) -> pb.BulkShardResult:
        """Matches in batches after the last seq seen, applying each (unless dry_run), until no
        task is left or the time budget is spent (incomplete); one of the caller's bulk calls."""
        with self._scans.admitted(caller):
            return await self._run(match, dry_run, apply)

    async def _run(self, match: TaskFilter | None, dry_run: bool, apply: Apply) -> pb.BulkShardResult:
        result = pb.BulkShardResult(shard=self._shard_name)
        deadline = time.perf_counter() + self._budget_s
        after, size, per_task = 0, BATCH_FIRST, 0.0
        while match is not None:
            try:
                batch = await self._store.match_tasks(match, after, size)
            except ScanTimedOut:
                raise self._scans.timed_out(f"{result.changed} changed before") from None
            result.matched += len(batch)
            took = 0.0
            if batch and not dry_run:
                started = time.perf_counter()
                result.changed += await apply([seq for seq, _, _ in batch])
                took = time.perf_counter() - started
            if len(batch) < size:
                break
            after = batch[-1][0]
            if took:
                cost = took / len(batch)
                per_task = cost if not per_task else (1 - COST_WEIGHT) * per_task + COST_WEIGHT * cost
                size = max(BATCH_MIN, min(BATCH_MAX, int(self._store.bulk_batch_s / per_task)))
            if time.perf_counter() + took * (BATCH_YIELD + 1) > deadline:
                result.incomplete = True
                break
            await asyncio.sleep(took * BATCH_YIELD)  # the store is other callers' meanwhile
        return result


def store_filter(
    f: pb.TaskFilter, action: Action, caller: Principal, shard_pools: list[str], shard_number: int
) -> TaskFilter | None:
    """The store's filter for the shard's part of f, checked whole (None: it matches nothing
    there); see Bulk.task_filter. An empty f matches every task action applies to."""
    pools: list[str] | None
    if f.pool:
        caller.require(action.permission, f.pool)
        caller.require("read", f.pool)
        if f.pool not in shard_pools:
            raise invalid(f"filter.pool: unknown pool {f.pool!r}")
        pools = [f.pool]
    elif caller.pools is None and {action.permission, "read"} <= caller.permissions:
        pools = None
    else:
        pools = [p for p in shard_pools if caller.may(action.permission, p) and caller.may("read", p)]
    states = frozenset(action.states)
    if f.states:
        states = frozenset()
        for i, number in enumerate(f.states):
            if number not in State.__members__.values():
                raise invalid(f"filter.states[{i}]: unknown state {number}")
            if number not in action.states:
                raise invalid(
                    f"filter.states[{i}]: {State(number).name} is not a state {action.name} applies to "
                    f"({_names(action.states)})"
                )
            states |= {State(number)}
    bounds = {
        name: timestamp_us(f"filter.{name}", getattr(f, name)) if f.HasField(name) else None
        for name in ("created_after", "created_before", "finished_after", "finished_before")
    }
    for name, limit in (("key_prefix", MAX_KEY_PREFIX_BYTES), ("error_contains", MAX_ERROR_CONTAINS_BYTES)):
        size = len(getattr(f, name).encode())
        if size > limit:
            raise invalid(f"filter.{name}: {size} bytes, more than {limit}")
    check_text("filter.key_prefix", f.key_prefix, MAX_KEY_PREFIX_BYTES)
    seqs = None
    if f.ids:
        if len(f.ids) > MAX_IDS:
            raise invalid(f"filter.ids: {len(f.ids)} ids, more than {MAX_IDS}")
        for i, task_id in enumerate(f.ids):
            if task_id == 0:
                raise invalid(f"filter.ids[{i}]: 0 is not a task id")
        # Ids of other shards are theirs to act on.
        seqs = [seq_of(i) for i in f.ids if shard_of(i) == shard_number]
    # A workflow is in one shard: its parent's.
    parent_seq = seq_of(f.parent_id) if f.parent_id else None
    if pools == [] or seqs == [] or (f.parent_id and shard_of(f.parent_id) != shard_number):
        return None
    return TaskFilter(
        states=states,
        pools=pools,
        key_prefix=f.key_prefix,
        error_contains=f.error_contains,
        seqs=seqs,
        parent_seq=parent_seq,
        **bounds,
    )


def _answer(response: BulkResponse, result: pb.BulkShardResult) -> BulkResponse:
    """A shard's answer: its one result, and its counts as the whole answer's."""
    response.matched, response.changed, response.incomplete = result.matched, result.changed, result.incomplete
    response.shards.append(result)
    return response
