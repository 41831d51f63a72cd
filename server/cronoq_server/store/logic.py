"""The decisions every backend makes the same way; backends only read and write rows.

Rows handed in here are tuples (seq, state, attempt, pool, max_attempts, cancel_requested,
worker_id, started_at) for outcomes, and (seq, state, attempt, worker_id, cancel_requested, pool, started_at,
timeout_ms) for heartbeats.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from ..core.limits import DEFAULT_MAX_SNOOZES
from ..errors import ApiError
from ..ids import seq_of
from .base import (
    KEY_DEBOUNCE,
    KEY_RETURN_EXISTING,
    LEASE_EXPIRED,
    RUN_WHEN_ENDED,
    STATES,
    TERMINAL,
    AttemptOutcome,
    AttemptRow,
    Changes,
    EventRow,
    NewTask,
    Outcome,
    OutcomeKind,
    OutcomeResult,
    PoolPause,
    Progress,
    Report,
    RetryAt,
    ScheduleRow,
    State,
    StoreSettings,
    Submitted,
    TaskFilter,
    TaskRow,
    Trace,
)

ALL_STATES = frozenset(State)

# What an outcome decision reads of a task, in this order.
OUTCOME_COLUMNS = "seq, state, attempt, pool, max_attempts, cancel_requested, worker_id, started_at, snoozes"
HEARTBEAT_COLUMNS = "seq, state, attempt, worker_id, cancel_requested, pool, started_at, timeout_ms"


def task_row(r: Any) -> TaskRow:
    """A TaskRow from a row read in TASK_COLUMNS order (JSON text for depends_on and resources)."""
    row = TaskRow(
        seq=r[0],
        pool=r[1],
        key=r[2],
        payload=r[3],
        content_type=r[4],
        priority=r[5],
        run_at=r[6],
        max_attempts=r[7],
        depends_on=json.loads(r[8]) if r[8] else [],
        resources=json.loads(r[9]) if r[9] else {},
        state=STATES[r[10]],
        attempt=r[11],
        worker_id=r[12],
        result=r[13],
        result_content_type=r[14],
        error=r[15],
        created_at=r[16],
        started_at=r[17],
        finished_at=r[18],
        cancel_requested=bool(r[19]),
        lease_expires_at=r[20],
        timeout_ms=r[21],
        group_key=r[22],
        snoozes=r[23],
        progress=progress_of(r[24]),
        checkpoint=r[25],
        trace=trace_of(r[26]),
        parent_seq=r[27],
        run_when=r[28],
        start_by=r[29],
        key_ttl_ms=r[30],
    )
    if r[31] is not None:  # a key released (key_ttl_ms): the task still shows the key it had
        row.key = r[31]
    return row


def new_task_row(
    seq: int,
    task: NewTask,
    run_at: int,
    now: int,
    state: State = State.PENDING,
    depends_on: list[int] | None = None,
    error: str = "",
) -> TaskRow:
    """The row a submission inserted, as reading it back would give it (a task ended by a
    dependency's failure or cancellation is finished at now). Its fields in TaskRow's order,
    positional: a third of the time by keyword, on every task submitted (a unit test holds
    the two equal)."""
    return TaskRow(
        seq, task.pool, task.key, task.payload, task.content_type, task.priority, run_at, task.max_attempts,
        depends_on or [], task.resources, state, 0, None, None, "", error, now, None,
        now if state in TERMINAL else None, False, None, task.timeout_ms, task.group_key, 0, None, None,
        task.trace, task.parent_seq, task.run_when, task.start_by, task.key_ttl_ms,
    )  # fmt: skip


def trace_of(text: str | None) -> Trace | None:
    """A Trace from its column (JSON text [traceparent, tracestate, link]; NULL: none)."""
    if not text:
        return None
    traceparent, tracestate, link = json.loads(text)
    return Trace(traceparent, tracestate, link)


def trace_text(t: Trace | None) -> str | None:
    return json.dumps([t.traceparent, t.tracestate, t.link]) if t is not None else None


def progress_of(text: str | None) -> Progress | None:
    """A Progress from its column (JSON text [value, message, at]; NULL: none)."""
    if not text:
        return None
    value, message, at = json.loads(text)
    return Progress(value, message, at)


def progress_text(p: Progress) -> str:
    return json.dumps([p.value, p.message, p.at])


def report_columns(
    reports: Sequence[Report], now: int
) -> tuple[list[int], list[str | None], list[bool], list[bytes | None]]:
    """Reports as the columns one UPDATE applies: seq, progress text (None: unchanged), whether
    the checkpoint is set, and the checkpoint. A report's progress is stamped with now."""
    return (
        [r.seq for r in reports],
        [progress_text(Progress(r.progress.value, r.progress.message, now)) if r.progress else None for r in reports],
        [r.checkpoint is not None for r in reports],
        [r.checkpoint for r in reports],
    )


def current_reports(reports: Sequence[Report], current: Mapping[int, tuple[Any, ...]], worker_id: str) -> list[Report]:
    """The reports whose attempt is still the task's, running on worker_id (HEARTBEAT_COLUMNS rows)."""
    return [
        r
        for r in reports
        if (row := current.get(r.seq)) is not None
        and row[1] == State.RUNNING
        and row[2] == r.attempt
        and row[3] == worker_id
    ]


def attempt_row(r: Any) -> AttemptRow:
    """An AttemptRow from a row read in ATTEMPT_COLUMNS order."""
    return AttemptRow(r[0], r[1], r[2], r[3], r[4], AttemptOutcome(r[5]), r[6])


def event_row(r: Any) -> EventRow:
    """An EventRow from its seq and then a row read in EVENT_COLUMNS order."""
    cancel_requested = None if r[13] is None else bool(r[13])
    return EventRow(
        r[0], r[1], STATES[r[2]], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], cancel_requested
    )


