"""The CLI's day-2 operations against real servers: retry and delete a task, the bulk forms of
cancel, retry and delete (--all-matching, --dry-run, the confirmation on a terminal, a long
action answered in parts, a shard down), the attempt history (get --attempts), and pools
(list, pause, resume); and the SDK calls under them, through SyncClient.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import Api, cli, eventually
from test_sharding import TOKENS, TwoShards

from cronoq.cli import main
from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb

EXIT_ERROR, EXIT_BAD_INPUT, EXIT_NOT_FOUND, EXIT_UNAVAILABLE, EXIT_FAILED_PRECONDITION = 1, 2, 4, 6, 7


def failed_task(api: Api, key: str, max_attempts: int = 1, pool: str = "default") -> task_pb2.Task:
    """A task of its own pool that failed for good (not retryable) on its first attempt."""
    task = api.submit(pool, key=key, max_attempts=max_attempts)
    worker = api.register(pools=(pool,))
    (leased,) = eventually(lambda: api.lease(worker, n=1), what=f"{key} leased")
    assert leased.id == task.id
    api.fail(worker, leased, retryable=False)
    return api.get(task.id)


def run(server: Any, *argv: str) -> tuple[int, str, str]:
    out = cli(server, *argv, check=False)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, out.stdout, out.stderr.strip()


def ts(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


# -- checked before any call: these need no server feature ------------------------------------


@pytest.mark.parametrize("command", ["cancel", "retry", "delete"])
def test_one_task_or_all_matching_and_nothing_changes_unasked(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before any call (the endpoint answers nothing): exit 2, one line."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a terminal: no one to ask
    for argv, words in (
        ((), "ID|KEY"),
        (("7", "--all-matching"), "not both"),
        (("7", "--pool", "default"), "--pool: only with --all-matching"),
        (("7", "--dry-run"), "--dry-run: only with --all-matching"),
        (("--all-matching", "--pool", "default"), "--yes"),
        (("--all-matching", "--created-before", "yesterday"), "'yesterday'"),
    ):
        with pytest.raises(SystemExit) as exit:
            main([command, *argv, "--endpoint", "http://127.0.0.1:1"])
        err = capsys.readouterr().err
        assert exit.value.code == EXIT_BAD_INPUT, (argv, err)
        assert err.startswith(f"cronoq {command}: ") and words in err and len(err.splitlines()) == 1, (argv, err)


def test_pools_lists_every_pool_with_its_counts(server: Any) -> None:
    api = Api(server.grpc_target)
    api.submit("default")
    api.submit("default")
    api.submit("other")
    lines = cli(server, "pools").stdout.splitlines()
    assert lines[0].split() == ["POOL", "SHARD", "PAUSED", "PENDING", "BLOCKED", "RUNNING", "SUCCEEDED", "FAILED",
                                "CANCELLED"]  # fmt: skip
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["default"][1:4] == ["no", "2", "0"] and rows["other"][1:3] == ["no", "1"]
    listed = {p["pool"]: p for p in map(json.loads, cli(server, "pools", "list", "--json").stdout.splitlines())}
    assert listed["default"]["pending"] == "2" and listed["default"]["paused"] is False and "shard" in listed["default"]
    assert cli(server, "--json", "pools").stdout == cli(server, "pools", "--json").stdout


# -- RetryTask, DeleteTask ----------------------------------------------------------------------


def test_retry_one_task(server: Any) -> None:
    api = Api(server.grpc_target)
    failed = failed_task(api, "to-retry")
    assert failed.state == task_pb2.TASK_STATE_FAILED and failed.attempt == failed.max_attempts == 1

    status, out, err = run(server, "retry", str(failed.id), "--json")
    assert status == 0, err
    retried = json.loads(out)
    assert retried["state"] == "TASK_STATE_PENDING" and retried["attempt"] == 1
    assert retried["max_attempts"] == 2  # all used: one more by default
    assert retried["dependents_restored"] == "0"

    status, out, err = run(server, "retry", "to-retry")  # PENDING now
    assert status == EXIT_FAILED_PRECONDITION and err.startswith("cronoq retry: FAILED_PRECONDITION: ")
    assert "PENDING" in err and len(err.splitlines()) == 1

    other = failed_task(api, "later", pool="other")
    status, out, err = run(server, "retry", "later", "--extra-attempts", "3", "--delay", "1h", "--json")
    assert status == 0, err
    later = json.loads(out)
    assert later["max_attempts"] == other.attempt + 3 and later["state"] == "TASK_STATE_PENDING"
    assert 3500 <= (ts(later["run_at"]) - dt.datetime.now(dt.UTC)).total_seconds() <= 3700

    human = cli(server, "retry", str(other.id), check=False)  # PENDING (due in an hour): refused
    assert human.returncode == EXIT_FAILED_PRECONDITION
    assert run(server, "retry", "999")[0] == EXIT_NOT_FOUND


def test_delete_one_task(server: Any) -> None:
    api = Api(server.grpc_target)
    pending = api.submit(key="to-delete")
    status, _, err = run(server, "delete", "to-delete")
    assert status == EXIT_FAILED_PRECONDITION and err.startswith("cronoq delete: FAILED_PRECONDITION: "), err
    cli(server, "cancel", str(pending.id))
    status, out, err = run(server, "delete", "to-delete", "--json")
    assert status == 0 and json.loads(out) == {"id": str(pending.id)}, err
    assert run(server, "get", str(pending.id))[0] == EXIT_NOT_FOUND
    assert run(server, "delete", str(pending.id))[0] == EXIT_NOT_FOUND
    done = api.submit()
    cli(server, "cancel", str(done.id))
    assert cli(server, "delete", str(done.id)).stdout.strip() == f"deleted task {done.id}"


# -- attempt history ----------------------------------------------------------------------------


def test_get_attempts_prints_the_history(server: Any) -> None:
    api = Api(server.grpc_target)
    task = api.submit(key="twice", max_attempts=2)
    worker = api.register()
    (first,) = api.lease(worker, n=1)
    api.fail(worker, first)  # retryable: back to PENDING after the pool's 50ms backoff
    (second,) = eventually(lambda: api.lease(worker, n=1), what="the second attempt")
    api.succeed(worker, second)

    got = json.loads(cli(server, "get", "twice", "--attempts", "--json").stdout)
    assert got["id"] == str(task.id) and got["state"] == "TASK_STATE_SUCCEEDED"
    attempts = got["attempts"]
    assert [(a["attempt"], a["outcome"], a["error"]) for a in attempts] == [
        (1, "ATTEMPT_OUTCOME_FAILED", "boom"),
        (2, "ATTEMPT_OUTCOME_SUCCEEDED", ""),
    ]
    assert all(a["worker_id"] == worker and a["started_at"] and a["ended_at"] for a in attempts)

    lines = cli(server, "get", str(task.id), "--attempts").stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["ATTEMPT", "WORKER"])
    assert lines[header].split() == ["ATTEMPT", "WORKER", "STARTED", "ENDED", "DURATION", "OUTCOME", "ERROR"]
    rows = [line.split() for line in lines[header + 1 :]]
    assert [(r[0], r[1], r[5], r[6]) for r in rows] == [("1", "t", "failed", "boom"), ("2", "t", "succeeded", "-")]
    assert "ATTEMPT" not in cli(server, "get", str(task.id)).stdout  # only when asked


# -- bulk actions -------------------------------------------------------------------------------


def test_bulk_cancel_retry_delete_with_dry_runs(server: Any) -> None:
    api = Api(server.grpc_target)
    mine = [api.submit(key=f"bulk-{i}").id for i in range(3)]
    other = api.submit("other", key="bulk-other").id
    api.submit(key="kept")

    dry = json.loads(cli(server, "cancel", "--all-matching", "--key-prefix", "bulk-", "--pool", "default",
                         "--dry-run", "--json").stdout)  # fmt: skip
    assert (int(dry["matched"]), int(dry.get("changed", 0))) == (3, 0) and dry["unavailable_shards"] == []
    human = cli(server, "cancel", "--all-matching", "--key-prefix", "bulk-", "--dry-run").stdout.splitlines()
    assert human[0].split() == ["SHARD", "MATCHED"] and human[1].split()[1] == "4"
    assert human[-1] == "dry run: 4 task(s) match; nothing changed"
    assert {api.get(i).state for i in mine} == {task_pb2.TASK_STATE_PENDING}

    done = cli(server, "cancel", "--all-matching", "--key-prefix", "bulk-", "--pool", "default", "--yes")
    assert done.stdout.splitlines()[0].split() == ["SHARD", "MATCHED", "CHANGED"]
    assert done.stdout.splitlines()[-1] == "cancelled 3 of 3 matching task(s)"
    assert {api.get(i).state for i in mine} == {task_pb2.TASK_STATE_CANCELLED}
    assert api.get(other).state == task_pb2.TASK_STATE_PENDING

    since = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)).isoformat()
    retried = json.loads(cli(server, "retry", "--all-matching", "--state", "cancelled", "--created-after", since,
                             "--finished-after", "1h", "--yes", "--json").stdout)  # fmt: skip
    assert (int(retried["matched"]), int(retried["changed"])) == (3, 3)
    assert {api.get(i).state for i in mine} == {task_pb2.TASK_STATE_PENDING}

    cli(server, "cancel", "--all-matching", "--pool", "default", "--yes")
    status, out, err = run(server, "delete", "--all-matching", "--pool", "default", "--key-prefix", "bulk-",
                           "--state", "cancelled,failed", "--yes")  # fmt: skip
    assert status == 0 and out.splitlines()[-1] == "deleted 3 of 3 matching task(s)", err
    assert all(run(server, "get", str(i))[0] == EXIT_NOT_FOUND for i in mine)
    assert run(server, "get", "kept")[0] == 0 and api.get(other).state == task_pb2.TASK_STATE_PENDING

    status, _, err = run(server, "cancel", "--all-matching", "--state", "succeeded", "--yes")
    assert status == EXIT_BAD_INPUT and "INVALID_ARGUMENT" in err  # not a state cancel applies to


def test_a_long_bulk_action_goes_on_until_every_task_is_done(start_server: Any) -> None:
    """forward_timeout 100 ms: the server answers a bulk call incomplete after about 50 ms and the
    same call again goes on; one `cronoq cancel --all-matching` calls until it is done."""
    srv = start_server({"server": {"forward_timeout": "100ms"}, "pools": [{"name": "default"}]})
    api = Api(srv.grpc_target)
    total = 3000
    for _ in range(total // 1000):
        api.tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default")] * 1000))
    status, out, err = run(srv, "cancel", "--all-matching", "--pool", "default", "--yes", "--json")
    assert status == 0, err
    done = json.loads(out)
    assert (int(done["matched"]), int(done["changed"])) == (total, total) and not done.get("incomplete")
    assert [(s["shard"], int(s["changed"])) for s in done["shards"]] == [(done["shards"][0]["shard"], total)]
    page = api.tasks.ListTasks(tpb.ListTasksRequest(pool="default", state=task_pb2.TASK_STATE_PENDING))
    assert list(page.tasks) == []


def _on_a_terminal(server: Any, answer: bytes, *argv: str) -> tuple[int, str, str]:
    """Runs the CLI with a terminal as stdin; answers the prompt once it is on stderr."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cronoq.cli", *argv, "--endpoint", server.endpoint],
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(slave)
    try:
        assert proc.stderr is not None and proc.stdout is not None
        prompt = ""
        deadline = time.monotonic() + 30
        while not prompt.endswith("[y/N] ") and time.monotonic() < deadline:
            char = proc.stderr.read(1)
            if not char:
                break
            prompt += char
        os.write(master, answer)
        out, err = proc.communicate(timeout=30)
        return proc.returncode, out, prompt + err
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def test_bulk_asks_first_on_a_terminal(server: Any) -> None:
    api = Api(server.grpc_target)
    ids = [api.submit(key=f"ask-{i}").id for i in range(2)]
    status, out, err = _on_a_terminal(server, b"n\n", "cancel", "--all-matching", "--key-prefix", "ask-")
    assert "cancel 2 task(s) that match --key-prefix ask-? [y/N] " in err
    assert status == EXIT_ERROR and "not confirmed; nothing changed" in err and out == ""
    assert {api.get(i).state for i in ids} == {task_pb2.TASK_STATE_PENDING}
    status, out, err = _on_a_terminal(server, b"y\n", "cancel", "--all-matching", "--key-prefix", "ask-")
    assert status == 0 and out.splitlines()[-1] == "cancelled 2 of 2 matching task(s)", err
    assert {api.get(i).state for i in ids} == {task_pb2.TASK_STATE_CANCELLED}
    status, out, err = _on_a_terminal(server, b"", "cancel", "--all-matching", "--key-prefix", "none-")
    assert status == 0 and "no task matches --key-prefix none-; nothing to do" in err


