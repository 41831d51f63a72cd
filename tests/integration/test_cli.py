"""The `cronoq` CLI against a real server: every command, --help, --json.

Schedules and watch's resumption need server features of their own: see
test_cli_server_features.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _helpers import Api, Watcher, cli

from cronoq.v1 import worker_service_pb2 as wpb

COMMANDS = [
    "submit",
    "get",
    "wait",
    "cancel",
    "tasks",
    "watch",
    "workers",
    "schedules put",
    "schedules delete",
    "schedules list",
    "snapshot",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    out = subprocess.run(
        [sys.executable, "-m", "cronoq.cli", *command.split(), "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--endpoint" in out.stdout and "--json" in out.stdout
    description = out.stdout.split("\n\n")[1]  # after the usage
    assert not description.startswith(("options:", "positional arguments:")), out.stdout


def test_schedules_help_lists_its_subcommands():
    out = subprocess.run([sys.executable, "-m", "cronoq.cli", "schedules", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and all(word in out.stdout for word in ("put", "delete", "list"))


def test_submit_get_wait_cancel_tasks_with_json(server):
    sub = json.loads(
        cli(server, "submit", "--pool", "default", "--payload-json", '{"n": 1}', "--key", "cli-1", "--json").stdout
    )
    assert sub["key"] == "cli-1" and sub["payload_json"] == {"n": 1} and sub["deduplicated"] is False
    again = json.loads(cli(server, "submit", "--pool", "default", "--key", "cli-1", "--json").stdout)
    assert again["id"] == sub["id"] and again["deduplicated"] is True
    got = json.loads(cli(server, "get", "cli-1", "--json").stdout)
    assert got["id"] == sub["id"]
    waited = cli(server, "wait", sub["id"], "--timeout", "0.2", "--json", check=False)
    assert waited.returncode == 3 and json.loads(waited.stdout)["done"] is False
    cancelled = json.loads(cli(server, "cancel", sub["id"], "--json").stdout)
    assert cancelled["state"] == "TASK_STATE_CANCELLED"
    listed = [json.loads(line) for line in cli(server, "tasks", "--state", "cancelled", "--json").stdout.splitlines()]
    assert [t["id"] for t in listed] == [sub["id"]]
    human = cli(server, "get", sub["id"]).stdout
    assert f"task {sub['id']}" in human and "state=cancelled" in human


def test_errors_are_one_line_with_the_code(server):
    out = cli(server, "get", "999", check=False)
    assert out.returncode == 1
    assert out.stderr.strip() == "cronoq get: NOT_FOUND: task 999 not found"
    out = cli(server, "submit", "--pool", "nope", check=False)
    assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr and "'nope'" in out.stderr
    assert "Traceback" not in out.stderr


def test_workers_table_and_json(server):
    api = Api(server.grpc_target)
    worker_id = api.register(pools=("default", "other"))
    table = cli(server, "workers").stdout.splitlines()
    assert table[0].split() == ["ID", "NAME", "POOLS", "CONCURRENCY", "RUNNING", "LAST", "HEARTBEAT"]
    row = next(line for line in table if line.startswith(worker_id))
    assert row.split()[1:5] == ["t", "default,other", "10", "0"] and row.endswith("s ago")
    listed = [json.loads(line) for line in cli(server, "workers", "--json").stdout.splitlines()]
    assert [(w["id"], w["pools"], w["concurrency"]) for w in listed] == [(worker_id, ["default", "other"], 10)]
    assert "last_seen_at" in listed[0] and "running" in listed[0]
    assert cli(server, "workers", "--pool", "default", "--json").stdout.strip()
    api.workers.DeregisterWorker(wpb.DeregisterWorkerRequest(worker_id=worker_id))
    assert cli(server, "workers", "--json").stdout == ""


def test_snapshot_counts_tasks_by_pool_and_state(server):
    api = Api(server.grpc_target)
    ids = [api.submit(key=f"snap-{i}").id for i in range(4)]
    api.submit("other")
    cli(server, "cancel", str(ids[0]))
    worker = api.register()
    leased = api.lease(worker, n=2)
    api.succeed(worker, leased[0])
    snap = json.loads(cli(server, "snapshot", "--json").stdout)
    assert snap["unavailable_shards"] == [] and len(snap["shards"]) == 1
    shard = snap["shards"][0]
    pools = {p["pool"]: p for p in shard["pools"]}
    counts = {state: int(pools["default"][state]) for state in ("pending", "running", "succeeded", "cancelled")}
    assert counts == {"pending": 1, "running": 1, "succeeded": 1, "cancelled": 1}
    assert int(pools["other"]["pending"]) == 1 and [w["id"] for w in shard["workers"]] == [worker]

    lines = cli(server, "snapshot").stdout.splitlines()
    assert lines[0].startswith(f"shard {shard['shard']} (#{shard['number']})  leader {shard['leader']}  term ")
    assert lines[1].split() == ["POOL", "PENDING", "BLOCKED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]
    assert next(line for line in lines if line.split()[0] == "default").split()[1:] == ["1", "0", "1", "1", "0", "1"]
    assert lines[-1].startswith("  workers: 1, running ")  # running: 1 once the server counts it


def test_watch_json_prints_live_events_one_per_line_until_ctrl_c(server, tmp_path):
    api = Api(server.grpc_target)
    watcher = Watcher(server, tmp_path / "watch.err", "--pool", "default")
    try:
        watcher.wait_connected(api)
        ids = [api.submit(key=f"w-{i}", payload=b'{"n": 1}', content_type="application/json").id for i in range(3)]
        api.submit("other")  # another pool: not shown
        watcher.wait_created(ids)
        worker = api.register()
        (task,) = api.lease(worker, n=1)
        api.succeed(worker, task)

        def finished(lines: list[str]) -> bool:
            return any(json.loads(line)["task"]["state"] == "TASK_STATE_SUCCEEDED" for line in lines)

        watcher.reader.wait_for(finished, what="the SUCCEEDED event")
        events = watcher.events()
        assert {e["task"]["pool"] for e in events} == {"default"}
        mine = [(e["task"]["id"], e["task"]["state"]) for e in events if e["task"]["id"] in {str(i) for i in ids}]
        assert mine[:3] == [(str(i), "TASK_STATE_PENDING") for i in ids]
        leased = [e["task"]["state"] for e in events if e["task"]["id"] == str(task.id)]  # maybe a probe task
        assert leased[-2:] == ["TASK_STATE_RUNNING", "TASK_STATE_SUCCEEDED"]
        assert all({"time", "shard", "seq", "cursor"} <= e.keys() for e in events)
        assert "payload" not in {k for e in events for k, v in e["task"].items() if v}  # no --include-payloads
        assert watcher.interrupt() == 130
        assert "Traceback" not in watcher.stderr()
    finally:
        watcher.kill()


def test_watch_prints_a_readable_line_per_event(server, tmp_path):
    api = Api(server.grpc_target)
    watcher = Watcher(server, tmp_path / "watch.err", as_json=False)
    try:
        watcher.wait_connected(api, pool="other")
        task = api.submit(key="readable")
        line = watcher.reader.wait_for(lambda lines: next((x for x in lines if x.endswith(" readable")), None))
        fields = line.split()
        assert fields[1:] == [str(task.id), "default", "pending", f"0/{task.max_attempts}", "readable"]
        assert fields[0].startswith(task.created_at.ToDatetime().date().isoformat())
    finally:
        watcher.kill()


def test_watch_without_a_server_gives_up_with_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "cronoq.cli", "watch", "--endpoint", "http://127.0.0.1:1", "--retry-for", "0.5"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].startswith("cronoq watch: UNAVAILABLE: ")


def test_submit_with_resources_and_a_timeout(start_server):
    srv = start_server(
        {"pools": [{"name": "default", "timeout": "5s"}], "resources": [{"name": "gpu", "concurrency": 2}]}
    )
    task = json.loads(cli(srv, "submit", "--resource", "gpu=1", "--timeout", "2.5", "--json").stdout)
    assert task["resources"] == {"gpu": "1"} and task["timeout_ms"] == "2500"
    capped = json.loads(cli(srv, "submit", "--timeout", "60", "--json").stdout)
    assert capped["timeout_ms"] == "5000"  # the pool's timeout caps it
    out = cli(srv, "submit", "--resource", "gpu=3", check=False)
    assert out.returncode != 0 and "gpu" in out.stderr and "capacity" in out.stderr