def event_task_values(row: TaskRow) -> tuple[Any, ...]:
    """A task's values of EVENT_TASK_COLUMNS."""
    return (
        row.run_at, row.worker_id, row.error, row.started_at, row.finished_at, row.lease_expires_at,
        row.cancel_requested,
    )  # fmt: skip


def initial_state(
    deps: Iterable[tuple[int, State]], full_id: Callable[[int], int], run_when: int = 0
) -> tuple[State, str, int]:
    """A new task's (state, error, unfinished dependency count) from its dependencies' states; a
    finalizer (RUN_WHEN_ENDED) waits for each to end, whatever the outcome."""
    state, error, blocked_on = State.PENDING, "", 0
    for dep_seq, dep_state in deps:
        if run_when == RUN_WHEN_ENDED:
            blocked_on += dep_state not in TERMINAL
        elif dep_state in (State.FAILED, State.EXPIRED):
            state, error = State.FAILED, dependency_error(dep_state, full_id(dep_seq))
        elif dep_state == State.CANCELLED and state != State.FAILED:
            state, error = State.CANCELLED, f"dependency {full_id(dep_seq)} was cancelled"
        elif dep_state != State.SUCCEEDED:
            blocked_on += 1
    if state not in TERMINAL and blocked_on:
        state = State.BLOCKED
    return state, error, blocked_on


def check_dependency_bytes(
    task: str, ended: Iterable[tuple[int, int]], limit: int, full_id: Callable[[int], int]
) -> None:
    """Refuses a task whose ended dependencies' results ((seq, bytes) each) are already more than
    its handler may be given, naming them."""
    sized = [(seq, n) for seq, n in ended if n]
    total = sum(n for _, n in sized)
    if total > limit:
        named = ", ".join(f"{full_id(seq)} ({n} bytes)" for seq, n in sorted(sized, key=lambda e: -e[1])[:10])
        raise ApiError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"depends_on: {task}: the results of its dependencies total {total} bytes, over"
            f" limits.max_dependency_results_bytes {limit}: {named}",
            reason="DEPENDENCY_RESULTS_TOO_LARGE",
        )


def spawn_refused(outcome: Outcome, err: ApiError) -> Outcome:
    """A success whose spawned tasks could not be created, as the failure it becomes: not
    retryable, but for a limit that may clear (RESOURCE_EXHAUSTED)."""
    return Outcome(
        outcome.seq,
        outcome.attempt,
        OutcomeKind.FAILURE,
        error=f"spawn: {err.message}",
        retryable=err.code == grpc.StatusCode.RESOURCE_EXHAUSTED,
        report=outcome.report,
    )