def test_bulk_with_a_shard_down_names_it_and_exits_6(tmp_path: Path, start_server: Any) -> None:
    shards = TwoShards(tmp_path, start_server)
    token = ("--token", TOKENS["full"])
    cpu_task = json.loads(cli(shards.cpu, "submit", "--pool", "default", *token, "--json").stdout)
    cli(shards.cpu, "submit", "--pool", "llm", *token)  # forwarded to gpu
    status, out, err = run(shards.cpu, "cancel", "--all-matching", "--state", "pending", "--dry-run", *token)
    assert status == 0, err
    assert sorted(line.split() for line in out.splitlines()[1:-1]) == [["cpu", "1"], ["gpu", "1"]]

    shards.kill("gpu")
    status, out, err = run(shards.cpu, "cancel", "--all-matching", "--state", "pending", "--yes", *token)
    assert status == EXIT_UNAVAILABLE
    assert [line.split() for line in out.splitlines()[1:-1]] == [["cpu", "1", "1"]]
    assert (
        err == "cronoq cancel: shards not reached (their tasks are not counted): gpu; run it again once they are back"
    )
    got = json.loads(cli(shards.cpu, "get", cpu_task["id"], *token, "--json").stdout)
    assert got["state"] == "TASK_STATE_CANCELLED"


