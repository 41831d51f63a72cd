"""The `cronoq` CLI against a real server: every command, --help, --json."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

COMMANDS = ["submit", "get", "wait", "cancel", "tasks"]


def cli(server, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env_args = ["--endpoint", server.endpoint] if server is not None else []
    cmd = [sys.executable, "-m", "cronoq.cli", *args[:1], *env_args, *args[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=check)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    out = subprocess.run([sys.executable, "-m", "cronoq.cli", command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--endpoint" in out.stdout and "--json" in out.stdout


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