class WorkflowTree:
    """The seqs under a task: the tasks spawned by its handler and those that depend on it,
    theirs, and so on, found a level at a time (add: the (seq, pool) of the tasks directly under
    the frontier). A task of a pool not allowed (None: every pool) is left out, and what is under
    it only through it."""

    def __init__(self, root: int, allowed: frozenset[str] | None):
        self.allowed = allowed
        self.seen = {root}
        self.frontier = [root]
        self.found: list[int] = []

    def add(self, under: Iterable[tuple[int, str]]) -> None:
        fresh = [(seq, pool) for seq, pool in under if seq not in self.seen]
        self.seen.update(seq for seq, _ in fresh)
        self.frontier = [seq for seq, pool in fresh if self.allowed is None or pool in self.allowed]
        self.found += self.frontier


def descendants_changed(root: int, changes: Changes) -> int:
    """How many tasks other than root a workflow's cancel cancelled or asked to stop."""
    return len({seq for seq, state in changes if state in (State.CANCELLED, State.RUNNING)} - {root})


def not_leased(worker_id: str, task_id: int, attempt: int) -> OutcomeResult:
    """The one refusal of a report: the same whether the task is missing, moved on, or another's."""
    return OutcomeResult(
        seq_of(task_id),
        False,
        "FAILED_PRECONDITION",
        f"task {task_id} is not leased to worker {worker_id} at attempt {attempt}",
    )


def check_outcomes(
    worker_id: str, outcomes: list[Outcome], current: Mapping[int, tuple[Any, ...]], full_id: Callable[[int], int]
) -> tuple[list[OutcomeResult], list[tuple[Outcome, tuple[Any, ...]]]]:
    """Fences reports: only the current attempt of a RUNNING task leased to worker_id is
    accepted, once; anything else is refused and changes nothing."""
    results: list[OutcomeResult] = []
    accepted: list[tuple[Outcome, tuple[Any, ...]]] = []
    seen: set[int] = set()
    for o in outcomes:
        r = current.get(o.seq)
        if r is None or r[1] != State.RUNNING or r[2] != o.attempt or r[6] != worker_id or o.seq in seen:
            results.append(not_leased(worker_id, full_id(o.seq), o.attempt))
        else:
            seen.add(o.seq)
            results.append(OutcomeResult(o.seq, True))
            accepted.append((o, r))
    return results, accepted


@dataclass
class Decisions:
    """What accepted outcomes do to their tasks."""

    # (state, result, result_content_type, error, finished_at, seq)
    terminal: list[tuple[int, bytes | None, str, str, int, int]] = field(default_factory=list)
    # (run_at, error, seq)
    retries: list[tuple[int, str, int]] = field(default_factory=list)
    # seqs given back unfinished: PENDING again at the same run_at, attempt not counted
    released: list[int] = field(default_factory=list)
    # (run_at, seq) snoozed: PENDING again at run_at, attempt not counted, snoozes + 1
    snoozed: list[tuple[int, int]] = field(default_factory=list)
    succeeded: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    changes: Changes = field(default_factory=list)
    # The attempts ended, in ATTEMPT_COLUMNS order (a released one is not an attempt)
    attempts: list[tuple[int, int, str | None, int | None, int, int, str]] = field(default_factory=list)