# -- PausePool, ResumePool ----------------------------------------------------------------------


def test_pools_pause_and_resume(server: Any) -> None:
    api = Api(server.grpc_target)
    paused = json.loads(cli(server, "pools", "pause", "default", "--json").stdout)
    assert paused["pool"] == "default" and paused["paused"] is True and paused["paused_at"]
    human = cli(server, "pools", "pause", "default").stdout.strip()  # already: says so again
    assert human.startswith("pool default paused since ")

    task = api.submit("default")  # still accepted
    worker = api.register()
    assert api.lease(worker, n=1) == []
    rows = {line.split()[0]: line.split() for line in cli(server, "pools").stdout.splitlines()[1:]}
    assert rows["default"][2] == "yes" and rows["other"][2] == "no"
    assert rows["default"][3] == "1"  # PENDING

    resumed = cli(server, "pools", "resume", "default")
    assert resumed.stdout.strip() == "pool default not paused: its tasks are leased"
    (leased,) = eventually(lambda: api.lease(worker, n=1), what="the task leased after resume")
    assert leased.id == task.id
    assert run(server, "pools", "pause", "nope")[0] in (EXIT_BAD_INPUT, EXIT_NOT_FOUND)


def test_the_sync_client_has_the_same_calls(server: Any) -> None:
    """The SDK's calls under the CLI, through SyncClient (which wraps Client's)."""
    import cronoq

    api = Api(server.grpc_target)
    failed = failed_task(api, "sync-1")
    with cronoq.SyncClient(server.endpoint) as client:
        got = client.get("sync-1", include_attempts=True)
        assert got.task.id == failed.id and [a.outcome for a in got.attempts] == [cronoq.AttemptOutcome.Value(
            "ATTEMPT_OUTCOME_FAILED")]  # fmt: skip
        assert client.get(failed.id).id == failed.id  # a Task without include_attempts
        retried = client.retry("sync-1", extra_attempts=2, run_at=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
        assert retried.task.state == task_pb2.TASK_STATE_PENDING and retried.task.max_attempts == 3
        filt = cronoq.task_filter("default", key_prefix="sync-")
        assert client.cancel_tasks(filt, dry_run=True).matched == 1
        assert client.cancel_tasks(filt).changed == 1
        assert client.retry_tasks(filt, dry_run=True).matched == 1
        assert client.delete_tasks(filt, dry_run=True).matched == 1
        assert client.delete("sync-1") == failed.id
        assert client.pause_pool("other").paused and not client.resume_pool("other").paused
