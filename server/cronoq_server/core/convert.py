"""Store rows to API messages."""

from __future__ import annotations

from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from cronoq.v1 import schedule_service_pb2, task_pb2, worker_service_pb2

from ..ids import make_task_id
from ..store.base import AttemptRow, DependencyRow, ScheduleRow, TaskRow, Trace, WorkerRow

# The fields of a Task that are a TaskRow's of the same name, passed when set.
_OPTIONAL_FIELDS = (
    "key", "content_type", "resources", "worker_id", "result", "result_content_type", "error", "cancel_requested",
    "timeout_ms", "group_key", "snoozes", "checkpoint", "key_ttl_ms",
)  # fmt: skip


def to_task(row: TaskRow, shard_number: int) -> task_pb2.Task:
    # Every leased task is converted (a Work step's answer): only the fields a row sets are
    # passed, and times are set directly; half the cost of naming every field.
    fields: dict[str, Any] = {
        "id": make_task_id(shard_number, row.seq),
        "pool": row.pool,
        "payload": row.payload,
        "priority": row.priority,
        "max_attempts": row.max_attempts,
        "state": int(row.state),
        "attempt": row.attempt,
    }
    for name in _OPTIONAL_FIELDS:
        if value := getattr(row, name):
            fields[name] = value
    if row.depends_on:
        fields["depends_on"] = [make_task_id(shard_number, s) for s in row.depends_on]
    if row.parent_seq is not None:
        fields["parent_id"] = make_task_id(shard_number, row.parent_seq)
    if row.run_when:
        fields["run_when"] = row.run_when
    if row.dependency_results:
        fields["dependency_results"] = [to_dependency_result(d, shard_number) for d in row.dependency_results]
    task = task_pb2.Task(**fields)
    set_time(task.run_at, row.run_at)
    set_time(task.created_at, row.created_at)
    if row.started_at is not None:
        set_time(task.started_at, row.started_at)
    if row.finished_at is not None:
        set_time(task.finished_at, row.finished_at)
    if row.lease_expires_at is not None:
        set_time(task.lease_expires_at, row.lease_expires_at)
    if row.start_by is not None:
        set_time(task.start_by, row.start_by)
    if row.progress is not None:
        task.progress.value = row.progress.value
        task.progress.message = row.progress.message
        set_time(task.progress.updated_at, row.progress.at)
    if row.trace is not None:
        set_trace(task.trace, row.trace)
    return task


def to_dependency_result(row: DependencyRow, shard_number: int) -> task_pb2.DependencyResult:
    return task_pb2.DependencyResult(
        id=make_task_id(shard_number, row.seq),
        key=row.key or "",
        state=int(row.state),  # type: ignore[arg-type]
        result=row.result or b"",
        content_type=row.result_content_type,
        error=row.error,
    )


def set_time(msg: Timestamp, us: int) -> None:
    """A Timestamp set to us microseconds since the epoch (Timestamp.FromMicroseconds, without its
    Python-level checks)."""
    msg.seconds, msg.nanos = us // 1_000_000, us % 1_000_000 * 1000


def set_trace(msg: task_pb2.TraceContext, trace: Trace) -> None:
    msg.traceparent, msg.tracestate, msg.link = trace.traceparent, trace.tracestate, trace.link


def to_attempt(row: AttemptRow, worker_name: str, now: int) -> task_pb2.Attempt:
    """An attempt; one still running (no ended_at) lasts until now so far."""
    attempt = task_pb2.Attempt(
        attempt=row.attempt,
        worker_id=row.worker_id or "",
        worker_name=worker_name,
        outcome=int(row.outcome),  # type: ignore[arg-type]
        error=row.error,
    )
    if row.started_at is not None:
        attempt.started_at.FromMicroseconds(row.started_at)
        attempt.duration_ms = max((now if row.ended_at is None else row.ended_at) - row.started_at, 0) // 1000
    if row.ended_at is not None:
        attempt.ended_at.FromMicroseconds(row.ended_at)
    return attempt


def to_worker(row: WorkerRow, shard: str, running: int = 0) -> worker_service_pb2.Worker:
    worker = worker_service_pb2.Worker(
        id=row.id,
        name=row.name,
        pools=row.pools,
        concurrency=row.concurrency,
        shard=shard,
        labels=row.labels,
        running=running,
    )
    worker.registered_at.FromMicroseconds(row.registered_at)
    worker.last_seen_at.FromMicroseconds(row.last_seen_at)
    return worker


def to_schedule(row: ScheduleRow) -> schedule_service_pb2.Schedule:
    schedule = schedule_service_pb2.Schedule(
        pool=row.pool,
        name=row.name,
        cron=row.cron,
        timezone=row.timezone,
        payload=row.payload,
        content_type=row.content_type,
        priority=row.priority,
        max_attempts=row.max_attempts,
        resources=row.resources,
        paused=row.paused,
        timeout_ms=row.timeout_ms,
        fire_all_missed=row.fire_all_missed,
        group_key=row.group_key,
    )
    if row.trace is not None:
        set_trace(schedule.trace, row.trace)
    if row.next_fire_at is not None:
        schedule.next_fire_at.FromMicroseconds(row.next_fire_at)
    if row.last_fire_at is not None:
        schedule.last_fire_at.FromMicroseconds(row.last_fire_at)
    return schedule