def decide_outcomes(
    accepted: list[tuple[Outcome, tuple[Any, ...]]], now: int, retry_at: RetryAt, max_snoozes: Mapping[str, int]
) -> Decisions:
    """Ends or retries RUNNING tasks: cancel wins, then success, then snooze while the pool allows
    (past max_snoozes, a snooze is a retryable failure), then retry while attempts remain."""
    d = Decisions()
    for o, r in accepted:
        seq, attempt, pool, max_attempts, cancel_requested = r[0], r[2], r[3], r[4], r[5]
        if o.kind is OutcomeKind.RELEASED and not cancel_requested:
            d.released.append(seq)
            d.changes.append((seq, State.PENDING))
            continue
        if o.kind is OutcomeKind.SNOOZED and not cancel_requested:
            limit = max_snoozes.get(pool, DEFAULT_MAX_SNOOZES)
            if r[8] < limit:
                d.snoozed.append((now + o.retry_after_ms * 1000, seq))
                reason = f"snoozed for {o.retry_after_ms} ms" + (f": {o.error}" if o.error else "")
                d.attempts.append((seq, attempt, r[6], r[7], now, int(AttemptOutcome.SNOOZED), reason))
                d.changes.append((seq, State.PENDING))
                continue
            o = Outcome(
                o.seq, o.attempt, OutcomeKind.FAILURE, error=f"snoozed {limit} times, the pool's max_snoozes",
                retry_after_ms=o.retry_after_ms,
            )  # fmt: skip
        if o.kind in (OutcomeKind.CANCELLED, OutcomeKind.RELEASED) or cancel_requested:
            state, error, outcome = State.CANCELLED, o.error or "cancelled", AttemptOutcome.CANCELLED
            d.cancelled.append(seq)
        elif o.kind is OutcomeKind.SUCCESS:
            state, error, outcome = State.SUCCEEDED, "", AttemptOutcome.SUCCEEDED
            d.succeeded.append(seq)
        elif o.retryable and attempt < max_attempts:
            state, error, outcome = State.PENDING, o.error, AttemptOutcome.FAILED
            d.retries.append((retry_at(pool, attempt, now, o.retry_after_ms), o.error, seq))
        else:
            state, error, outcome = State.FAILED, o.error, AttemptOutcome.FAILED
            d.failed.append(seq)
        if o.lost:
            outcome = AttemptOutcome.LOST
        d.attempts.append((seq, attempt, r[6], r[7], now, int(outcome), error))
        if state != State.PENDING:
            d.terminal.append((int(state), o.result or None, o.result_content_type, error, now, seq))
        d.changes.append((seq, state))
    return d


def expired_outcome(row: tuple[Any, ...]) -> tuple[Outcome, tuple[Any, ...]]:
    """An expired lease counts as a failed, retryable attempt (recorded LOST)."""
    return Outcome(row[0], row[2], OutcomeKind.FAILURE, error=LEASE_EXPIRED, retryable=True, lost=True), row


def decide_heartbeat(
    worker_id: str,
    attempts: list[tuple[int, int]],
    current: Mapping[int, tuple[Any, ...]],
    now: int,
    lease_ttl_us: Mapping[str, int],
) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """(cancel-requested seqs, lost seqs, (new expiry, seq) to extend)."""
    cancelled, lost, extend = [], [], []
    for seq, attempt in attempts:
        r = current.get(seq)
        if r is None or r[1] != State.RUNNING or r[2] != attempt or r[3] != worker_id:
            lost.append(seq)
            continue
        expiry = now + lease_ttl_us[r[5]]
        if r[7] > 0:  # never past the attempt's deadline: a hung worker loses the task there
            expiry = min(expiry, r[6] + r[7] * 1000)
        extend.append((expiry, seq))
        if r[4]:
            cancelled.append(seq)
    return cancelled, lost, extend


def key_of_another_pool(key: str, pool: str, existing_pool: str) -> None:
    """Keys deduplicate within a pool; naming another pool's task is refused, revealing nothing of it."""
    if existing_pool != pool:
        raise ApiError(
            grpc.StatusCode.ALREADY_EXISTS,
            f"key {key!r} already names a task of another pool",
            reason="KEY_IN_ANOTHER_POOL",
        )


def key_released(existing: TaskRow, now: int) -> bool:
    """The task ended, and its key_ttl_ms has passed since: its key is free for a new task."""
    return (
        existing.key_ttl_ms > 0
        and existing.finished_at is not None
        and existing.state in TERMINAL
        and existing.finished_at + existing.key_ttl_ms * 1000 <= now
    )


def replaces(task: NewTask, existing: TaskRow) -> bool:
    """A submission with a key that names an existing task replaces what it carries (payload,
    content_type, priority, run_at): with a replacing key mode, while it has not started."""
    key_of_another_pool(task.key or "", task.pool, existing.pool)
    return task.key_mode != KEY_RETURN_EXISTING and existing.state in (State.PENDING, State.BLOCKED)


