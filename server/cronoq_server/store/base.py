"""The Store interface every backend implements, and the records it speaks in.

Each mutating method is one transaction. Times are integer microseconds since the
Unix epoch (UTC); tasks are named inside a store by their per-shard sequence.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol


class State(enum.IntEnum):
    """Matches cronoq.v1.TaskState."""

    PENDING = 1
    BLOCKED = 2
    RUNNING = 3
    SUCCEEDED = 4
    FAILED = 5
    CANCELLED = 6
    EXPIRED = 7  # not started by its start_by


TERMINAL = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED, State.EXPIRED})
# A stored state's member by number: a dict look-up, where State(n) costs a call (rows convert many).
STATES: dict[int, State] = {int(s): s for s in State}

# The error of an attempt whose lease expired (its worker went silent): a lost attempt.
LEASE_EXPIRED = "lease expired"

# Column order of every task row a store returns.
TASK_COLUMNS = (
    "seq, pool, key, payload, content_type, priority, run_at, max_attempts, depends_on, resources, "
    "state, attempt, worker_id, result, result_content_type, error, created_at, started_at, "
    "finished_at, cancel_requested, lease_expires_at, timeout_ms, group_key, snoozes, progress, checkpoint, "
    "trace, parent_seq, run_when, start_by, key_ttl_ms, released_key"
)

# SubmitTaskRequest.run_when as stored (0: not given, which is DEPENDENCIES_SUCCEEDED).
RUN_WHEN_SUCCEEDED = 1
RUN_WHEN_ENDED = 2

# SubmitTaskRequest.key_mode (cronoq.v1.KeyMode), resolved by the core (never 0 in a NewTask).
KEY_RETURN_EXISTING = 1
KEY_REPLACE_PENDING = 2
KEY_DEBOUNCE = 3

# The error of a task that ended EXPIRED (no attempt started by its start_by).
NOT_STARTED = "not started by its start_by"


@dataclass(slots=True)
class TaskRow:
    seq: int
    pool: str
    key: str | None
    payload: bytes
    content_type: str
    priority: int
    run_at: int
    max_attempts: int
    depends_on: list[int]
    resources: dict[str, int]
    state: State
    attempt: int
    worker_id: str | None
    result: bytes | None
    result_content_type: str
    error: str
    created_at: int
    started_at: int | None
    finished_at: int | None
    cancel_requested: bool
    lease_expires_at: int | None
    timeout_ms: int = 0  # each attempt's execution timeout; 0: none
    group_key: str = ""  # SubmitTaskRequest.group_key; "": none
    snoozes: int = 0  # times a handler snoozed it (not attempts)
    progress: Progress | None = None  # the last a handler reported
    checkpoint: bytes | None = None  # the last a handler saved; given to the next attempt
    trace: Trace | None = None  # the W3C trace context it was submitted in
    parent_seq: int | None = None  # the task whose handler spawned it
    run_when: int = 0  # RUN_WHEN_*; 0: not given
    start_by: int | None = None  # µs: it ends EXPIRED unless an attempt starts before
    key_ttl_ms: int = 0  # its key is free this long after it ended; 0: held until deleted
    # Filled by the core for a leased task (and GetTask's include_dependency_results), in
    # depends_on order; None: not filled.
    dependency_results: list[DependencyRow] | None = None


@dataclass(frozen=True, slots=True)
class DependencyRow:
    """How a dependency ended, as its dependents' handlers see it (cronoq.v1.DependencyResult)."""

    seq: int
    key: str | None
    state: State
    result: bytes | None
    result_content_type: str
    error: str


@dataclass(frozen=True, slots=True)
class Trace:
    """A W3C trace context (cronoq.v1.TraceContext), as the store keeps it (JSON text)."""

    traceparent: str
    tracestate: str = ""
    link: bool = False  # a fired task's: the schedule's context, linked to rather than continued


@dataclass(frozen=True, slots=True)
class Progress:
    """A handler's progress, as the store keeps it (JSON text [value, message, at])."""

    value: float
    message: str
    at: int  # µs, when the server received it


