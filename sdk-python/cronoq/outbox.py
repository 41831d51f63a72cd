"""Submitting tasks in the application's own database transaction (the outbox).

    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("INSERT INTO orders ...")
        await cronoq.outbox.enqueue(conn, "emails", {"order": 42}, key="order-42-email")

The task is a row of `<schema>.cronoq_outbox` in the application's PostgreSQL database, written
by the application's transaction: it exists if the transaction commits, never if it rolls back.
A cronoq-server configured with the outbox (`[[outboxes]]`) submits each committed row, once
(the row's id is its request id), and deletes it; a row the server refuses is moved to
`<schema>.cronoq_outbox_dead` with the reason. `cronoq outbox install --url URL` creates the tables.

The connection is the application's: an asyncpg Connection, or a psycopg 3 Connection or
AsyncConnection (SQLAlchemy: `(await session.connection()).get_raw_connection().driver_connection`
for asyncpg, `session.connection().connection.driver_connection` for psycopg). A task is
checked here as the server checks it, so a bad one raises InvalidArgument inside the
application's transaction and nothing is inserted.
"""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from cronoq.outbox_schema import DEFAULT_SCHEMA, check_schema, insert_sql

from ._text import control_character
from .client import TaskRefLike, task_spec
from .errors import InvalidArgument
from .v1 import task_pb2
from .v1 import task_service_pb2 as pb

__all__ = [
    "DEFAULT_SCHEMA",
    "check_request",
    "enqueue",
    "enqueue_many",
    "enqueue_many_sync",
    "enqueue_sync",
    "task_spec",
]

# The server's bounds on a task's fields (its [limits] defaults where configurable).
MAX_TEXT = 256  # pool, key, content_type: characters; group_key: UTF-8 bytes
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
SCHEDULE_KEY_PREFIX = "schedule:"
MAX_ATTEMPTS = 1000
MAX_TIMEOUT_MS = 604_800_000
MAX_DEBOUNCE_MS = 604_800_000
MAX_KEY_TTL_MS = 31_622_400_000
MIN_TIMESTAMP_S, MAX_TIMESTAMP_S = -62_135_596_800, 253_402_300_799


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(message)


def _check_text(field: str, value: str, in_bytes: bool = False) -> None:
    size = len(value.encode()) if in_bytes else len(value)
    if size > MAX_TEXT:
        raise _invalid(f"{field}: {size} {'bytes' if in_bytes else 'characters'}, more than {MAX_TEXT}: {value[:64]!r}")
    bad = control_character(value)
    if bad is not None:
        raise _invalid(f"{field}: control character {bad!r} in {value[:64]!r}")