def keyed_run_at(task: NewTask, now: int, created_at: int | None = None) -> int:
    """When a submitted task is due: its run_at (not given: now). KEY_DEBOUNCE: debounce after
    now, but at most max_debounce after the task was created (created_at; None: now)."""
    if task.key_mode == KEY_DEBOUNCE:
        due = now + task.debounce_us
        if task.max_debounce_us:
            due = min(due, (now if created_at is None else created_at) + task.max_debounce_us)
        return due
    return task.run_at if task.run_at is not None else now


def replaced(existing: TaskRow, task: NewTask, now: int) -> TaskRow:
    """The existing task as a replacing submission leaves it."""
    return replace(
        existing,
        payload=task.payload,
        content_type=task.content_type,
        priority=task.priority,
        run_at=keyed_run_at(task, now, existing.created_at),
    )


def encode_request(subs: list[Submitted]) -> str:
    """What a request created, kept under its request_id: [[seq, deduplicated, replaced], ...]."""
    return json.dumps([[s.row.seq, s.deduplicated, s.replaced] for s in subs])


def replay_request(text: str, rows: list[TaskRow]) -> list[Submitted]:
    """The answer to a repeated request_id, from its record and the rows still stored."""
    by_seq = {r.seq: r for r in rows}
    # Recorded before key modes: [seq, deduplicated].
    return [
        Submitted(by_seq[seq], dedup, bool(rest and rest[0])) for seq, dedup, *rest in json.loads(text) if seq in by_seq
    ]


def request_seqs(text: str) -> list[int]:
    return [seq for seq, *_ in json.loads(text)]


def retained(settings: StoreSettings) -> list[tuple[str, str, int]]:
    """(pool, its ended states as SQL, how long they are kept in µs) of each retention that is
    not forever (0): SUCCEEDED and CANCELLED tasks by retention_us, FAILED and EXPIRED ones by
    retention_failed_us (default: retention_us)."""
    out = []
    for pool, keep in settings.retention_us.items():
        keep_failed = settings.retention_failed_us.get(pool, keep)
        out += [(pool, states, k) for states, k in (("4, 6", keep), ("5, 7", keep_failed)) if k]
    return out


def request_retention(settings: StoreSettings) -> int:
    """How long a request_id is remembered: as long as any pool keeps its tasks (µs); a pool that
    keeps them forever counts as the longest other retention (at least 7 days)."""
    return max((r for r in settings.retention_us.values() if r), default=7 * 86_400_000_000)


_ENDED_AS = {State.FAILED: "failed", State.CANCELLED: "was cancelled", State.EXPIRED: "expired"}


def dependency_error(state: State, dep_full_id: int) -> str:
    """The error of a task ended by a dependency that ended unsuccessfully (in that state)."""
    return f"dependency {dep_full_id} {_ENDED_AS[state]}"


# -- an operator's retry ------------------------------------------------------------
#
# A task ended by a dependency (FAILED or CANCELLED, never started, its error naming that
# dependency) is brought back when the dependency is retried. Its error always names one of its
# dependencies that is still ended: when the one it named waits again but another is still
# ended, it names that other one, so that retrying it brings the task back.

ENDED_UNSUCCESSFULLY = (State.FAILED, State.CANCELLED, State.EXPIRED)
# A task's dependencies still stored, each with its state now (one deleted is no longer waited for)
DepStates = Mapping[int, Sequence[tuple[int, State]]]


@dataclass
class Retry:
    """What retry_tasks writes, in the order it decides it."""

    # (state, run_at, max_attempts, blocked_on, seq) of each task asked for that waits again
    retried: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # (blocked_on, seq) of each dependent that waits again (BLOCKED)
    restored: list[tuple[int, int]] = field(default_factory=list)
    # (error, seq) of each dependent still ended by another dependency
    renamed: list[tuple[str, int]] = field(default_factory=list)
    changes: Changes = field(default_factory=list)
    prev: list[int] = field(default_factory=list)


def _ended_dependency(deps: Sequence[tuple[int, State]], again: set[int]) -> tuple[int, State] | None:
    """The first of a task's dependencies still ended unsuccessfully (those in `again` wait again)."""
    return next(((dep, state) for dep, state in deps if dep not in again and state in ENDED_UNSUCCESSFULLY), None)


