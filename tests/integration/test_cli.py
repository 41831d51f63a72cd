"""The `cronoq` CLI against a real server: every command, --help, --json.

Schedules and watch's resumption need server features of their own: see
test_cli_server_features.py.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import subprocess
import sys

import pytest
from _helpers import Api, Watcher, cli

from cronoq.v1 import worker_service_pb2 as wpb

EXIT_BAD_INPUT, EXIT_NOT_FOUND, EXIT_PERMISSION, EXIT_UNAVAILABLE, EXIT_FAILED_PRECONDITION = 2, 4, 5, 6, 7

COMMANDS = [
    "submit",
    "get",
    "wait",
    "cancel",
    "retry",
    "delete",
    "tasks",
    "watch",
    "workers",
    "schedules put",
    "schedules delete",
    "schedules list",
    "pools",
    "pools list",
    "pools pause",
    "pools resume",
    "snapshot",
]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def cronoq(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cronoq.cli", *argv], capture_output=True, text=True, timeout=60)


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
    assert out.returncode == EXIT_NOT_FOUND
    assert out.stderr.strip() == "cronoq get: NOT_FOUND: task 999 not found"
    out = cli(server, "submit", "--pool", "nope", check=False)
    assert out.returncode == EXIT_BAD_INPUT and "INVALID_ARGUMENT" in out.stderr and "'nope'" in out.stderr
    assert "Traceback" not in out.stderr


def test_exit_codes_tell_failures_apart(start_server):
    """0 ok, 1 other, 2 usage or bad input, 4 not found, 5 permission, 6 unavailable, 7 failed
    precondition (3 stays `wait`'s timeout): the server's refusals and the CLI's own."""
    srv = start_server(
        {
            "pools": [{"name": "default"}],
            "tokens": [
                {
                    "name": "full",
                    "sha256": sha256("full-secret"),
                    "pools": ["*"],
                    "permissions": ["submit", "read", "cancel", "work"],
                },
                {"name": "reader", "sha256": sha256("read-secret"), "pools": ["*"], "permissions": ["read"]},
            ],
        }
    )
    full = ("--token", "full-secret")
    task = json.loads(cli(srv, "submit", *full, "--json").stdout)

    def code(*argv: str) -> tuple[int, str]:
        out = cli(srv, *argv, check=False)
        assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) <= 1, out.stderr
        return out.returncode, out.stderr.strip()

    assert code("get", task["id"], *full)[0] == 0
    assert code("get", "999", *full) == (EXIT_NOT_FOUND, "cronoq get: NOT_FOUND: task 999 not found")
    assert code("submit", "--pool", "nope", *full)[0] == EXIT_BAD_INPUT  # INVALID_ARGUMENT
    assert code("submit", "--payload-json", "{", *full)[0] == EXIT_BAD_INPUT  # refused before any call
    assert code("get", "1" * 30, *full)[0] == EXIT_BAD_INPUT
    assert code("get", *full)[0] == EXIT_BAD_INPUT  # usage: no ID
    status, line = code("get", task["id"])  # no token
    assert status == EXIT_PERMISSION and line.startswith("cronoq get: UNAUTHENTICATED: ")
    status, line = code("submit", "--token", "read-secret")
    assert status == EXIT_PERMISSION and line.startswith("cronoq submit: PERMISSION_DENIED: ")


