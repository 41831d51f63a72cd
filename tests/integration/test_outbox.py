"""Transactional enqueue through real servers and a real PostgreSQL as the application's database:
`cronoq outbox install`, cronoq.outbox.enqueue in asyncpg and psycopg transactions (a rollback
leaves no task, a commit gives exactly one, soon), poison rows moved to the dead table without
holding up the rows behind them, polling with notify = false, a relay whose step dies after
submitting and before deleting submits nothing twice, and the leader SIGKILLed mid-relay of
5,000 rows: every committed task once, the outbox empty."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from typing import Any

import asyncpg
import pytest
from _helpers import eventually
from test_failover import is_leader, start_replicas

import cronoq
import cronoq.outbox
from cronoq.v1 import task_service_pb2 as tpb


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def install(url: str, schema: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cronoq.cli", "outbox", "install", "--url", url, "--schema", schema, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)


def outbox_config(pg: Any, schema: str, store: dict[str, Any] | None = None, **outbox: Any) -> dict[str, Any]:
    return {
        "store": store or {"kind": "postgres", "url": pg.url, "schema": f"st_{uuid.uuid4().hex[:10]}"},
        "pools": [{"name": "default", "lease_ttl": "30s"}, {"name": "other"}],
        "outboxes": [{"url": pg.url, "schema": schema, "pools": ["default"], **outbox}],
    }


async def fetch(url: str, sql: str, *args: Any) -> list[Any]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def execute(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def task_keys(srv: Any) -> list[str]:
    async def keys() -> list[str]:
        async with cronoq.Client(srv.endpoint) as client:
            return [t.key async for t in client.iter_tasks(pool="default")]

    return run(keys())


@pytest.fixture
def schema() -> str:
    return f"ob_{uuid.uuid4().hex[:10]}"


def test_install_is_idempotent_and_prints_its_ddl(postgres: Any, schema: str) -> None:
    first = install(postgres.url, schema, "--json")
    assert json.loads(first.stdout)["version"] == 1
    install(postgres.url, schema)  # again: nothing changes
    printed = install(postgres.url, schema, "--print").stdout
    assert f'CREATE TABLE IF NOT EXISTS "{schema}".cronoq_outbox (' in printed
    bad = subprocess.run(
        [sys.executable, "-m", "cronoq.cli", "outbox", "install", "--print", "--schema", "x; DROP TABLE t"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "schema" in bad.stderr


def test_a_committed_task_runs_once_and_a_rolled_back_one_never(start_server: Any, postgres: Any, schema: str) -> None:
    install(postgres.url, schema)
    srv = start_server(outbox_config(postgres, schema))

    async def app() -> float:
        conn = await asyncpg.connect(postgres.url)
        try:
            await conn.execute(f'CREATE TABLE "{schema}".orders (id int PRIMARY KEY)')
            tx = conn.transaction()
            await tx.start()
            await conn.execute(f'INSERT INTO "{schema}".orders VALUES (1)')
            await cronoq.outbox.enqueue(conn, "default", {"order": 1}, key="order-1", schema=schema)
            await tx.rollback()
            async with conn.transaction():
                await conn.execute(f'INSERT INTO "{schema}".orders VALUES (2)')
                await cronoq.outbox.enqueue(conn, "default", {"order": 2}, key="order-2", schema=schema)
            committed = time.monotonic()
            async with cronoq.Client(srv.endpoint) as client:
                while True:
                    try:
                        await client.get("order-2")
                        return time.monotonic() - committed
                    except cronoq.errors.NotFound:
                        await asyncio.sleep(0.005)
        finally:
            await conn.close()

    took = run(app())
    assert took < 1.0, f"the committed task appeared {took:.3f}s after the commit"
    time.sleep(0.5)
    assert task_keys(srv) == ["order-2"]
    status, snap = srv.http("GET", "/v1/snapshot")
    assert status == 200 and snap["shards"][0]["outboxes"] == [
        {
            "name": schema,
            "schema": schema,
            "pending": "0",
            "lag_seconds": 0.0,
            "relayed": "1",
            "dead": "0",
            "last_error": "",
        }
    ], snap
    shown = subprocess.run(
        [sys.executable, "-m", "cronoq.cli", "--endpoint", srv.endpoint, "snapshot"], capture_output=True, text=True
    )
    assert f"outbox {schema}: 0 waiting, oldest 0.000 s; relayed 1, dead 0" in shown.stdout, shown
    assert run(fetch(postgres.url, f'SELECT count(*) FROM "{schema}".cronoq_outbox'))[0][0] == 0


def test_psycopg_connections_enqueue_too(start_server: Any, postgres: Any, schema: str) -> None:
    import psycopg  # a test dependency (noxfile TEST_DEPS)

    install(postgres.url, schema)
    srv = start_server(outbox_config(postgres, schema))
    with psycopg.connect(postgres.url) as conn:
        with conn.transaction():
            cronoq.outbox.enqueue_sync(conn, "default", {"n": 1}, key="sync-1", schema=schema)

    async def async_conn() -> None:
        async with await psycopg.AsyncConnection.connect(postgres.url) as conn:
            async with conn.transaction():
                await cronoq.outbox.enqueue(conn, "default", {"n": 2}, key="async-1", schema=schema)

    run(async_conn())
    eventually(lambda: sorted(task_keys(srv)) == ["async-1", "sync-1"], timeout=10, what="both relayed")


def test_a_bad_task_fails_inside_the_transaction(postgres: Any, schema: str) -> None:
    install(postgres.url, schema)

    async def app() -> None:
        conn = await asyncpg.connect(postgres.url)
        try:
            async with conn.transaction():
                with pytest.raises(cronoq.errors.InvalidArgument, match="key: control character"):
                    await cronoq.outbox.enqueue(conn, "default", {}, key="bad\nkey", schema=schema)
                with pytest.raises(cronoq.errors.InvalidArgument, match="max_attempts: 5000"):
                    await cronoq.outbox.enqueue(conn, "default", {}, max_attempts=5000, schema=schema)
            assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".cronoq_outbox') == 0
        finally:
            await conn.close()

    run(app())


def test_poison_rows_go_to_the_dead_table_and_the_rows_behind_them_are_relayed(
    start_server: Any, postgres: Any, schema: str
) -> None:
    install(postgres.url, schema)

    async def insert() -> None:
        conn = await asyncpg.connect(postgres.url)
        try:
            async with conn.transaction():
                await cronoq.outbox.enqueue(conn, "other", {}, key="not-mine", schema=schema)
                await conn.execute(
                    f'INSERT INTO "{schema}".cronoq_outbox (pool, request) VALUES ($1, $2)', "default", b"\xff\x00junk"
                )
                big = tpb.SubmitTaskRequest(pool="default", key="huge", payload=b"x" * 5000)
                await cronoq.outbox.enqueue_many(conn, [big], schema=schema)
                await cronoq.outbox.enqueue(conn, "default", {}, key="fine", schema=schema)
        finally:
            await conn.close()

    run(insert())
    config = outbox_config(postgres, schema)
    config["limits"] = {"max_payload_bytes": 4096}
    srv = start_server(config)
    eventually(lambda: task_keys(srv) == ["fine"], timeout=10, what="the good row relayed")
    dead = eventually(
        lambda: run(fetch(postgres.url, f'SELECT id, pool, reason FROM "{schema}".cronoq_outbox_dead ORDER BY id')),
        what="dead rows",
    )
    reasons = [r["reason"] for r in dead]
    assert len(reasons) == 3, reasons
    assert "'other' is not one of outbox" in reasons[0]
    assert "not a serialized cronoq.v1.SubmitTaskRequest" in reasons[1]
    assert reasons[2].startswith("INVALID_ARGUMENT: payload: 5000 bytes exceeds limits.max_payload_bytes 4096")
    assert run(fetch(postgres.url, f'SELECT count(*) FROM "{schema}".cronoq_outbox'))[0][0] == 0
    status = subprocess.run(
        [sys.executable, "-m", "cronoq.cli", "--json", "outbox", "status", "--url", postgres.url, "--schema", schema],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(status.stdout) | {"lag_seconds": 0} == {
        "schema": schema, "pending": 0, "lag_seconds": 0, "dead": 3, "version": 1
    }  # fmt: skip


def test_polling_without_notify(start_server: Any, postgres: Any, schema: str) -> None:
    install(postgres.url, schema)
    srv = start_server(outbox_config(postgres, schema, notify=False, poll_interval="100ms"))

    async def app() -> float:
        conn = await asyncpg.connect(postgres.url)
        try:
            async with conn.transaction():
                await cronoq.outbox.enqueue(conn, "default", {}, key="polled", schema=schema)
            committed = time.monotonic()
            async with cronoq.Client(srv.endpoint) as client:
                while True:
                    try:
                        await client.get("polled")
                        return time.monotonic() - committed
                    except cronoq.errors.NotFound:
                        await asyncio.sleep(0.01)
        finally:
            await conn.close()

    assert run(app()) < 1.0
    assert "by polling alone, every 0.1s" in srv.log()


def test_a_step_that_dies_after_submitting_submits_nothing_twice(start_server: Any, postgres: Any, schema: str) -> None:
    """The outbox's DELETE fails once (a trigger raises), as if the relay died after submitting:
    the step is rolled back and taken again, and each row's task exists once."""
    install(postgres.url, schema)
    run(
        execute(
            postgres.url,
            # nextval is not rolled back with the failed step: the first DELETE fails, no other.
            f"""CREATE SEQUENCE "{schema}".fault;
            CREATE FUNCTION "{schema}".fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN IF nextval('"{schema}".fault') = 1 THEN
                RAISE EXCEPTION 'injected: the relay died before its delete';
            END IF; RETURN OLD; END $$;
            CREATE TRIGGER fail_once BEFORE DELETE ON "{schema}".cronoq_outbox
                FOR EACH STATEMENT EXECUTE FUNCTION "{schema}".fail_once()""",
        )
    )

    async def insert() -> None:
        conn = await asyncpg.connect(postgres.url)
        try:
            async with conn.transaction():
                specs = [cronoq.task_spec("default", {"i": i}) for i in range(20)]  # no keys: no deduplication
                await cronoq.outbox.enqueue_many(conn, specs, schema=schema)
        finally:
            await conn.close()

    run(insert())
    srv = start_server(outbox_config(postgres, schema, poll_interval="100ms"))
    eventually(
        lambda: run(fetch(postgres.url, f'SELECT count(*) FROM "{schema}".cronoq_outbox'))[0][0] == 0,
        timeout=15,
        what="the outbox emptied",
    )
    assert run(fetch(postgres.url, f'SELECT last_value FROM "{schema}".fault'))[0][0] >= 2  # it failed once

    async def payloads() -> list[Any]:
        async with cronoq.Client(srv.endpoint) as client:
            return [cronoq.payload_of(t)["i"] async for t in client.iter_tasks(pool="default")]

    assert sorted(run(payloads())) == list(range(20))
    assert "injected: the relay died before its delete" in srv.log()