def _waiting(deps: Sequence[tuple[int, State]], again: set[int]) -> int:
    """How many of a task's dependencies it waits for: those in `again`, and those not SUCCEEDED."""
    return sum(1 for dep, state in deps if dep in again or state != State.SUCCEEDED)


def decide_retry(
    rows: Iterable[tuple[int, State, int, int]], deps: DepStates, now: int, run_at: int | None, extra_attempts: int
) -> Retry:
    """The tasks (seq, state, attempt, max_attempts) asked for that wait again, in seq order: a
    dependency always has a lower seq than its dependents, so one retried with them is decided first."""
    plan = Retry()
    again: set[int] = set()
    for seq, state, attempt, max_attempts in sorted(rows):
        task_deps = deps.get(seq, ())
        if state not in ENDED_UNSUCCESSFULLY or _ended_dependency(task_deps, again) is not None:
            continue
        if attempt >= max_attempts:  # used up: more attempts; one with attempts left keeps them
            max_attempts = attempt + max(extra_attempts, 1)
        waiting = _waiting(task_deps, again)
        new_state = State.BLOCKED if waiting else State.PENDING
        plan.retried.append((int(new_state), now if run_at is None else run_at, max_attempts, waiting, seq))
        plan.changes.append((seq, new_state))
        plan.prev.append(int(state))
        again.add(seq)
    return plan


def decide_restore(
    plan: Retry,
    candidates: Iterable[tuple[int, State, str, str]],
    frontier: Iterable[int],
    deps: DepStates,
    full_id: Callable[[int], int],
    restorable: frozenset[str] | None,
) -> list[int]:
    """Of the dependents (seq, state, error, pool) of the tasks that wait again (frontier) ended
    at attempt 0, those of the pools in restorable (None: every pool) ended by one of them wait
    again too; returns their seqs (the next frontier)."""
    frontier = set(frontier)
    restored: set[int] = set()
    for seq, state, error, pool in sorted(candidates):
        if restorable is not None and pool not in restorable:
            continue  # not the retrying caller's to bring back: it stays as it is
        task_deps = deps.get(seq, ())
        named = {
            dependency_error(dep_state, full_id(dep))
            for dep, _ in task_deps
            if dep in frontier
            for dep_state in ENDED_UNSUCCESSFULLY
        }
        if state not in ENDED_UNSUCCESSFULLY or error not in named:
            continue
        ended = _ended_dependency(task_deps, restored)
        if ended is not None:
            plan.renamed.append((dependency_error(ended[1], full_id(ended[0])), seq))
            plan.changes.append((seq, state))
        else:
            plan.restored.append((_waiting(task_deps, restored), seq))
            plan.changes.append((seq, State.BLOCKED))
            restored.add(seq)
        plan.prev.append(int(state))
    return sorted(restored)


def check_pending_limits(settings: StoreSettings, counts: Mapping[str, int], created: list[str]) -> None:
    """Refuses (and so rolls back) a submission that leaves too many PENDING or BLOCKED tasks.

    counts: pending tasks by pool after the submission; created: the pools of its new tasks.
    """
    total = sum(counts.values())
    if settings.max_pending_total is not None and total > settings.max_pending_total:
        raise ApiError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"limits.max_pending_total: admitting {len(created)} task(s) would make {total} pending "
            f"(limit {settings.max_pending_total}); nothing was admitted",
            reason="PENDING_LIMIT",
            retry_delay=1.0,
        )
    if settings.max_pending_per_pool is not None:
        for pool in sorted(set(created)):
            if counts.get(pool, 0) > settings.max_pending_per_pool:
                raise ApiError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"limits.max_pending_per_pool: pool {pool!r} would have {counts[pool]} pending "
                    f"(limit {settings.max_pending_per_pool}); nothing was admitted",
                    reason="PENDING_LIMIT",
                    retry_delay=1.0,
                )


def limits_apply(settings: StoreSettings) -> bool:
    return settings.max_pending_total is not None or settings.max_pending_per_pool is not None