def test_help_lists_the_exit_codes():
    out = subprocess.run([sys.executable, "-m", "cronoq.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    epilog = out.stdout[out.stdout.index("exit codes:") :]
    for code, word in (
        (2, "usage"),
        (3, "wait"),
        (4, "NOT_FOUND"),
        (5, "PERMISSION_DENIED"),
        (6, "UNAVAILABLE"),
        (7, "FAILED_PRECONDITION"),
    ):
        assert re.search(rf"^  {code} .*{word}", epilog, flags=re.M), (code, epilog)


def test_global_flags_go_before_or_after_the_command(server):
    task = Api(server.grpc_target).submit(key="global")
    before = cronoq("--endpoint", server.endpoint, "--json", "get", str(task.id))
    after = cronoq("get", str(task.id), "--endpoint", server.endpoint, "--json")
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert json.loads(before.stdout) == json.loads(after.stdout)
    assert json.loads(before.stdout)["key"] == "global"
    # After the command wins over before it; a nested command takes them before either word.
    both = cronoq("--endpoint", "http://127.0.0.1:1", "get", "global", "--endpoint", server.endpoint)
    assert both.returncode == 0 and f"task {task.id}" in both.stdout, both.stderr
    nested = cronoq("--endpoint", server.endpoint, "--json", "schedules", "list")
    assert nested.returncode == 0 and nested.stdout == "", nested.stderr
    for flag in ("--endpoint", "--token", "--ca", "--cert", "--key-file", "--json"):
        assert flag in cronoq("--help").stdout


def test_tasks_prints_a_header_and_pages(server):
    api = Api(server.grpc_target)
    ids = [api.submit(key=f"page-{i}").id for i in range(5)]
    first = cli(server, "tasks", "--limit", "2")
    lines = first.stdout.splitlines()
    assert lines[0].split() == ["ID", "POOL", "STATE", "ATTEMPT", "SHARD", "KEY", "ERROR"]
    assert [int(line.split()[0]) for line in lines[1:]] == ids[:2]
    assert lines[1].split()[1:] == ["default", "pending", "0/3", "0", "page-0", "-"]
    token = re.search(r"^more: run with --page-token (\S+)$", first.stderr, flags=re.M)
    assert token, first.stderr
    second = cli(server, "tasks", "--limit", "2", "--page-token", token.group(1), "--json")
    assert [int(json.loads(line)["id"]) for line in second.stdout.splitlines()] == ids[2:4]
    assert "more: run with --page-token " in second.stderr
    every = cli(server, "tasks", "--all", "--json")
    assert [int(json.loads(line)["id"]) for line in every.stdout.splitlines()] == ids
    assert "more:" not in every.stderr
    last = cli(server, "tasks", "--limit", "10")
    assert len(last.stdout.splitlines()) == 6 and "more:" not in last.stderr and "5 task(s)" in last.stderr
    assert cli(server, "tasks", "--all", "--limit", "3", check=False).returncode == EXIT_BAD_INPUT
    newest = cli(server, "tasks", "--newest-first", "--limit", "3", "--json")
    assert [int(json.loads(line)["id"]) for line in newest.stdout.splitlines()] == ids[:-4:-1]
    token = re.search(r"--page-token (\S+)", newest.stderr)
    assert token, newest.stderr
    older = cli(server, "tasks", "--newest-first", "--page-token", token.group(1), "--json")
    assert [int(json.loads(line)["id"]) for line in older.stdout.splitlines()] == ids[1::-1]


def test_durations_take_a_unit_and_bare_numbers_are_seconds(server):
    task = json.loads(cli(server, "submit", "--timeout", "2500ms", "--delay", "1m", "--json").stdout)
    assert task["timeout_ms"] == "2500"
    run_at = dt.datetime.fromisoformat(task["run_at"].replace("Z", "+00:00"))
    created = dt.datetime.fromisoformat(task["created_at"].replace("Z", "+00:00"))
    assert 55 <= (run_at - created).total_seconds() <= 65
    assert json.loads(cli(server, "submit", "--timeout", "2.5", "--json").stdout)["timeout_ms"] == "2500"
    waited = cli(server, "wait", task["id"], "--timeout", "200ms", "--json", check=False)
    assert waited.returncode == 3 and json.loads(waited.stdout)["done"] is False
    bad = cli(server, "submit", "--timeout", "5x", check=False)
    assert bad.returncode == EXIT_BAD_INPUT and "'5x'" in bad.stderr and "30s" in bad.stderr
    assert cli(server, "wait", task["id"], "--timeout", "-1s", check=False).returncode == EXIT_BAD_INPUT
    for command in ("submit", "wait", "watch", "schedules put"):
        help_text = cronoq(*command.split(), "--help").stdout
        assert "DURATION" in help_text and "SECONDS" not in help_text and "--timeout-ms" not in help_text, command


def test_cancel_of_an_ended_task_says_so(server):
    api = Api(server.grpc_target)
    done = api.submit(key="done")
    worker = api.register()
    (leased,) = api.lease(worker, n=1)
    api.succeed(worker, leased)
    out = cli(server, "cancel", "done", check=False)
    assert out.returncode == EXIT_FAILED_PRECONDITION
    assert out.stderr.strip() == f"cronoq cancel: task {done.id} already SUCCEEDED; nothing to cancel"
    assert "state=succeeded" in out.stdout
    pending = api.submit(key="pending")
    cancelled = cli(server, "cancel", str(pending.id))
    assert cancelled.returncode == 0 and cancelled.stderr == "" and "state=cancelled" in cancelled.stdout
    again = cli(server, "cancel", str(pending.id), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["state"] == "TASK_STATE_CANCELLED"
    assert again.stderr.strip() == f"cronoq cancel: task {pending.id} already CANCELLED; nothing to cancel"


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
    # In "other" (lease_ttl 30s): the task leased stays RUNNING however slow the machine.
    ids = [api.submit("other", key=f"snap-{i}").id for i in range(4)]
    api.submit("default")
    cli(server, "cancel", str(ids[0]))
    worker = api.register(pools=("other",))
    leased = api.lease(worker, n=2)
    api.succeed(worker, leased[0])
    snap = json.loads(cli(server, "snapshot", "--json").stdout)
    assert snap["unavailable_shards"] == [] and len(snap["shards"]) == 1
    shard = snap["shards"][0]
    pools = {p["pool"]: p for p in shard["pools"]}
    counts = {state: int(pools["other"][state]) for state in ("pending", "running", "succeeded", "cancelled")}
    assert counts == {"pending": 1, "running": 1, "succeeded": 1, "cancelled": 1}
    assert int(pools["default"]["pending"]) == 1 and [w["id"] for w in shard["workers"]] == [worker]

    lines = cli(server, "snapshot").stdout.splitlines()
    assert lines[0].startswith(f"shard {shard['shard']} (#{shard['number']})  leader {shard['leader']}  term ")
    assert lines[1].split() == ["POOL", "PENDING", "BLOCKED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]
    assert next(line for line in lines if line.split()[0] == "other").split()[1:] == ["1", "0", "1", "1", "0", "1"]
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
    assert out.returncode == EXIT_UNAVAILABLE and "Traceback" not in out.stderr
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


def test_get_shows_a_tasks_group(server):
    api = Api(server.grpc_target)
    grouped, plain = api.submit(group_key="tenant-1"), api.submit()
    assert json.loads(cli(server, "get", str(grouped.id), "--json").stdout)["group_key"] == "tenant-1"
    assert "group=tenant-1" in cli(server, "get", str(grouped.id)).stdout.splitlines()[0]
    assert "group=" not in cli(server, "get", str(plain.id)).stdout  # shown only when a task has one
    submitted = json.loads(cli(server, "submit", "--group-key", "tenant-2", "--json").stdout)
    assert api.get(int(submitted["id"])).group_key == "tenant-2"


def test_get_shows_a_tasks_progress_snoozes_and_checkpoint(server):
    api = Api(server.grpc_target)
    worker = api.register()
    task = api.submit()
    (leased,) = api.lease(worker, wait_ms=5000)
    report = wpb.TaskReport(task_id=leased.id, attempt=1, checkpoint=b"page-3")
    report.progress.value, report.progress.message = 0.75, "page 3 of 4"
    api.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=worker, reports=[report]))
    human = cli(server, "get", str(task.id)).stdout
    assert "  progress 0.75  page 3 of 4\n" in human and "  snoozed 0 time(s)  checkpoint 6 bytes\n" in human
    got = json.loads(cli(server, "get", str(task.id), "--json").stdout)
    assert got["progress"]["message"] == "page 3 of 4" and got["checkpoint"] == "cGFnZS0z"
    assert "progress" not in cli(server, "get", str(api.submit().id)).stdout  # shown only when reported
