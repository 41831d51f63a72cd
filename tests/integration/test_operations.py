"""The procedures of docs/operations.md, each with real server processes: the PostgreSQL pool
size, the JSON log, backups of a live SQLite store and of a PostgreSQL schema, and the
systemd unit in deploy/systemd."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from _helpers import Api, eventually
from conftest import ServerProcess  # type: ignore[import-not-found]
from test_sharding_faults import fresh_database

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent.parent


def test_postgres_pool_size_bounds_the_leaders_connections(start_server: Any, postgres: Any) -> None:
    """With every query of the server held on a lock, the calls in flight wait for the pool:
    exactly store.pool_size connections of the server wait, whatever the number of calls."""
    url = fresh_database(postgres)
    database = url.rsplit("/", 1)[1]
    srv = start_server({"store": {"kind": "postgres", "url": url, "pool_size": 3}})
    api = Api(srv.grpc_target)
    task = api.submit(payload=b"x")

    query = "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'"

    async def count_waiting_while_locked(threads: concurrent.futures.Executor) -> tuple[int, list[Any]]:
        conn = await asyncpg.connect(url)
        try:
            async with conn.transaction():
                await conn.execute("LOCK TABLE cronoq.tasks IN ACCESS EXCLUSIVE MODE")
                calls = [threads.submit(api.get, task.id) for _ in range(12)]
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and await conn.fetchval(query, database) < 3:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)  # more calls had time to take connections, were there more
                return await conn.fetchval(query, database), calls
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(12) as threads:
        waiting, calls = asyncio.run(count_waiting_while_locked(threads))
        assert [call.result(timeout=30).id for call in calls] == [task.id] * 12
    assert waiting == 3
    assert srv.stop() == 0


def json_lines(srv: Any) -> list[dict[str, Any]]:
    lines = srv.log().splitlines()
    parsed = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all(isinstance(entry, dict) for entry in parsed)
    return parsed


@pytest.mark.parametrize("how", ["config", "flag"])
def test_json_log_is_one_object_a_line_with_the_exception_as_a_field(
    start_server: Any, tmp_path: Path, how: str
) -> None:
    path = tmp_path / "cronoq.db"
    server = {"log_format": "json"} if how == "config" else {}
    srv = ServerProcess(tmp_path, {"server": server, "store": {"path": str(path)}})
    srv.start(wait_ready=False, extra_args=["--log-format", "json"] if how == "flag" else [])
    try:
        srv.wait_ready()
        # A table dropped under the server: the next read fails inside the server and is logged.
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute("DROP TABLE schedules")
        status, _ = srv.http("GET", "/v1/schedules")
        assert status == 500
        eventually(lambda: any("exception" in e for e in json_lines(srv)), what="the failure logged")
    finally:
        assert srv.stop() == 0
    entries = json_lines(srv)
    startup = next(e for e in entries if e["logger"] == "cronoq.server" and "gRPC" in e["message"])
    assert {"time", "level", "logger", "message", "shard"} <= set(startup)
    assert startup["level"] == "INFO" and startup["shard"] == "unsharded"
    assert datetime.datetime.fromisoformat(startup["time"]).tzinfo is not None
    failure = next(e for e in entries if "exception" in e)
    assert failure["level"] == "ERROR"
    assert "Traceback" in failure["exception"] and "schedules" in failure["exception"]
    assert entries[-1]["message"] == "shard unsharded: stopped"