@dataclass(slots=True)
class Report:
    """What a running handler reported (cronoq.v1.TaskReport), validated: kept with its task
    when the attempt is still the task's."""

    seq: int
    attempt: int
    progress: Progress | None = None
    checkpoint: bytes | None = None  # None: unchanged; b"": cleared


@dataclass(slots=True)
class NewTask:
    """A validated submission. Dependencies are split by how they were named."""

    pool: str
    key: str | None
    payload: bytes
    content_type: str
    priority: int
    run_at: int | None
    max_attempts: int
    resources: dict[str, int] = field(default_factory=dict)
    timeout_ms: int = 0
    group_key: str = ""
    trace: Trace | None = None
    dep_seqs: list[int] = field(default_factory=list)
    dep_keys: list[str] = field(default_factory=list)
    # Indices of earlier tasks of the same batch (their keys, resolved by the core).
    dep_batch: list[int] = field(default_factory=list)
    run_when: int = 0  # RUN_WHEN_*; 0: not given
    parent_seq: int | None = None  # set on the tasks a handler spawned
    key_mode: int = KEY_RETURN_EXISTING  # KEY_*: what a key that names a task does
    debounce_us: int = 0  # KEY_DEBOUNCE: due this long after each submission
    max_debounce_us: int = 0  # KEY_DEBOUNCE: due at most this long after its creation; 0: no bound
    key_ttl_ms: int = 0
    start_by: int | None = None


@dataclass(slots=True)
class Submitted:
    row: TaskRow
    deduplicated: bool
    replaced: bool = False  # the key's PENDING or BLOCKED task took this submission's payload


