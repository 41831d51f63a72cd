"""The outbox relay: tasks an application inserted into `<schema>.cronoq_outbox` in its own
PostgreSQL transactions (cronoq.outbox.enqueue), submitted once each by the shard's leader.

A step, one transaction in the application's database: take up to `batch` committed rows of
this shard's pools in id order (FOR UPDATE SKIP LOCKED: another relay passes them over), submit
each through the normal submit path with the row's id as its request_id (a step that dies
after submitting and before deleting is repeated by the next leader, and each repeat returns
the task the first created), move the rows the server refuses (a field, a pool, a limit) to
`cronoq_outbox_dead` with the reason, and delete the rest. A failure of the store itself
(unavailable, fenced) rolls the step back: its rows are taken again.

The relay is woken by the insert trigger's NOTIFY (at the application's commit), and reads the
outbox every poll_interval anyway (the only wake-up with notify = false, e.g. behind PgBouncer's
transaction pooling). Rows of pools no shard of the outbox serves are moved to the dead table by
any shard's relay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import asyncpg
import grpc

from cronoq.outbox_schema import VERSION, channel, quoted, version_query
from cronoq.v1 import admin_service_pb2 as admin_pb
from cronoq.v1 import task_service_pb2 as pb

from ..auth import Principal
from ..config import Config, OutboxConfig
from ..errors import ApiError
from ..metrics import OUTBOX_DEAD, OUTBOX_LAG, OUTBOX_PENDING, OUTBOX_RELAYED
from ..store.base import StoreUnavailable
from .tasks import Tasks

log = logging.getLogger("cronoq.outbox")

# Refusals of a row itself: it goes to the dead table. Anything else (the store unavailable,
# this server no longer leading) is the relay's: the step is rolled back and taken again.
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
META_INSTALL_ID = "install_id"


class OutboxRelay:
    """One [[outboxes]] entry, relayed by this shard's leader (Periodic runs step; notify pokes it)."""

    def __init__(self, config: Config, outbox: OutboxConfig, tasks: Tasks, shard_pools: list[str]):
        self.outbox = outbox
        self.name = outbox.label
        self._tasks = tasks
        self._url = outbox.url or ""
        self._table = f"{quoted(outbox.schema_)}.cronoq_outbox"
        self._dead = f"{quoted(outbox.schema_)}.cronoq_outbox_dead"
        self.mine = [p for p in outbox.pools if p in shard_pools]
        served = {p for s in config.shards for p in s.pools} if config.sharded else {p.name for p in config.pools}
        # The pools some shard's relay takes; a row of any other pool is moved to the dead table by any relay.
        self.taken = sorted(set(outbox.pools) & served)
        self._caller = Principal(f"outbox:{self.name}", frozenset(outbox.pools), frozenset({"submit", "read"}))
        self._conn: asyncpg.Connection | None = None
        self._install_id = ""
        self.poke: Callable[[], None] = lambda: None  # set by the Periodic that runs step
        self.last_error = ""
        self.pending, self.lag_s, self.relayed, self.dead = 0, 0.0, 0, 0  # for the snapshot

    def resolve_url(self, environ: dict[str, str]) -> None:
        if self.outbox.url_env is not None:
            url = environ.get(self.outbox.url_env)
            if not url:
                raise ValueError(f"outboxes: environment variable {self.outbox.url_env!r} is not set")
            self._url = url

    async def _connect(self) -> asyncpg.Connection:
        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        conn = await asyncpg.connect(self._url, timeout=10)
        try:
            version = await conn.fetchval(version_query(self.outbox.schema_))
            if version is None or version > VERSION:
                raise RuntimeError(
                    f"outbox {self.name!r}: its tables are at version {version}, this server knows {VERSION}"
                    " (run `cronoq outbox install` with this release)"
                )
            meta = f"{quoted(self.outbox.schema_)}.cronoq_outbox_meta"
            self._install_id = await conn.fetchval(f"SELECT value FROM {meta} WHERE key = $1", META_INSTALL_ID) or ""
            if self.outbox.notify:
                await conn.add_listener(channel(self.outbox.schema_), lambda *_: self.poke())
        except BaseException:
            await conn.close()
            raise
        self._conn = conn
        wake = "on NOTIFY and" if self.outbox.notify else "by polling alone,"
        log.info(
            "outbox %s: relaying pools %s, %s every %gs",
            self.name,
            ", ".join(self.mine) or "(none)",
            wake,
            self.outbox.poll_interval,
        )
        return conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def step(self) -> float | None:
        """Relays one batch; returns 0 when the batch was full (more may wait), else None."""
        try:
            conn = await self._connect()
            taken = await self._relay(conn)
            await self._measure(conn)
            self.last_error = ""
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, RuntimeError) as err:
            # The application's database away, the tables missing or too new: one warning a step
            # (no traceback), shown in the snapshot until a step succeeds.
            self.last_error = str(err)
            await self.close()
            raise StoreUnavailable(f"outbox {self.name}: {err}") from None
        return 0.0 if taken >= self.outbox.batch else None

    async def _relay(self, conn: asyncpg.Connection) -> int:
        async with conn.transaction():
            rows = await conn.fetch(
                f"SELECT id, pool, request, created_at FROM {self._table}"
                " WHERE pool = ANY($1::text[]) OR pool <> ALL($2::text[])"
                " ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED",
                self.mine,
                self.taken,
                self.outbox.batch,
            )
            if not rows:
                return 0
            outcomes = await asyncio.gather(*(self._submit(r) for r in rows))
            dead = [(r, why) for r, why in zip(rows, outcomes, strict=True) if why is not None]
            if dead:
                await conn.execute(
                    f"INSERT INTO {self._dead} (id, pool, request, created_at, reason)"
                    " SELECT * FROM unnest($1::bigint[], $2::text[], $3::bytea[], $4::timestamptz[], $5::text[])"
                    " ON CONFLICT (id) DO NOTHING",
                    [r["id"] for r, _ in dead],
                    [r["pool"] for r, _ in dead],
                    [r["request"] for r, _ in dead],
                    [r["created_at"] for r, _ in dead],
                    [why for _, why in dead],
                )
                for r, why in dead:
                    log.warning("outbox %s: row %d moved to %s: %s", self.name, r["id"], self._dead, why)
            await conn.execute(f"DELETE FROM {self._table} WHERE id = ANY($1::bigint[])", [r["id"] for r in rows])
        OUTBOX_RELAYED.labels(self.name).inc(len(rows) - len(dead))
        OUTBOX_DEAD.labels(self.name).inc(len(dead))
        self.relayed += len(rows) - len(dead)
        self.dead += len(dead)
        return len(rows)

    async def _submit(self, row: Any) -> str | None:
        """Submits one row; returns why the server refused it (None: submitted or deduplicated)."""
        if row["pool"] not in self.mine:
            return f"pool {row['pool']!r} is not one of outbox {self.name!r}'s pools ({', '.join(self.outbox.pools)})"
        req = pb.SubmitTaskRequest()
        try:
            req.ParseFromString(row["request"])
        except Exception as err:  # protobuf's DecodeError
            return f"request: not a serialized cronoq.v1.SubmitTaskRequest ({err})"
        if req.pool != row["pool"]:
            return f"request.pool {req.pool!r} is not the row's pool {row['pool']!r}"
        req.request_id = f"outbox-{self._install_id}-{row['id']}"
        try:
            await self._tasks.submit_task(req, self._caller)
        except ApiError as err:
            if err.code in REFUSALS:
                return f"{err.code.name}: {err.message}"
            raise
        return None

    async def _measure(self, conn: asyncpg.Connection) -> None:
        row = await conn.fetchrow(
            f"SELECT count(*), extract(epoch FROM clock_timestamp() - min(created_at)) FROM {self._table}"
            " WHERE pool = ANY($1::text[])",
            self.mine,
        )
        self.pending, self.lag_s = row[0], float(row[1] or 0.0)
        OUTBOX_PENDING.labels(self.name).set(self.pending)
        OUTBOX_LAG.labels(self.name).set(self.lag_s)

    def status(self) -> admin_pb.OutboxStatus:
        """As the last step saw it, for the snapshot."""
        return admin_pb.OutboxStatus(
            name=self.name,
            schema=self.outbox.schema_,
            pending=self.pending,
            lag_seconds=self.lag_s,
            relayed=self.relayed,
            dead=self.dead,
            last_error=self.last_error,
        )
