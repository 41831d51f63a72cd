"""The CLI's answers a script can trust: how a wait ended (exit 8 for FAILED or CANCELLED), a
partial answer with a shard down (exit 6, and named in --json), `tasks` with the bulk actions'
filter flags (the tasks a --dry-run counted are those listed), an unknown pool refused alike
by every listing, schedules' payload flags as submit's, and a notice while no server answers.
ListTasks' filter over gRPC and HTTP is here too, on both stores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, cli, eventually, store_table
from test_cli_operations import failed_task
from test_sharding import TOKENS, TwoShards

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb

EXIT_BAD_INPUT, EXIT_NOT_FOUND, EXIT_UNAVAILABLE, EXIT_TASK_UNSUCCESSFUL = 2, 4, 6, 8
S = task_pb2


def run(server: Any, *argv: str) -> tuple[int, str, str]:
    out = cli(server, *argv, check=False)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, out.stdout, out.stderr.strip()


@pytest.fixture(params=["sqlite", "postgres"])
def srv(request: pytest.FixtureRequest, start_server: Any) -> Any:
    return start_server(
        {
            "pools": [{"name": "default", "lease_ttl": "30s"}, {"name": "other", "lease_ttl": "30s"}],
            "store": store_table(request.param, request),
        }
    )


# -- wait and submit --wait ---------------------------------------------------------------------


def test_wait_exits_8_when_the_task_failed_or_was_cancelled(server: Any) -> None:
    api = Api(server.grpc_target)
    failed = failed_task(api, "wait-failed")
    status, out, err = run(server, "wait", str(failed.id), "--timeout", "5s")
    assert status == EXIT_TASK_UNSUCCESSFUL and "state=failed" in out
    assert err == f"cronoq wait: task {failed.id} ended FAILED"
    status, out, _ = run(server, "wait", "wait-failed", "--json")
    assert status == EXIT_TASK_UNSUCCESSFUL and json.loads(out)["done"] is True

    worker = api.register(pools=("other",))
    done = api.submit("other", key="wait-ok")
    (leased,) = eventually(lambda: api.lease(worker, n=1), what="wait-ok leased")
    api.succeed(worker, leased)
    assert run(server, "wait", str(done.id))[0] == 0

    # submit --wait: the task is cancelled while the CLI waits.
    waiting = subprocess.Popen(
        [sys.executable, "-m", "cronoq.cli", "--endpoint", server.endpoint, "submit", "--key", "wait-cancelled",
         "--wait", "30s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        eventually(lambda: api.tasks.ListTasks(tpb.ListTasksRequest(key="wait-cancelled")).tasks, what="submitted")
        api.tasks.CancelTask(tpb.CancelTaskRequest(task=task_pb2.TaskRef(key="wait-cancelled")))
        out, err = waiting.communicate(timeout=30)
    finally:
        waiting.kill()
    assert waiting.returncode == EXIT_TASK_UNSUCCESSFUL and "state=cancelled" in out
    assert err.strip().endswith("ended CANCELLED"), err


def test_help_lists_exit_8_and_an_unknown_pool_under_2() -> None:
    epilog = subprocess.run([sys.executable, "-m", "cronoq.cli", "--help"], capture_output=True, text=True).stdout
    assert "  8    wait, submit --wait: the task ended FAILED or CANCELLED" in epilog
    assert "unknown pool" in epilog and "no such task or schedule" in epilog


# -- partial answers ------------------------------------------------------------------------------


def test_every_listing_with_a_shard_down_exits_6_and_names_it_in_json(tmp_path: Path, start_server: Any) -> None:
    shards = TwoShards(tmp_path, start_server)
    token = ("--token", TOKENS["full"])
    task = json.loads(cli(shards.cpu, "submit", "--pool", "default", *token, "--json").stdout)
    assert run(shards.cpu, "tasks", *token)[0] == 0
    shards.kill("gpu")
    for argv in (("tasks",), ("tasks", "--key-prefix", "x"), ("pools",), ("workers",), ("schedules", "list")):
        status, out, err = run(shards.cpu, *argv, *token)
        assert status == EXIT_UNAVAILABLE, (argv, out, err)
        assert err.endswith("shards unavailable (not shown): gpu"), (argv, err)
        status, out, err = run(shards.cpu, *argv, *token, "--json")
        assert status == EXIT_UNAVAILABLE, (argv, out, err)
        assert json.loads(out.splitlines()[-1]) == {"unavailable_shards": ["gpu"]}, (argv, out)
    _, out, _ = run(shards.cpu, "tasks", *token, "--json")
    assert [json.loads(line).get("id") for line in out.splitlines()] == [task["id"], None]
    status, out, _ = run(shards.cpu, "snapshot", *token, "--json")
    assert status == EXIT_UNAVAILABLE and json.loads(out)["unavailable_shards"] == ["gpu"]
    # A listing of the live shard's pool alone is whole (filter.pool routes as pool does).
    assert run(shards.cpu, "tasks", "--pool", "default", *token)[0] == 0
    status, out, _ = run(shards.cpu, "tasks", "--pool", "default", "--state", "pending,failed", *token, "--json")
    assert status == 0 and [json.loads(line)["id"] for line in out.splitlines()] == [task["id"]]


# -- tasks: the bulk actions' filter --------------------------------------------------------------


def test_tasks_lists_what_a_bulk_dry_run_counts(srv: Any) -> None:
    api = Api(srv.grpc_target)
    failed = [failed_task(api, f"imp-{i}") for i in range(2)]
    other = failed_task(api, "exp-1")
    cancelled = api.submit(key="imp-c")
    api.tasks.CancelTask(tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=cancelled.id)))
    pending = api.submit(key="imp-p")  # no retry applies to it

    def listed(*flags: str) -> list[int]:
        out = cli(srv, "tasks", *flags, "--json").stdout
        return [int(json.loads(line)["id"]) for line in out.splitlines()]

    def dry_run(*flags: str) -> int:
        out = json.loads(cli(srv, "retry", "--all-matching", *flags, "--dry-run", "--json").stdout)
        return int(out.get("matched", 0))

    both = ("--state", "failed", "--state", "cancelled")
    assert listed(*both) == [t.id for t in failed] + [other.id, cancelled.id]  # both states, not the last
    assert listed("--state", "failed,cancelled") == listed(*both)
    for flags in (
        (*both, "--key-prefix", "imp-"),
        ("--state", "failed", "--error-contains", "boom"),
        ("--state", "failed", "--error-contains", "BOOM"),
        (*both, "--finished-after", "1h"),
        (*both, "--created-before", "2000-01-01T00:00:00Z"),
        (*both, "--pool", "default", "--key-prefix", "exp-"),
    ):
        assert len(listed(*flags)) == dry_run(*flags), flags
    assert listed(*both, "--key-prefix", "imp-") == [t.id for t in failed] + [cancelled.id]
    assert listed("--key-prefix", "imp-", "--newest-first", "--limit", "2") == [pending.id, cancelled.id]
    assert listed("--state", "failed", "--error-contains", "BOOM") == []

    table = cli(srv, "tasks", "--key-prefix", "exp-").stdout.splitlines()
    assert table[0].split() == ["ID", "POOL", "STATE", "ATTEMPT", "SHARD", "KEY", "ERROR"]
    assert table[1].split() == [str(other.id), "default", "failed", "1/1", "0", "exp-1", "boom"]


def test_list_tasks_filter_over_grpc(srv: Any) -> None:
    api = Api(srv.grpc_target)
    a = api.submit(key="grpc-a")
    b = api.submit("other", key="grpc-b")
    api.tasks.CancelTask(tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=b.id)))

    def ids(**kw: Any) -> list[int]:
        return [t.id for t in api.tasks.ListTasks(tpb.ListTasksRequest(**kw)).tasks]

    states = [S.TASK_STATE_PENDING, S.TASK_STATE_CANCELLED]
    assert ids(filter=tpb.TaskFilter(states=states, key_prefix="grpc-")) == [a.id, b.id]
    assert ids(filter=tpb.TaskFilter(pool="other")) == ids(pool="other") == [b.id]
    assert ids(state=S.TASK_STATE_PENDING, filter=tpb.TaskFilter(key_prefix="grpc-")) == [a.id]
    assert ids(key="grpc-b", filter=tpb.TaskFilter(states=[S.TASK_STATE_PENDING])) == []
    assert ids(key="grpc-b", filter=tpb.TaskFilter(states=[S.TASK_STATE_CANCELLED])) == [b.id]
    assert ids(filter=tpb.TaskFilter(ids=[b.id])) == [b.id]
    assert ids(filter=tpb.TaskFilter(key_prefix="grpc-"), newest_first=True, page_size=1) == [b.id]
    for request, words in (
        (tpb.ListTasksRequest(pool="default", filter=tpb.TaskFilter(pool="other")), "filter.pool 'other' differ"),
        (tpb.ListTasksRequest(state=S.TASK_STATE_FAILED, filter=tpb.TaskFilter(states=states)), "not both"),
        (tpb.ListTasksRequest(filter=tpb.TaskFilter(pool="nope")), "filter.pool: unknown pool 'nope'"),
        (tpb.ListTasksRequest(filter=tpb.TaskFilter(states=[9])), "filter.states[0]: unknown state 9"),
        (tpb.ListTasksRequest(filter=tpb.TaskFilter(key_prefix="k" * 257)), "filter.key_prefix: 257 bytes"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            api.tasks.ListTasks(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details(), err.value


def test_list_tasks_filter_over_http_and_unknown_parameters_refused(srv: Any) -> None:
    api = Api(srv.grpc_target)
    a = api.submit(key="http-a")
    b = api.submit(key="http-b")
    api.tasks.CancelTask(tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=b.id)))

    def ids(query: str) -> list[int]:
        status, body = srv.http("GET", f"/v1/tasks?{query}")
        assert status == 200, body
        return [int(t["id"]) for t in body.get("tasks", [])]

    assert ids("filter.states=cancelled") == [b.id]
    assert ids("filter.states=TASK_STATE_PENDING&filter.states=cancelled&filter.key_prefix=http-") == [a.id, b.id]
    assert ids("filter.keyPrefix=http-a") == [a.id]  # a JSON name too, as in a body
    assert ids("filter.created_after=2000-01-01T00:00:00Z&filter.finished_before=2100-01-01T00:00:00Z") == [b.id]
    assert ids(f"filter.ids={b.id}&pool=default") == [b.id]
    for query, words in (
        ("states=failed", "states: unknown query parameter"),
        ("key_prefix=http-", "key_prefix: unknown query parameter"),
        ("pool=default&pool=other", "pool: given 2 times"),
        ("filter.created_after=yesterday", "filter.created_after: 'yesterday' is not an RFC 3339 time"),
        ("filter.states=nope", "filter.states: 'nope' is not one of pending, blocked, running, succeeded,"),
    ):
        status, body = srv.http("GET", f"/v1/tasks?{query}")
        assert status == 400 and body["code"] == "INVALID_ARGUMENT" and words in body["message"], (query, body)
    assert [t.id for t in api.tasks.ListTasks(tpb.ListTasksRequest()).tasks] == [a.id, b.id]
    # A body's fields are named by their proto names in errors, whichever name the caller used.
    status, body = srv.http("POST", "/v1/tasks/bulk-cancel", {"filter": {"keyPrefix": 5}})
    assert status == 400 and "key_prefix" in body["message"] and "keyPrefix" not in body["message"], body
    status, body = srv.http("POST", "/v1/tasks/bulk-cancel", {"filter": "x"})
    assert status == 400 and "key_prefix" in body["message"] and "keyPrefix" not in body["message"], body


# -- unknown pools, schedules' payload flags, a server that does not answer -----------------------


def test_an_unknown_pool_is_bad_input_for_every_listing(server: Any) -> None:
    for argv in (("tasks", "--pool", "nope"), ("workers", "--pool", "nope"), ("schedules", "list", "--pool", "nope")):
        status, _, err = run(server, *argv)
        assert status == EXIT_BAD_INPUT and "INVALID_ARGUMENT" in err and "unknown pool 'nope'" in err, (argv, err)
    assert run(server, "get", "999")[0] == EXIT_NOT_FOUND
    status, _, err = run(server, "schedules", "delete", "default", "nope")
    assert status == EXIT_NOT_FOUND, err


def test_schedules_put_takes_a_payload_as_submit_does(server: Any) -> None:
    put = ("schedules", "put", "default", "nightly", "--cron", "0 3 * * *", "--json")
    assert json.loads(cli(server, *put, "--data", "hello").stdout)["payload"] == "aGVsbG8="
    assert json.loads(cli(server, *put, "--payload", "old").stdout)["payload"] == "b2xk"  # the old spelling
    assert json.loads(cli(server, *put, "--json-payload", '{"n": 1}').stdout)["payload_json"] == {"n": 1}
    status, _, err = run(server, *put, "--data", "a", "--payload-json", "1")
    assert status == EXIT_BAD_INPUT and "not allowed with" in err


def test_without_a_server_it_says_it_is_retrying_after_a_second(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cronoq.cli", "--endpoint", "http://127.0.0.1:1", "tasks"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    first = proc.stderr.readline()
    said_after = time.monotonic() - started
    _, rest = proc.communicate(timeout=60)
    assert first.startswith("cronoq tasks: UNAVAILABLE") and first.rstrip().endswith("retrying (Ctrl-C to stop)")
    assert said_after < 8, said_after  # well before the 10 s the call retries for
    assert proc.returncode == EXIT_UNAVAILABLE and rest.count("\n") == 1, rest
