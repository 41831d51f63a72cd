"""Prometheus metrics of one server; /metrics serves them."""

from __future__ import annotations

from collections import Counter as Counter_
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from .store.base import LEASE_EXPIRED, STATES, TERMINAL, EventColumns, State

TASKS_SUBMITTED = Counter(
    "cronoq_tasks_submitted_total", "Tasks admitted (deduplicated submissions excluded).", ["pool"]
)
TASKS_LEASED = Counter("cronoq_tasks_leased_total", "Task attempts leased to workers.", ["pool"])
TASKS_FINISHED = Counter(
    "cronoq_tasks_finished_total",
    "Tasks that ended, by outcome (succeeded, failed, cancelled, expired), counted by the leader from the shard's "
    "events.",
    ["pool", "outcome"],
)
TASKS_PURGED = Counter(
    "cronoq_tasks_purged_total",
    "Ended tasks the leader deleted past their pool's retention (with their attempts and dependencies).",
)
TASKS_EXPIRED = Counter(
    "cronoq_tasks_expired_total",
    "Tasks that ended EXPIRED: no attempt had started by their start_by.",
    ["pool"],
)
TASKS_BY_STATE = Gauge(
    "cronoq_tasks",
    "Unfinished tasks by pool and state (pending, blocked, running), kept by the leader as tasks change.",
    ["pool", "state"],
)
START_LATENCY = Histogram(
    "cronoq_task_start_latency_seconds",
    "From when a task was due (run_at or submission) to its lease.",
    ["pool"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RUN_DURATION = Histogram(
    "cronoq_task_run_duration_seconds",
    "From an attempt's lease to its end, by outcome (succeeded, failed, cancelled, lost: its lease expired).",
    ["pool", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
OLDEST_PENDING_AGE = Gauge(
    "cronoq_oldest_pending_age_seconds",
    "How long the earliest-due PENDING task has been due (0: none due); the leader's, every few seconds.",
    ["pool"],
)
OUTBOX_PENDING = Gauge(
    "cronoq_outbox_pending",
    "Committed rows of an outbox this server relays, not yet relayed (the leader's).",
    ["outbox"],
)
OUTBOX_LAG = Gauge(
    "cronoq_outbox_lag_seconds", "Age of the oldest row of an outbox this server relays (0: none).", ["outbox"]
)
OUTBOX_RELAYED = Counter("cronoq_outbox_relayed_total", "Outbox rows submitted as tasks (or deduplicated).", ["outbox"])
OUTBOX_DEAD = Counter(
    "cronoq_outbox_dead_total", "Outbox rows the server refused, moved to the outbox's dead table.", ["outbox"]
)
POOL_PAUSED = Gauge("cronoq_pool_paused", "1 while the pool is paused (PausePool): nothing of it is leased.", ["pool"])
LEADER = Gauge("cronoq_leader", "1 while this server leads its shard.")
LEADER_TERM = Gauge("cronoq_leader_term", "The leadership term this server last led in (0 on SQLite).")
WORKERS = Gauge("cronoq_workers", "Registered workers by pool.", ["pool"])
FORWARDED = Counter("cronoq_forwarded_calls_total", "Calls forwarded to another shard.", ["shard", "code"])
WATCH_STREAMS = Gauge(
    "cronoq_watch_streams",
    "Open Watch streams: shard (this shard's events), merged (every shard's), peer (another shard's, for merged).",
    ["kind"],
)
WORK_STREAMS = Gauge("cronoq_work_streams", "Open Work streams (one per connected worker).")
RESOURCE_IN_USE = Gauge("cronoq_resource_in_use", "Concurrency slots held by running tasks.", ["resource"])
RESOURCE_CAPACITY = Gauge(
    "cronoq_resource_capacity", "A resource's capacity: concurrency slots, or a rate's burst.", ["resource"]
)
# Per keyed resource (per_key): never a series per key.
RESOURCE_KEYS_AT_LIMIT = Gauge(
    "cronoq_resource_keys_at_limit", "Keys of a keyed resource with no slot or token left.", ["resource"]
)
# Per pool that caps its groups (max_running_per_group): never a series per group.
GROUPS_RUNNING = Gauge("cronoq_groups_running", "Groups of the pool with a task running.", ["pool"])
GROUPS_AT_CAP = Gauge(
    "cronoq_groups_at_cap", "Groups of the pool running as many tasks as max_running_per_group allows.", ["pool"]
)
SCHEDULE_FIRES = Counter(
    "cronoq_schedule_fires_total",
    "Tasks created by schedules (also counted in cronoq_tasks_submitted_total).",
    ["pool"],
)
TASK_RETRIES = Counter(
    "cronoq_task_retries_total",
    "Tasks put back to PENDING for another attempt: after a failed or lost attempt (reason failure or lost), "
    "or by an operator's RetryTask/RetryTasks (reason manual).",
    ["pool", "reason"],
)
CALLS = Counter("cronoq_api_calls_total", "API calls by method and code.", ["method", "code"])


def record_events(read: Sequence[EventColumns], moves: Mapping[tuple[str, int, int], int]) -> None:
    """Counts what the shard's events say ended: tasks, attempts and retries (each event once,
    as the leader folds them; moves: how many of them went from each (pool, state) to each
    state). An attempt given back unfinished (started_at cleared) is none."""
    for (pool, prev_state, state), n in moves.items():
        if prev_state != state and state in TERMINAL:
            TASKS_FINISHED.labels(pool, STATES[state].name.lower()).inc(n)
            if state == State.EXPIRED:
                TASKS_EXPIRED.labels(pool).inc(n)
    retries: Counter_[tuple[str, str]] = Counter_()
    durations: dict[tuple[str, str], list[float]] = {}
    for c in read:
        if State.RUNNING not in c.prev_state:
            continue  # no attempt ended here
        for pool, prev_state, state, at, started_at, error in zip(
            c.pool, c.prev_state, c.state, c.at, c.started_at, c.error, strict=True
        ):
            if prev_state != State.RUNNING or state == State.RUNNING or started_at is None:
                continue
            lost = error == LEASE_EXPIRED
            if state == State.PENDING:
                retries[pool, "lost" if lost else "failure"] += 1
            outcome = "lost" if lost else "failed" if state == State.PENDING else STATES[state].name.lower()
            durations.setdefault((pool, outcome), []).append(max(at - started_at, 0) / 1e6)
    # A series' child looked up once per batch, not per event (labels() takes a lock and a dict).
    for labels, n in retries.items():
        TASK_RETRIES.labels(*labels).inc(n)
    for labels, seconds in durations.items():
        observe_all(RUN_DURATION.labels(*labels), seconds)


def observe_all(histogram: Any, values: Iterable[float]) -> None:
    """Observes each value in one labelled histogram."""
    observe = histogram.observe
    for value in values:
        observe(value)