# A lease looks for the tasks of a keyed resource key by key (an index of their own, by key):
# the tasks of a key without room are never read, wherever they stand in the pool's order. It
# visits at most this many keys of a pool with PENDING tasks, after those the lease before it
# visited (then from the first again): with fewer, every key, and the lease takes tasks in the
# pool's order exactly; with more, the keys in turns.
KEY_SCAN = 256


def keyed_entry(resources: Mapping[str, int] | None) -> str | None:
    """The keyed entry ("name:key") a task is leased by: the first of those it names, by name
    (None: it names none). Its other entries are checked as any resource is."""
    return min((e for e in resources or () if ":" in e), default=None)


def has_keyed(free: Mapping[str, int]) -> bool:
    """Whether a lease's free names a keyed resource ("name:", the full size of every key)."""
    return any(n.endswith(":") for n in free)


def lease_scan(limit: int) -> int:
    """How many due tasks that fit alone a lease that checks resources looks at for limit of
    them: one that fits alone may not fit beside those before it, and is then skipped. (Those
    of a resource used up are passed over in the index scan; a keyed resource's key without
    room is not read at all.)"""
    return limit + 16


# -- paused pools ---------------------------------------------------------------

POOL_PAUSE_COLUMNS = "name, paused, paused_at, paused_by"
# INSERT INTO pools (POOL_PAUSE_COLUMNS) VALUES ({p} four times), then this: a pool paused again
# keeps when and by whom it was first paused; a resumed one forgets both.
POOL_PAUSE_UPSERT = (
    "INSERT INTO {s}pools (" + POOL_PAUSE_COLUMNS + ") VALUES ({p1}, {p2}, {p3}, {p4})"
    " ON CONFLICT (name) DO UPDATE SET paused = excluded.paused,"
    " paused_at = CASE WHEN pools.paused AND excluded.paused THEN pools.paused_at ELSE excluded.paused_at END,"
    " paused_by = CASE WHEN pools.paused AND excluded.paused THEN pools.paused_by ELSE excluded.paused_by END"
    " RETURNING " + POOL_PAUSE_COLUMNS
)


def pool_pause_values(pool: str, paused: bool, now: int, by: str) -> tuple[str, bool, int | None, str]:
    return pool, paused, now if paused else None, by if paused else ""


def pool_pause(r: Any) -> PoolPause:
    """A PoolPause from a row read in POOL_PAUSE_COLUMNS order."""
    return PoolPause(pool=r[0], paused=bool(r[1]), paused_at=r[2], paused_by=r[3])


# -- schedules ------------------------------------------------------------------

SCHEDULE_COLUMNS = (
    "pool, name, cron, timezone, payload, content_type, priority, max_attempts, resources, timeout_ms, "
    "paused, fire_all_missed, next_fire_at, last_fire_at, created_at, updated_at, group_key, trace"
)
# What a Put of an existing schedule replaces (its last_fire_at and created_at are kept).
SCHEDULE_UPSERT = (
    " ON CONFLICT (pool, name) DO UPDATE SET cron = excluded.cron, timezone = excluded.timezone,"
    " payload = excluded.payload, content_type = excluded.content_type, priority = excluded.priority,"
    " max_attempts = excluded.max_attempts, resources = excluded.resources, timeout_ms = excluded.timeout_ms,"
    " paused = excluded.paused, fire_all_missed = excluded.fire_all_missed, group_key = excluded.group_key,"
    " trace = excluded.trace, next_fire_at = excluded.next_fire_at, updated_at = excluded.updated_at"
    f" RETURNING {SCHEDULE_COLUMNS}"
)


def schedule_row(r: Any) -> ScheduleRow:
    """A ScheduleRow from a row read in SCHEDULE_COLUMNS order (JSON text for resources)."""
    return ScheduleRow(
        pool=r[0],
        name=r[1],
        cron=r[2],
        timezone=r[3],
        payload=bytes(r[4]),
        content_type=r[5],
        priority=r[6],
        max_attempts=r[7],
        resources=json.loads(r[8]) if r[8] else {},
        timeout_ms=r[9],
        paused=bool(r[10]),
        fire_all_missed=bool(r[11]),
        next_fire_at=r[12],
        last_fire_at=r[13],
        created_at=r[14],
        updated_at=r[15],
        group_key=r[16],
        trace=trace_of(r[17]),
    )


