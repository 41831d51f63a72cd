"""cronoq.outbox's checks: a task the server would refuse raises InvalidArgument naming the
field and value, before anything is inserted; the SQL it runs names the schema quoted."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest

import cronoq
from cronoq import outbox
from cronoq.errors import InvalidArgument
from cronoq.outbox_schema import ddl, insert_sql
from cronoq.v1 import task_service_pb2 as pb


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (pb.SubmitTaskRequest(), "pool: required"),
        (pb.SubmitTaskRequest(pool="p" * 257), "pool: 257 characters, more than 256"),
        (pb.SubmitTaskRequest(pool="a", key="k\x00"), "key: control character"),
        (pb.SubmitTaskRequest(pool="a", key="a\u202eb"), "key: control character"),
        (pb.SubmitTaskRequest(pool="a", key="schedule:x"), "reserved for schedules"),
        (pb.SubmitTaskRequest(pool="a", group_key="é" * 129), "group_key: 258 bytes, more than 256"),
        (pb.SubmitTaskRequest(pool="a", payload=b"x" * ((1 << 20) + 1)), "exceeds max_payload_bytes 1048576"),
        (pb.SubmitTaskRequest(pool="a", max_attempts=1001), "max_attempts: 1001 is not between 0 and 1000"),
        (pb.SubmitTaskRequest(pool="a", timeout_ms=604_800_001), "timeout_ms: 604800001"),
        (pb.SubmitTaskRequest(pool="a", run_when=7), "run_when: unknown value 7"),
        (pb.SubmitTaskRequest(pool="a", depends_on=[cronoq.v1.task_pb2.TaskRef(id=0)]), "depends_on[0].id: 0"),
        (pb.SubmitTaskRequest(pool="a", request_id="mine"), "request_id: set by the relay"),
        (pb.SubmitTaskRequest(pool="a", key_mode=2), "key: required with key_mode KEY_MODE_REPLACE_PENDING"),
        (pb.SubmitTaskRequest(pool="a", key_ttl_ms=5), "key: required with key_ttl_ms 5"),
        (pb.SubmitTaskRequest(pool="a", key="k", key_mode=9), "key_mode: unknown value 9"),
        (pb.SubmitTaskRequest(pool="a", key="k", key_ttl_ms=-1), "key_ttl_ms: -1 is not between"),
        (pb.SubmitTaskRequest(pool="a", key="k", key_mode=2, debounce_ms=5), "debounce_ms: 5 applies only with"),
        (
            pb.SubmitTaskRequest(pool="a", key="k", key_mode=3, debounce_ms=10, max_debounce_ms=5),
            "max_debounce_ms: 5 is less than debounce_ms 10",
        ),
        (cronoq.task_spec("a", key="k", key_mode="debounce", debounce_ms=5, delay=1), "run_at: not with"),
        (
            cronoq.task_spec("a", delay=60, start_by=dt.datetime.now(dt.UTC)),
            "start_by:",
        ),
    ],
)
def test_a_bad_task_is_refused_before_any_insert(spec: pb.SubmitTaskRequest, message: str) -> None:
    class NoDatabase:
        __module__ = "asyncpg.connection"

        async def fetch(self, *args: Any) -> Any:
            raise AssertionError("nothing is inserted")

    with pytest.raises(InvalidArgument) as err:
        asyncio.run(outbox.enqueue_many(NoDatabase(), [pb.SubmitTaskRequest(pool="ok"), spec]))
    assert err.value.message.startswith("tasks[1].") and message in err.value.message


def test_a_schema_that_is_not_an_identifier_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="schema: 'x; DROP TABLE t'"):
        asyncio.run(outbox.enqueue_many(object(), [pb.SubmitTaskRequest(pool="a")], schema="x; DROP TABLE t"))


def test_the_sql_quotes_the_schema_and_keeps_the_order() -> None:
    sql = insert_sql("Jobs")
    assert sql.startswith('INSERT INTO "Jobs".cronoq_outbox (pool, request)') and "ORDER BY n RETURNING id" in sql
    assert "%s::text[]" in insert_sql("jobs", "%s")
    statements = ddl("jobs")
    assert statements[0] == 'CREATE SCHEMA IF NOT EXISTS "jobs"' and "schema_version" in statements[-1]
    assert any("pg_notify('cronoq_outbox_jobs'" in s for s in statements)
