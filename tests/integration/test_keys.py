"""Key modes, start deadlines and retention through real cronoq-server processes, on SQLite and
PostgreSQL, over HTTP (the JSON names: key_mode, debounce_ms, max_debounce_ms, key_ttl_ms,
start_by) and the Python SDK: a replace and a debounce burst keep one task with the last
payload, a Watch event says replaced, a key held for a period is free after it, bad options
are refused naming the field and change nothing; a task not started by its start_by ends
EXPIRED while workers run, and one that started is never expired; retention purges ended tasks
while workers run, never a pending or running one."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _helpers import cli, eventually, log_lines, start_worker, store_table

import cronoq


@pytest.fixture(params=["sqlite", "postgres"])
def srv(request: pytest.FixtureRequest, start_server: Any, tmp_path: Path) -> Any:
    return start_server(
        {
            "store": store_table(request.param, request, tmp_path / "cronoq.db"),
            "pools": [
                {"name": "default", "lease_ttl": "30s"},
                {"name": "burst", "default_key_mode": "debounce", "debounce": "300ms"},
                {"name": "short", "retention": "1s", "retention_failed": "1h"},
            ],
        }
    )


def submit(srv: Any, **body: Any) -> tuple[int, Any]:
    return srv.http("POST", "/v1/tasks", {"pool": "default", **body})


def later(ms: int) -> str:
    return (dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=ms)).isoformat().replace("+00:00", "Z")


def test_replace_pending_over_http_keeps_one_task_with_the_last_payload(srv: Any) -> None:
    status, first = submit(srv, key="r", payload_json={"v": 1}, priority=1)
    assert status == 200 and first["deduplicated"] is False
    status, again = submit(srv, key="r", payload_json={"v": 2}, priority=5, key_mode="KEY_MODE_REPLACE_PENDING")
    assert status == 200, again
    assert (again["replaced"], again["deduplicated"], again["task"]["id"]) == (True, False, first["task"]["id"])
    status, got = srv.http("GET", "/v1/keys/r")
    assert got["task"]["payload_json"] == {"v": 2} and got["task"]["priority"] == 5
    status, plain = submit(srv, key="r", payload_json={"v": 3})
    assert plain["deduplicated"] is True and plain.get("replaced", False) is False
    assert srv.http("GET", "/v1/keys/r")[1]["task"]["payload_json"] == {"v": 2}


def test_a_debounce_burst_is_one_task_due_after_the_last_submission(srv: Any) -> None:
    ids = set()
    for i in range(20):
        status, body = submit(srv, key="d", payload_json={"i": i}, key_mode="KEY_MODE_DEBOUNCE", debounce_ms=60_000)
        assert status == 200, body
        ids.add(body["task"]["id"])
        last = body
    assert len(ids) == 1 and last["replaced"] is True
    due = dt.datetime.fromisoformat(last["task"]["run_at"].replace("Z", "+00:00"))
    assert due > dt.datetime.now(dt.UTC) + dt.timedelta(seconds=50)
    status, got = srv.http("GET", "/v1/keys/d")
    assert got["task"]["state"] == "TASK_STATE_PENDING" and got["task"]["payload_json"] == {"i": 19}


def test_max_debounce_bounds_the_due_time(srv: Any) -> None:
    body = {"key": "m", "key_mode": "KEY_MODE_DEBOUNCE", "debounce_ms": 60_000, "max_debounce_ms": 60_000}
    first = submit(srv, **body)[1]
    time.sleep(0.05)
    again = submit(srv, **body)[1]
    assert again["task"]["run_at"] == first["task"]["run_at"]  # capped at created + max_debounce_ms


def test_a_pools_default_key_mode_debounces(srv: Any) -> None:
    first = submit(srv, pool="burst", key="b", payload_json=1)[1]
    again = submit(srv, pool="burst", key="b", payload_json=2)[1]
    assert again["replaced"] is True and again["task"]["id"] == first["task"]["id"]
    explicit = submit(srv, pool="burst", key="b", payload_json=3, key_mode="KEY_MODE_RETURN_EXISTING")[1]
    assert explicit["deduplicated"] is True


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"key": "x", "key_mode": "KEY_MODE_DEBOUNCE"}, "debounce_ms"),
        ({"key_mode": "KEY_MODE_REPLACE_PENDING"}, "key"),
        ({"key_ttl_ms": 1000}, "key"),
        ({"key": "x", "debounce_ms": 100}, "debounce_ms"),
        ({"key": "x", "key_mode": "KEY_MODE_DEBOUNCE", "debounce_ms": 100, "max_debounce_ms": 50}, "max_debounce_ms"),
        ({"key": "x", "key_mode": "KEY_MODE_DEBOUNCE", "debounce_ms": -1}, "debounce_ms"),
        ({"key": "x", "key_ttl_ms": 10**12}, "key_ttl_ms"),
        ({"key": "x", "key_mode": 9}, "key_mode"),
        ({"key": "x", "key_mode": "KEY_MODE_DEBOUNCE", "debounce_ms": 100, "run_at": later(1000)}, "run_at"),
        ({"run_at": later(5000), "start_by": later(1000)}, "start_by"),
    ],
)
def test_bad_key_options_are_refused_naming_the_field_and_change_nothing(srv: Any, body: Any, field: str) -> None:
    status, err = submit(srv, payload_json="bad", **body)
    assert status == 400, err
    assert err["code"] == "INVALID_ARGUMENT" and err["message"].startswith(f"{field}:"), err
    assert srv.http("GET", "/v1/tasks?pool=default")[1].get("tasks", []) == []


def test_a_key_held_for_a_period_is_free_after_it(srv: Any) -> None:
    async def run() -> None:
        async with cronoq.Client(srv.endpoint) as client:
            first = await client.submit("default", {"n": 1}, key="t", key_ttl_ms=200)
            assert (await client.cancel(first.task.id)).state == cronoq.TaskState.Value("TASK_STATE_CANCELLED")
            held = await client.submit("default", {"n": 2}, key="t")
            assert held.deduplicated and held.task.id == first.task.id
            await asyncio.sleep(0.3)
            fresh = await client.submit("default", {"n": 2}, key="t", key_ttl_ms=200)
            assert not fresh.deduplicated and fresh.task.id != first.task.id
            assert (await client.get("t")).id == fresh.task.id
            old = await client.get(first.task.id)
            assert (old.key, old.key_ttl_ms) == ("t", 200)

    asyncio.run(run())


def test_a_watch_event_says_a_task_was_replaced(srv: Any) -> None:
    async def run() -> None:
        async with cronoq.Client(srv.endpoint) as client:
            first = await client.submit("default", 1, key="w")
            events = client.watch(pool="default")
            seen: list[Any] = []

            async def collect() -> None:
                async for ev in events:
                    seen.append(ev)
                    if ev.replaced:
                        return

            watching = asyncio.create_task(collect())
            await asyncio.sleep(0.5)
            await client.submit("default", 2, key="w", key_mode="replace_pending")
            await asyncio.wait_for(watching, 10)
            replaced = seen[-1]
            assert replaced.task.id == first.task.id
            assert replaced.task.state == cronoq.TaskState.Value("TASK_STATE_PENDING")

    asyncio.run(run())


def test_start_by_races_leases_never_both(srv: Any, tmp_path: Path) -> None:
    """Tasks whose start_by falls while workers lease them: each one either started before its
    start_by (and ran) or never started and ended EXPIRED."""
    log = tmp_path / "worker.log"
    n = 300
    worker = start_worker(srv.endpoint, "default", log, concurrency=4)
    try:
        eventually(lambda: srv.http("GET", "/v1/workers")[1].get("workers"), timeout=30, what="the worker registered")
        specs = [{"pool": "default", "payload_json": {"sleep": 0.02}, "start_by": later(300 + 2 * i)} for i in range(n)]
        status, body = srv.http("POST", "/v1/batches", {"tasks": specs})
        assert status == 200, body
        ids = [t["id"] for t in body["tasks"]]

        def ended() -> list[Any]:
            tasks = [srv.http("GET", f"/v1/tasks/{i}")[1]["task"] for i in ids]
            done = {"TASK_STATE_SUCCEEDED", "TASK_STATE_EXPIRED"}
            return tasks if all(t["state"] in done for t in tasks) else []

        tasks = eventually(ended, timeout=60, interval=0.5, what="every task ended")
    finally:
        worker.terminate()
        worker.wait(20)
    started = {task_id for task_id, _, _ in log_lines(log, "start")}
    expired = [t for t in tasks if t["state"] == "TASK_STATE_EXPIRED"]
    assert expired and len(expired) < n, "the race was not run: widen the start_by spread"
    for t in tasks:
        start_by = dt.datetime.fromisoformat(t["start_by"].replace("Z", "+00:00"))
        if t["state"] == "TASK_STATE_EXPIRED":
            assert int(t["id"]) not in started and t["attempt"] == 0 and "start_by" in t["error"]
        else:
            assert dt.datetime.fromisoformat(t["started_at"].replace("Z", "+00:00")) < start_by


def test_retention_purges_ended_tasks_while_workers_run_never_a_live_one(srv: Any, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    worker = start_worker(srv.endpoint, "short", log, concurrency=4)
    try:
        quick = [
            srv.http("POST", "/v1/tasks", {"pool": "short", "payload_json": {}})[1]["task"]["id"] for _ in range(30)
        ]
        failed = srv.http("POST", "/v1/tasks", {"pool": "short", "payload_json": {"fail_until": 99}, "max_attempts": 1})
        slow = srv.http("POST", "/v1/tasks", {"pool": "short", "payload_json": {"sleep": 6}})[1]["task"]["id"]
        later_one = srv.http("POST", "/v1/tasks", {"pool": "short", "run_at": later(60_000)})[1]["task"]["id"]
        eventually(
            lambda: all(srv.http("GET", f"/v1/tasks/{i}")[0] == 404 for i in quick),
            timeout=30,
            what="quick tasks purged",
        )
        assert srv.http("GET", f"/v1/tasks/{slow}")[1]["task"]["state"] == "TASK_STATE_RUNNING"
        assert srv.http("GET", f"/v1/tasks/{later_one}")[1]["task"]["state"] == "TASK_STATE_PENDING"
        kept = srv.http("GET", f"/v1/tasks/{failed[1]['task']['id']}")[1]["task"]  # retention_failed: 1h
        assert kept["state"] == "TASK_STATE_FAILED"
        with urllib.request.urlopen(srv.http_url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert re.search(r"^cronoq_tasks_purged_total (\d+)", metrics, re.M), metrics
        assert int(float(re.search(r"^cronoq_tasks_purged_total (\S+)", metrics, re.M)[1])) >= 30  # type: ignore[index]
    finally:
        worker.terminate()
        worker.wait(20)


def test_the_cli_submits_with_key_options(srv: Any) -> None:
    first = json.loads(cli(srv, "--json", "submit", "--key", "c", "--key-mode", "debounce", "--debounce", "1m").stdout)
    again = cli(srv, "--json", "submit", "--key", "c", "--key-mode", "debounce", "--debounce", "1m",
                "--max-debounce", "1h", "--key-ttl", "1h", "--start-by", "2h")  # fmt: skip
    replaced = json.loads(again.stdout)
    assert (replaced["replaced"], replaced["id"]) == (True, first["id"])
    shown = cli(srv, "get", "c").stdout
    assert "state=pending" in shown and "start by" not in shown  # the replace keeps the first's deadline (none)
    fresh = cli(srv, "submit", "--key", "d", "--key-ttl", "90s", "--start-by", "2h").stdout
    assert "start by 20" in fresh and "key held 1m30s after it ends" in fresh
    bad = cli(srv, "submit", "--key-mode", "debounce", "--debounce", "1s", check=False)
    assert bad.returncode != 0 and "key: required with key_mode KEY_MODE_DEBOUNCE" in bad.stderr
