"""new_task_row builds a submitted task's row positionally (it runs for every task submitted):
each field lands where its name says."""

from __future__ import annotations

import dataclasses

from cronoq_server.store.base import NewTask, State, TaskRow, Trace
from cronoq_server.store.logic import new_task_row


def test_each_field_lands_where_its_name_says():
    task = NewTask(
        pool="p", key="k", payload=b"x", content_type="text/plain", priority=7, run_at=None, max_attempts=4,
        resources={"gpu": 1}, timeout_ms=900, group_key="g", trace=Trace("tp", "ts", False), parent_seq=11,
        run_when=2, start_by=555, key_ttl_ms=66,
    )  # fmt: skip
    for state, finished_at in ((State.PENDING, None), (State.FAILED, 3)):
        row = new_task_row(21, task, 2, 3, state, [5, 6], "why")
        assert row == TaskRow(
            seq=21, pool="p", key="k", payload=b"x", content_type="text/plain", priority=7, run_at=2,
            max_attempts=4, depends_on=[5, 6], resources={"gpu": 1}, state=state, attempt=0, worker_id=None,
            result=None, result_content_type="", error="why", created_at=3, started_at=None,
            finished_at=finished_at, cancel_requested=False, lease_expires_at=None, timeout_ms=900, group_key="g",
            trace=Trace("tp", "ts", False), parent_seq=11, run_when=2, start_by=555, key_ttl_ms=66,
        )  # fmt: skip
    # A field added to TaskRow must be placed in new_task_row too.
    assert len(dataclasses.fields(TaskRow)) == 32