def test_sigkill_the_leader_mid_relay_of_5000_rows(start_server: Any, postgres: Any, schema: str) -> None:
    install(postgres.url, schema)
    servers = start_replicas(start_server, outbox_config(postgres, schema, batch=200), n=2)
    total, per_tx = 5000, 50

    async def app() -> None:
        conn = await asyncpg.connect(postgres.url)
        try:
            for start in range(0, total, per_tx):
                async with conn.transaction():
                    specs = [cronoq.task_spec("default", {}, key=f"k-{i}") for i in range(start, start + per_tx)]
                    await cronoq.outbox.enqueue_many(conn, specs, schema=schema)
        finally:
            await conn.close()

    run(app())

    def pending() -> int:
        return int(run(fetch(postgres.url, f'SELECT count(*) FROM "{schema}".cronoq_outbox'))[0][0])

    eventually(lambda: pending() < total * 2 // 3, timeout=30, interval=0.01, what="a third relayed")
    servers[0].kill()
    eventually(lambda: is_leader(servers[1]), timeout=10, interval=0.02, what="the standby leads")
    eventually(lambda: pending() == 0, timeout=60, interval=0.2, what="the outbox emptied")
    keys = task_keys(servers[1])
    assert len(keys) == total and set(keys) == {f"k-{i}" for i in range(total)}


def test_an_outbox_not_installed_is_a_warning_in_the_log_and_the_snapshot(start_server: Any, postgres: Any) -> None:
    srv = start_server(outbox_config(postgres, "never_installed", poll_interval="100ms"))
    eventually(lambda: "outbox never_installed:" in srv.log(), timeout=10, what="the warning")
    assert "Traceback" not in srv.log()
    status, snap = srv.http("GET", "/v1/snapshot")
    assert (
        status == 200
        and 'relation "never_installed.cronoq_outbox_meta" does not exist'
        in (snap["shards"][0]["outboxes"][0]["last_error"])
    ), snap
