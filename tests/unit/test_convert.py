"""Store rows to API messages (core/convert.py): to_task passes only the fields a row sets, and
gives the same Task as naming every field."""

from __future__ import annotations

from cronoq.v1 import task_pb2
from cronoq_server.core.convert import to_task
from cronoq_server.ids import make_task_id
from cronoq_server.store.base import Progress, State, TaskRow, Trace

T = 1_700_000_000_123_456


def every_field(row: TaskRow, shard: int) -> task_pb2.Task:
    """The Task of a row, each field named (what to_task was before it skipped defaults)."""
    task = task_pb2.Task(
        id=make_task_id(shard, row.seq),
        pool=row.pool,
        key=row.key or "",
        payload=row.payload,
        content_type=row.content_type,
        priority=row.priority,
        max_attempts=row.max_attempts,
        depends_on=[make_task_id(shard, s) for s in row.depends_on],
        resources=row.resources,
        state=int(row.state),  # type: ignore[arg-type]
        attempt=row.attempt,
        worker_id=row.worker_id or "",
        result=row.result or b"",
        result_content_type=row.result_content_type,
        error=row.error,
        cancel_requested=row.cancel_requested,
        timeout_ms=row.timeout_ms,
        group_key=row.group_key,
        snoozes=row.snoozes,
        checkpoint=row.checkpoint or b"",
    )
    task.run_at.FromMicroseconds(row.run_at)
    task.created_at.FromMicroseconds(row.created_at)
    for name in ("started_at", "finished_at", "lease_expires_at"):
        if getattr(row, name) is not None:
            getattr(task, name).FromMicroseconds(getattr(row, name))
    if row.progress is not None:
        task.progress.value, task.progress.message = row.progress.value, row.progress.message
        task.progress.updated_at.FromMicroseconds(row.progress.at)
    if row.trace is not None:
        task.trace.traceparent, task.trace.tracestate = row.trace.traceparent, row.trace.tracestate
        task.trace.link = row.trace.link
    return task


def test_a_bare_leased_row_and_a_row_with_every_field_convert_as_naming_every_field() -> None:
    bare = TaskRow(
        7, "default", None, b"", "", 0, T, 3, [], {}, State.RUNNING, 1, "w-1", None, "", "", T, T + 5, None, False,
        T + 60_000_000,
    )  # fmt: skip
    full = TaskRow(
        2**40, "gpu", "k-1", b"\x00payload", "application/json", -5, -1_500_001, 7, [3, 4], {"gpu": 2, "db:a": 1},
        State.SUCCEEDED, 3, "w-2", b"result", "text/plain", "earlier error", T, T + 1, T + 2, True, None,
        timeout_ms=30_000, group_key="tenant-9", snoozes=4, progress=Progress(0.5, "half", T + 3),
        checkpoint=b"ckpt", trace=Trace("00-" + "1" * 32 + "-" + "2" * 16 + "-01", "k=v", True),
    )  # fmt: skip
    for row in (bare, full):
        for shard in (0, 3):
            assert to_task(row, shard) == every_field(row, shard)
    assert to_task(full, 0).run_at.seconds == -2 and to_task(full, 0).run_at.nanos == 499_999_000