def check_request(req: pb.SubmitTaskRequest, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
    """Raises InvalidArgument, naming the field and value, for a task the server would refuse
    whatever its configuration (bar the pool's existence and the payload limit it is given)."""
    if not req.pool:
        raise _invalid("pool: required")
    _check_text("pool", req.pool)
    _check_text("key", req.key)
    if req.key.startswith(SCHEDULE_KEY_PREFIX):
        raise _invalid(f"key: {req.key!r}: keys starting with {SCHEDULE_KEY_PREFIX!r} are reserved for schedules")
    _check_text("content_type", req.content_type)
    _check_text("group_key", req.group_key, in_bytes=True)
    if len(req.payload) > max_payload_bytes:
        raise _invalid(f"payload: {len(req.payload)} bytes exceeds max_payload_bytes {max_payload_bytes}")
    if not 0 <= req.max_attempts <= MAX_ATTEMPTS:
        raise _invalid(f"max_attempts: {req.max_attempts} is not between 0 and {MAX_ATTEMPTS}")
    if not 0 <= req.timeout_ms <= MAX_TIMEOUT_MS:
        raise _invalid(f"timeout_ms: {req.timeout_ms} is not between 0 and {MAX_TIMEOUT_MS}")
    if req.HasField("run_at") and not MIN_TIMESTAMP_S <= req.run_at.seconds <= MAX_TIMESTAMP_S:
        raise _invalid(f"run_at: {req.run_at.seconds} s is outside 0001-01-01 to 9999-12-31")
    if req.run_when not in task_pb2.RunWhen.values():
        raise _invalid(f"run_when: unknown value {req.run_when}")
    _check_key_options(req)
    for i, ref in enumerate(req.depends_on):
        if ref.WhichOneof("ref") == "id" and ref.id == 0:
            raise _invalid(f"depends_on[{i}].id: 0 is not a task id")
        if ref.WhichOneof("ref") == "key":
            _check_text(f"depends_on[{i}].key", ref.key)
        if ref.WhichOneof("ref") is None:
            raise _invalid(f"depends_on[{i}]: give an id or a key")


def _check_key_options(req: pb.SubmitTaskRequest) -> None:
    """The key options the server refuses whatever the pool (what depends on the pool's
    default_key_mode and debounce is left to it)."""
    for field, high in (
        ("debounce_ms", MAX_DEBOUNCE_MS),
        ("max_debounce_ms", MAX_DEBOUNCE_MS),
        ("key_ttl_ms", MAX_KEY_TTL_MS),
    ):
        if not 0 <= getattr(req, field) <= high:
            raise _invalid(f"{field}: {getattr(req, field)} is not between 0 and {high}")
    if req.key_mode not in task_pb2.KeyMode.values():
        raise _invalid(f"key_mode: unknown value {req.key_mode}")
    replacing = req.key_mode > task_pb2.KEY_MODE_RETURN_EXISTING
    if not req.key:
        for field, value in (
            ("key_mode", replacing),
            ("key_ttl_ms", req.key_ttl_ms),
            ("debounce_ms", req.debounce_ms),
            ("max_debounce_ms", req.max_debounce_ms),
        ):
            if value:
                shown = task_pb2.KeyMode.Name(req.key_mode) if field == "key_mode" else getattr(req, field)
                raise _invalid(f"key: required with {field} {shown}")
    explicit = req.key_mode and req.key_mode != task_pb2.KEY_MODE_DEBOUNCE
    for field in ("debounce_ms", "max_debounce_ms"):
        if explicit and getattr(req, field):
            named = task_pb2.KeyMode.Name(req.key_mode)
            raise _invalid(f"{field}: {getattr(req, field)} applies only with KEY_MODE_DEBOUNCE, not {named}")
    if req.max_debounce_ms and req.debounce_ms and req.max_debounce_ms < req.debounce_ms:
        raise _invalid(f"max_debounce_ms: {req.max_debounce_ms} is less than debounce_ms {req.debounce_ms}")
    if req.key_mode == task_pb2.KEY_MODE_DEBOUNCE and req.HasField("run_at"):
        raise _invalid("run_at: not with KEY_MODE_DEBOUNCE (debounce_ms says when it runs)")
    if req.HasField("start_by"):
        if not MIN_TIMESTAMP_S <= req.start_by.seconds <= MAX_TIMESTAMP_S:
            raise _invalid(f"start_by: {req.start_by.seconds} s is outside 0001-01-01 to 9999-12-31")
        if req.HasField("run_at") and req.start_by.ToMicroseconds() <= req.run_at.ToMicroseconds():
            raise _invalid(f"start_by: {req.start_by.ToJsonString()} is not after run_at {req.run_at.ToJsonString()}")


async def enqueue(
    conn: Any,
    pool: str,
    payload: Any = None,
    *,
    key: str | None = None,
    schema: str = DEFAULT_SCHEMA,
    priority: int = 0,
    run_at: dt.datetime | None = None,
    delay: float | None = None,
    max_attempts: int = 0,
    depends_on: Sequence[TaskRefLike] = (),
    run_when: str | int | None = None,
    resources: Mapping[str, int] | None = None,
    timeout: float | None = None,
    group_key: str | None = None,
    key_mode: str | int | None = None,
    debounce_ms: int = 0,
    max_debounce_ms: int = 0,
    key_ttl_ms: int = 0,
    start_by: dt.datetime | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> int:
    """Inserts one task into the outbox in conn's transaction (the fields are submit's); returns
    the outbox row's id."""
    spec = task_spec(
        pool, payload, key=key, priority=priority, run_at=run_at, delay=delay, max_attempts=max_attempts,
        depends_on=depends_on, run_when=run_when, resources=resources, timeout=timeout, group_key=group_key,
        trace=None, key_mode=key_mode, debounce_ms=debounce_ms, max_debounce_ms=max_debounce_ms,
        key_ttl_ms=key_ttl_ms, start_by=start_by,
    )  # fmt: skip
    (row_id,) = await enqueue_many(conn, [spec], schema=schema, max_payload_bytes=max_payload_bytes)
    return row_id


async def enqueue_many(
    conn: Any,
    tasks: Sequence[pb.SubmitTaskRequest],
    *,
    schema: str = DEFAULT_SCHEMA,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> list[int]:
    """Inserts these tasks (cronoq.task_spec(...) each) into the outbox in conn's transaction,
    all or none, in one statement; returns the outbox rows' ids, in order. Each is checked first:
    one the server would refuse raises InvalidArgument naming it, and nothing is inserted."""
    pools, requests = _rows(tasks, schema, max_payload_bytes)
    if not pools:
        return []
    if type(conn).__module__.startswith("asyncpg"):
        return [r[0] for r in await conn.fetch(insert_sql(schema), pools, requests)]
    cursor = _psycopg(conn).execute(insert_sql(schema, "%s"), (pools, requests))
    if inspect.isawaitable(cursor):  # a psycopg AsyncConnection
        cursor = await cursor
        return [r[0] for r in await cursor.fetchall()]
    return [r[0] for r in cursor.fetchall()]


def enqueue_many_sync(
    conn: Any,
    tasks: Sequence[pb.SubmitTaskRequest],
    *,
    schema: str = DEFAULT_SCHEMA,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> list[int]:
    """enqueue_many for a psycopg 3 (sync) Connection."""
    pools, requests = _rows(tasks, schema, max_payload_bytes)
    if not pools:
        return []
    return [r[0] for r in _psycopg(conn).execute(insert_sql(schema, "%s"), (pools, requests)).fetchall()]


def enqueue_sync(conn: Any, pool: str, payload: Any = None, *, schema: str = DEFAULT_SCHEMA, **fields: Any) -> int:
    """enqueue for a psycopg 3 (sync) Connection (the same keyword fields)."""
    max_payload_bytes = fields.pop("max_payload_bytes", DEFAULT_MAX_PAYLOAD_BYTES)
    spec = task_spec(pool, payload, trace=None, **fields)
    (row_id,) = enqueue_many_sync(conn, [spec], schema=schema, max_payload_bytes=max_payload_bytes)
    return row_id


def _rows(tasks: Sequence[pb.SubmitTaskRequest], schema: str, max_payload_bytes: int) -> tuple[list[str], list[bytes]]:
    """The (pools, serialized requests) to insert, each task checked first."""
    try:
        check_schema(schema)
    except ValueError as err:
        raise _invalid(str(err)) from None
    for i, req in enumerate(tasks):
        try:
            check_request(req, max_payload_bytes)
        except InvalidArgument as err:
            raise _invalid(f"tasks[{i}].{err.message}") from None
        if req.request_id:
            raise _invalid(f"tasks[{i}].request_id: set by the relay (the outbox row's id); leave it empty")
    return [t.pool for t in tasks], [t.SerializeToString() for t in tasks]


def _psycopg(conn: Any) -> Any:
    if not type(conn).__module__.startswith("psycopg"):
        raise TypeError(f"conn: an asyncpg or psycopg 3 connection, not {type(conn).__module__}.{type(conn).__name__}")
    return conn