class OutcomeKind(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    CANCELLED = "cancelled"
    RELEASED = "released"  # given back unfinished: PENDING again, the attempt not counted
    SNOOZED = "snoozed"  # not now: PENDING again, due in snooze_ms, the attempt not counted


@dataclass(slots=True)
class Outcome:
    seq: int
    attempt: int
    kind: OutcomeKind
    result: bytes = b""
    result_content_type: str = ""
    error: str = ""
    retryable: bool = True
    retry_after_ms: int = 0  # a snooze's snooze_ms too
    lost: bool = False  # the lease expired: no word from the worker (a failed attempt, recorded LOST)
    report: Report | None = None  # the handler's last report, kept before the outcome is applied
    # A success's TaskSuccess.spawn, validated and ordered as a batch: created with the success,
    # each with parent_seq this task; a refusal fails the attempt instead.
    spawn: list[NewTask] | None = None
    spawn_visible: frozenset[str] | None = None  # as submit's visible, for the spawned tasks' dependencies


@dataclass(slots=True)
class OutcomeResult:
    seq: int
    accepted: bool
    code: str = ""
    message: str = ""


class AttemptOutcome(enum.IntEnum):
    """Matches cronoq.v1.AttemptOutcome."""

    RUNNING = 1
    SUCCEEDED = 2
    FAILED = 3
    CANCELLED = 4
    LOST = 5
    SNOOZED = 6


# Column order of every attempt row a store writes and returns.
ATTEMPT_COLUMNS = "task_seq, attempt, worker_id, started_at, ended_at, outcome, error"


@dataclass(slots=True)
class AttemptRow:
    """One ended attempt of a task, recorded in the transaction that ended it (ended_at None: a
    RUNNING task's current attempt, read from the task)."""

    task_seq: int
    attempt: int
    worker_id: str | None
    started_at: int | None
    ended_at: int | None
    outcome: AttemptOutcome
    error: str


@dataclass(slots=True)
class WorkerRow:
    id: str
    name: str
    pools: list[str]
    concurrency: int
    labels: dict[str, str]
    registered_at: int
    last_seen_at: int
    principal: str = ""  # who registered it: only that principal may use this worker id


@dataclass(slots=True)
class ScheduleRow:
    """A cron schedule and the template of the tasks it creates. max_attempts and timeout_ms
    are kept as given (0: the pool's, resolved when a slot fires). next_fire_at is None while
    paused (or when the cron has no further slot)."""

    pool: str
    name: str
    cron: str
    timezone: str
    payload: bytes
    content_type: str
    priority: int
    max_attempts: int
    resources: dict[str, int]
    timeout_ms: int
    paused: bool
    fire_all_missed: bool
    next_fire_at: int | None
    last_fire_at: int | None = None
    created_at: int = 0
    updated_at: int = 0
    group_key: str = ""  # of each fired task
    trace: Trace | None = None  # of the call that put it; each fired task links to it


@dataclass(frozen=True, slots=True)
class TaskFilter:
    """Which tasks a bulk action matches: those that match every field set (validated by the core).

    Times are bounds in µs: *_after inclusive, *_before exclusive; a finished bound matches
    ended tasks only. key_prefix and error_contains compare exactly (case-sensitive)."""

    states: frozenset[State]
    pools: list[str] | None = None  # None: every pool
    created_after: int | None = None
    created_before: int | None = None
    finished_after: int | None = None
    finished_before: int | None = None
    key_prefix: str = ""
    error_contains: str = ""
    seqs: list[int] | None = None  # None: any task
    parent_seq: int | None = None  # None: any task; else those its handler spawned


@dataclass(slots=True)
class PoolPause:
    """A pool an operator paused (PausePool): nothing of it is leased until it is resumed."""

    pool: str
    paused: bool
    paused_at: int | None = None  # None while not paused
    paused_by: str = ""  # the caller's name


# (seq, new state) of every task a transaction changed, for events and waiters.
Changes = list[tuple[int, State]]


@dataclass(slots=True)
class EventRow:
    """One recorded change of a task, written in the transaction that made it.

    seq is the shard's event sequence: dense (but for the events of tasks deleted by an operator),
    increasing, and in each task's order of changes.
    pool and prev_state (the state the change left; 0 for a new task) let the leader keep its
    counts of tasks by pool and state from the events alone.
    """

    seq: int
    task_seq: int
    state: State
    attempt: int
    at: int
    pool: str
    prev_state: int
    # The rest of what changes over a task's life (EVENT_TASK_COLUMNS), as this change left it.
    # run_at None: recorded before the store kept these (schema version 6 on SQLite, 7 on PostgreSQL).
    run_at: int | None = None
    worker_id: str | None = None
    error: str | None = None
    started_at: int | None = None
    finished_at: int | None = None
    lease_expires_at: int | None = None
    cancel_requested: bool | None = None


# The event columns the leader's counts and metrics read (EventColumns), in this order after pos.
COUNTED_COLUMNS = "task_seq, state, prev_state, pool, at, started_at, error"


@dataclass(slots=True)
class EventColumns:
    """Numbered events as columns, for the leader's counts and metrics (read_event_columns):
    pos increasing, and one value per event in each other field (those of EventRow's named
    alike). The events of deleted tasks may be among them (task_seq 0), and events at or before
    the position asked for: `after` leaves both out."""

    pos: Sequence[int]
    task_seq: Sequence[int]
    state: Sequence[int]
    prev_state: Sequence[int]
    pool: Sequence[str]
    at: Sequence[int]
    started_at: Sequence[int | None]
    error: Sequence[str | None]

    def after(self, position: int) -> EventColumns | None:
        """Those after `position` but deleted tasks', or None when there are none."""
        start = bisect.bisect_right(self.pos, position)
        if start == len(self.pos):
            return None
        if 0 not in self.task_seq:
            if start == 0:
                return self
            return EventColumns(*(c[start:] for c in self._columns()))
        keep = [i for i in range(start, len(self.pos)) if self.task_seq[i]]
        if not keep:
            return None
        return EventColumns(*([c[i] for i in keep] for c in self._columns()))

    def _columns(self) -> tuple[Sequence[Any], ...]:
        return (self.pos, self.task_seq, self.state, self.prev_state, self.pool, self.at, self.started_at, self.error)


def columns_of(events: Sequence[EventRow]) -> EventColumns:
    """The events as one EventColumns."""
    return EventColumns(
        [e.seq for e in events],
        [e.task_seq for e in events],
        [e.state for e in events],
        [e.prev_state for e in events],
        [e.pool for e in events],
        [e.at for e in events],
        [e.started_at for e in events],
        [e.error for e in events],
    )


# The task columns an event records besides its state and attempt: with those, every column
# that changes over a task's life but its result (set only by the change that ends it).
EVENT_TASK_COLUMNS = "run_at, worker_id, error, started_at, finished_at, lease_expires_at, cancel_requested"
# Column order of every event row a store writes and returns (after its seq).
EVENT_COLUMNS = f"task_seq, state, attempt, at, pool, prev_state, {EVENT_TASK_COLUMNS}"


# retry_at(pool, attempt, now, retry_after_ms) -> when the next attempt may start.
RetryAt = Callable[[str, int, int, int], int]


class Held(NamedTuple):
    """What a RUNNING attempt holds until it ends: its resources, and a place of its group
    when its pool caps groups (core/resources.py)."""

    seq: int
    attempt: int
    resources: dict[str, int]
    pool: str = ""
    group_key: str = ""


@dataclass(frozen=True, slots=True)
class StoreSettings:
    shard_name: str
    shard_number: int
    lease_ttl_us: dict[str, int]
    retention_us: dict[str, int]  # per pool, ended tasks kept this long; 0: forever
    retry_at: RetryAt
    # Per pool, FAILED and EXPIRED tasks kept this long (a pool not in it: as retention_us).
    retention_failed_us: dict[str, int] = field(default_factory=dict)
    max_pending_total: int | None = None
    max_pending_per_pool: int | None = None
    # Tasks' overhead in a lease reply beyond payload, key and content type (an estimate).
    lease_overhead_bytes: int = 256
    # The pools that cap their groups (max_running_per_group): leased round robin across groups.
    group_pools: frozenset[str] = frozenset()
    # Per pool: the snoozes a task may take; one more is taken as a retryable failure.
    max_snoozes: dict[str, int] = field(default_factory=dict)
    # Bulk actions' scans (match_tasks) at once, on connections (PostgreSQL) or threads (SQLite)
    # of their own, so that any number of them leaves the other calls theirs; more wait.
    bulk_scans: int = 1
    # A scan that runs longer is stopped (ScanTimedOut).
    bulk_scan_timeout_us: int = 10_000_000
    # The results a task's dependencies give its handler, together (a submission over it is refused).
    max_dependency_results_bytes: int = 4 << 20


class StoreRefused(Exception):
    """This server must not use the store at all (it exits with 2)."""


class StoreOwnedElsewhere(StoreRefused):
    """The store holds another shard's tasks (its shard name or number differs)."""


class StoreSchemaTooNew(StoreRefused):
    """A newer cronoq-server wrote the store: this one would misread or undo what it added."""


def schema_too_new(store: str, recorded: int, known: int) -> StoreSchemaTooNew:
    return StoreSchemaTooNew(
        f"{store} has schema version {recorded}, newer than this cronoq-server knows (it knows versions up to "
        f"{known}): run the version that wrote it, or a newer one"
    )


class StoreUnavailable(Exception):
    """The store cannot be reached now; the call may be retried."""


class ScanTimedOut(Exception):
    """A bulk action's scan ran past StoreSettings.bulk_scan_timeout_us and was stopped."""


class Fenced(StoreUnavailable):
    """This server's leadership term is over: its writes are refused."""


class Store(Protocol):
    """One shard's tasks. SQLite and PostgreSQL pass the same suite (tests/store)."""

    # Steps of one Work stream (finish_and_lease calls) worth running at once.
    work_steps: int
    # How long a batch of a bulk action should take: every other call waits behind it where the
    # store has one writer (SQLite); elsewhere, longer batches spare round trips.
    bulk_batch_s: float

    async def open(self) -> None:
        """Creates or migrates the schema; refuses (StoreRefused) a store of another shard or of
        a schema newer than this code knows, and never lowers the recorded version."""

    async def close(self) -> None: ...

    async def check_schema(self) -> None:
        """Raises StoreSchemaTooNew when a newer server has migrated the store since it was opened."""

    async def submit(
        self, tasks: list[NewTask], now: int, request_id: str | None = None, visible: frozenset[str] | None = None
    ) -> tuple[list[Submitted], Changes]:
        """Admits all tasks or none (raises ApiError: NOT_FOUND dependency, ALREADY_EXISTS key of
        another pool, RESOURCE_EXHAUSTED).

        request_id: a repeated one returns what the first call created (and changes nothing).
        visible: the pools whose tasks may be named as dependencies (None: all); a task of
        another pool is, as a dependency, a missing task.
        """

    async def get(self, seq: int) -> TaskRow | None: ...

    async def get_by_key(self, key: str) -> TaskRow | None: ...

    async def get_many(self, seqs: list[int]) -> list[TaskRow]: ...

    async def dependents(self, seq: int, limit: int) -> list[tuple[int, str]]:
        """(seq, pool) of the tasks that depend on task `seq`, in seq order, at most `limit`."""
        ...

    async def dependency_rows(self, seqs: list[int]) -> dict[int, DependencyRow]:
        """How these tasks ended (or stand), by seq; a task no longer stored is left out."""
        ...

    async def cancel_workflow(
        self, seq: int, now: int, cancellable: frozenset[str] | None
    ) -> tuple[TaskRow | None, int, Changes]:
        """cancel of task seq with what is under it (logic.workflow_tree: spawned tasks and
        dependents, transitively, in the pools cancellable; None: all), in one transaction;
        returns the task as left, and how many others it cancelled or asked to stop."""
        ...

    async def list_tasks(
        self, pools: list[str] | None, state: State | None, after_seq: int, limit: int, newest_first: bool = False
    ) -> list[TaskRow]:
        """Tasks of those pools (None: all) in seq order after after_seq; newest_first: in
        descending seq order before after_seq (0: from the newest)."""

    async def list_matching(
        self, match: TaskFilter, after_seq: int, limit: int, newest_first: bool = False
    ) -> list[TaskRow]:
        """As list_tasks, the tasks that match (as match_tasks matches them)."""

    async def lease(
        self,
        worker_id: str,
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int = 0,
        free: Mapping[str, int] | None = None,
        groups: Mapping[str, tuple[int, Mapping[str, int]]] | None = None,
    ) -> tuple[list[TaskRow], int | None]:
        """Leases up to limit PENDING tasks (priority, then run_at, then seq within a pool), and
        while max_bytes > 0, only as many as fit in max_bytes (the first one always). Several
        pools are dealt round robin in the order given, the first first: each pool's first task,
        then each one's second...; a pool with fewer leaves its turns to the others.

        groups: of the pools that cap their groups (settings.group_pools, each given), the cap
        and what runs per group: their tasks are taken by (priority, rank, seq), round robin
        across groups, none of a group at its cap (store/fair.py).

        free: when given, what of each resource these tasks may take together; a task naming
        a resource not in it, or more than is left of it, is skipped (the tasks behind it are
        still leased). Never more than free is taken.

        Returns the leased rows, and when none is due, the earliest future run_at.
        """

    async def running_resources(self) -> list[tuple[str, Held]]:
        """(worker id, what it holds) of every RUNNING task that names resources or is of a pool
        that caps its groups."""

    async def load_ranks(self) -> None:
        """Rebuilds the ranks of the pools that cap their groups (store/fair.py) from the
        stored tasks: when a server takes over, before it leases."""

    async def heartbeat(
        self, worker_id: str, attempts: list[tuple[int, int]], now: int, reports: Sequence[Report] = ()
    ) -> tuple[list[int], list[int]]:
        """Extends the leases held; returns (cancel-requested seqs, lost seqs)."""

    async def finish(self, worker_id: str, outcomes: list[Outcome], now: int) -> tuple[list[OutcomeResult], Changes]:
        """Applies the outcomes of tasks leased to worker_id at their attempts; refuses the rest."""

    async def finish_and_lease(
        self,
        worker_id: str,
        outcomes: list[Outcome],
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int = 0,
        free: Mapping[str, int] | None = None,
        groups: Mapping[str, tuple[int, Mapping[str, int]]] | None = None,
        chosen: Callable[[list[Held]], None] | None = None,
    ) -> tuple[list[OutcomeResult], Changes, list[TaskRow], int | None]:
        """finish, then (limit > 0) lease as `lease` does: as one transaction where the store can.

        A store that chooses the tasks of pools that cap their groups before it takes them may
        call chosen with what they will hold, once, before it writes: the caller's accounting
        then holds them (the caller's next lease may run meanwhile, and this one never takes a
        task another lease chose and has not yet taken). The rows returned are those taken."""

    async def expire_leases(self, now: int) -> tuple[Changes, list[tuple[int, int]]]:
        """Ends every lease past its expiry; returns the changes and the (seq, attempt) ended."""

    async def expire_unstarted(self, now: int, limit: int) -> Changes:
        """In one transaction, up to limit PENDING and BLOCKED tasks whose start_by is at or before
        now end EXPIRED (error NOT_STARTED), earliest start_by first, and their dependents as a
        failure ends them (a finalizer is released); returns the changes. A lease never hands out
        such a task, so one leased before its start_by is never expired."""

    async def cancel(self, seq: int, now: int) -> tuple[TaskRow | None, Changes]:
        """cancel_tasks of one task; returns it as the call left it (None: no such task)."""

    async def cancel_tasks(self, seqs: list[int], now: int) -> tuple[list[int], Changes]:
        """In one transaction: the PENDING and BLOCKED tasks among seqs are CANCELLED (their
        BLOCKED dependents too, transitively), the RUNNING ones get cancel_requested; the rest
        are left alone. Returns the seqs among seqs that changed, in order, and the changes."""

    async def match_tasks(self, match: TaskFilter, after_seq: int, limit: int) -> list[tuple[int, State, str]]:
        """(seq, state, pool) of at most limit tasks that match, after after_seq, in seq order.

        Read aside (bulk_scans at once) within bulk_scan_timeout_us, else ScanTimedOut."""

    async def purge(self, now: int, limit: int) -> int:
        """In one transaction, deletes up to limit ended tasks past their pool's retention
        (retention_failed_us for FAILED and EXPIRED ones; 0: kept), oldest first, with their
        dependencies and attempts (their events as delete_tasks leaves them), and the request
        records older than any retention;
        returns how many tasks. The caller repeats it while it deletes limit."""

    async def retry_tasks(
        self,
        seqs: list[int],
        now: int,
        run_at: int | None,
        extra_attempts: int,
        restorable: frozenset[str] | None = None,
    ) -> tuple[list[TaskRow], int, Changes]:
        """In one transaction, the FAILED, CANCELLED and EXPIRED tasks among seqs wait again (their
        start_by cleared): PENDING due at run_at (None: now), or BLOCKED while a dependency has not
        succeeded, keeping their attempt
        (one whose attempts are used up gets max(extra_attempts, 1) more); the rest are left
        alone, as is a task whose dependency is still ended unsuccessfully (retry that one too).
        The dependents they ended (never started, with the dependency error naming them) wait
        for them again (BLOCKED), transitively: those of the pools in restorable (None: every
        pool); one of another pool is left as it is, and so are the tasks it ended.

        Returns (the rows retried, how many dependents wait again, the changes)."""

    async def delete_tasks(self, seqs: list[int]) -> list[int]:
        """Deletes the ended tasks among seqs with their dependencies and attempts; returns the
        seqs deleted, in order. Their events are left to age out of the watch window (the leader
        counts them as any other; a Watch passes over the events of a task no longer stored):
        rewriting the event log for each delete cost minutes for 20,000 tasks."""

    async def attempts(self, seq: int) -> list[AttemptRow]:
        """The ended attempts of a task, oldest first."""

    async def register_worker(self, worker: WorkerRow) -> None: ...

    async def deregister_worker(self, worker_id: str) -> None: ...

    async def get_worker(self, worker_id: str) -> WorkerRow | None: ...

    async def list_workers(self) -> list[WorkerRow]: ...

    async def running_by_worker(self) -> dict[str, int]:
        """How many RUNNING tasks each worker holds (workers with none are left out)."""

    async def reap_workers(self, seen_before: int) -> list[str]:
        """Removes workers last seen before seen_before (µs); returns their ids."""

    async def count_by_pool_and_state(self) -> dict[tuple[str, State], int]: ...

    async def pending_by_group(self, pool: str, most: int, also: list[str]) -> dict[str, int]:
        """PENDING tasks per group of a pool: the `most` groups with the most, and those named
        in `also` that have any."""

    async def oldest_due_pending(self, pools: list[str], now: int) -> dict[str, int]:
        """For each of these pools with a PENDING task due by now: max(run_at, created_at) of
        its earliest-due one (one indexed read per pool)."""

    # -- paused pools --

    async def set_pool_paused(self, pool: str, paused: bool, now: int, by: str) -> PoolPause:
        """Pauses (keeping the first paused_at and paused_by of a pool already paused) or resumes
        the pool; returns it as it is now."""

    async def paused_pools(self) -> list[PoolPause]:
        """The pools paused now."""

    # -- events (every method above that changes a task records an EventRow with it)

    async def sequence_events(self) -> int:
        """Numbers the events committed since the last call (PostgreSQL; SQLite's ids already are
        the sequence); returns the last event seq."""

    async def read_events(self, after: int, limit: int) -> list[EventRow]:
        """Numbered events after seq `after`, in seq order."""

    async def read_event_columns(self, after: int, limit: int) -> list[EventColumns]:
        """Numbered events after seq `after`, in seq order, as columns: about `limit` of them (a
        store that records a statement's events together may return all of the last statement's,
        and some at or before `after` of the first). Those of deleted tasks may be among them."""

    async def count_unfinished(self) -> tuple[int, dict[tuple[str, State], int]]:
        """Numbers committed events, then reads in one snapshot the last event seq and the
        PENDING, BLOCKED and RUNNING tasks by pool (pairs with none left out): the counts are
        exactly those after every event up to that seq and none after it."""

    async def event_bounds(self) -> tuple[int, int]:
        """(purged_through, last): events up to purged_through are gone; last is the last seq."""

    async def purge_events(self, before: int, limit: int) -> int:
        """Deletes up to limit of the oldest numbered events recorded before `before` (or, on
        PostgreSQL, the events one statement recorded together, when they are more); returns how many."""

    # -- schedules --

    async def put_schedule(self, schedule: ScheduleRow, now: int) -> ScheduleRow:
        """Creates or replaces the schedule (pool, name), keeping its last_fire_at and created_at."""

    async def delete_schedule(self, pool: str, name: str) -> bool:
        """False when there was no such schedule."""

    async def list_schedules(self, pools: list[str] | None) -> list[ScheduleRow]:
        """Schedules of those pools (None: all), by pool then name."""

    async def due_schedules(self, now: int, limit: int) -> tuple[list[ScheduleRow], int | None]:
        """Up to limit unpaused schedules whose next_fire_at <= now (earliest first), and the
        earliest next_fire_at after now (None: none)."""

    async def fire_schedule(
        self, schedule: ScheduleRow, tasks: list[NewTask], last_fire_at: int, next_fire_at: int | None, now: int
    ) -> tuple[list[Submitted], Changes] | None:
        """In one transaction: submits the slots' tasks (keyed: a slot already fired is
        deduplicated) and moves the schedule to last_fire_at / next_fire_at, only if it is
        still unpaused with the next_fire_at it was read with; None (nothing done) otherwise.
        A task whose key names a task of another pool is skipped, not fired."""