def schedule_values(s: ScheduleRow, now: int) -> tuple[Any, ...]:
    """The values of an upsert, in SCHEDULE_COLUMNS order (created_at and updated_at: now)."""
    resources = json.dumps(s.resources) if s.resources else None
    return (
        s.pool, s.name, s.cron, s.timezone, s.payload, s.content_type, s.priority, s.max_attempts, resources,
        s.timeout_ms, s.paused, s.fire_all_missed, s.next_fire_at, None, now, now, s.group_key, trace_text(s.trace),
    )  # fmt: skip


def key_in_another_pool(err: ApiError) -> bool:
    """A fired slot's key already names another pool's task: that slot is skipped, not retried forever."""
    return err.reason == "KEY_IN_ANOTHER_POOL"


@dataclass(frozen=True, slots=True)
class Dialect:
    """What the stores' SQL says differently for match_sql."""

    mark: Callable[[int], str]  # the placeholder of the n-th parameter (1-based)
    any_of: Callable[[str, str, str], str]  # (column, placeholder, SQL type): column is in the list
    array: Callable[[list[Any]], Any]  # a list as that placeholder's value
    contains: str  # "{0} contains {1}", case-sensitive, no pattern characters


def match_sql(
    match: TaskFilter, after_seq: int, limit: int, dialect: Dialect, newest_first: bool = False
) -> tuple[str, list[Any]]:
    """The WHERE clause (with ORDER BY and LIMIT) of match_tasks and list_matching, and its
    parameters; newest_first: in descending seq order, before after_seq (0: from the newest)."""
    params: list[Any] = []

    def p(value: Any) -> str:
        params.append(value)
        return dialect.mark(len(params))

    where: list[str] = []
    if newest_first:
        where += [f"seq < {p(after_seq)}"] if after_seq else []
    else:
        where.append(f"seq > {p(after_seq)}")
    if match.states != ALL_STATES:  # every state: no condition, as a plain listing has none
        where.append(f"state IN ({', '.join(str(int(s)) for s in sorted(match.states))})")
    if match.pools is not None:
        pools = match.pools
        # One pool: an equality, so the (pool, seq) index serves it in seq order.
        where.append(
            f"pool = {p(pools[0])}" if len(pools) == 1 else dialect.any_of("pool", p(dialect.array(pools)), "text")
        )
    if match.seqs is not None:
        where.append(dialect.any_of("seq", p(dialect.array(match.seqs)), "bigint"))
    bounds = (
        ("created_at >=", match.created_after),
        ("created_at <", match.created_before),
        ("finished_at >=", match.finished_after),
        ("finished_at <", match.finished_before),
    )
    where += [f"{column} {p(bound)}" for column, bound in bounds if bound is not None]
    if match.key_prefix:
        # Compared as text, not a LIKE pattern: % and _ in the prefix are plain characters.
        where.append(f"substr(key, 1, {p(len(match.key_prefix))}) = {p(match.key_prefix)}")
    if match.error_contains:
        where.append(dialect.contains.format("error", p(match.error_contains)))
    if match.parent_seq is not None:
        where.append(f"parent_seq = {p(match.parent_seq)}")
    order = "seq DESC" if newest_first else "seq"
    return " AND ".join(where or ["1 = 1"]) + f" ORDER BY {order} LIMIT {p(limit)}", params


def list_filter(pools: list[str] | None, state: State | None) -> TaskFilter:
    """list_tasks' arguments as the filter list_matching takes."""
    return TaskFilter(states=frozenset({state}) if state is not None else ALL_STATES, pools=pools)


def scans_far(match: TaskFilter) -> bool:
    """Whether listing by this filter may read far past what it returns (a key prefix, an error
    text, time bounds, several states; not pools, one state or ids): such a listing is read as
    a bulk action's scan is (Store.match_tasks), not where the hot path's calls are."""
    several_states = 1 < len(match.states) < len(ALL_STATES)
    bounds = (match.created_after, match.created_before, match.finished_after, match.finished_before)
    return several_states or bool(match.key_prefix or match.error_contains) or any(b is not None for b in bounds)
