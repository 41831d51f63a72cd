"""The CLI over server features built on other branches: schedules (PutSchedule,
DeleteSchedule, ListSchedules) and Watch cursors (TaskEvent.seq and .cursor, replay after
WatchRequest.cursor). Written to the API contract; they pass once those servers are in."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter

from _helpers import Api, Watcher, cli, eventually

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb


def scheduled_tasks(api: Api, pool: str) -> list[task_pb2.Task]:
    return list(api.tasks.ListTasks(tpb.ListTasksRequest(pool=pool, page_size=500)).tasks)


def test_schedules_put_list_delete_round_trip_and_firing(server):
    put = cli(
        server,
        *("schedules", "put", "default", "every-second", "--cron", "* * * * * *"),
        *("--payload-json", '{"from": "schedule"}', "--priority", "3", "--group-key", "nightly", "--json"),
        check=False,
    )
    assert put.returncode == 0, put.stderr
    schedule = json.loads(put.stdout)
    assert (schedule["pool"], schedule["name"], schedule["cron"]) == ("default", "every-second", "* * * * * *")
    assert schedule["payload_json"] == {"from": "schedule"} and schedule["priority"] == 3
    assert schedule.get("next_fire_at") and schedule["paused"] is False

    listed = [json.loads(line) for line in cli(server, "schedules", "list", "--json").stdout.splitlines()]
    assert [(s["pool"], s["name"]) for s in listed] == [("default", "every-second")]
    assert cli(server, "schedules", "list", "--pool", "other", "--json").stdout == ""
    table = cli(server, "schedules", "list").stdout.splitlines()
    assert table[0].split()[:4] == ["POOL", "NAME", "CRON", "TIMEZONE"]
    assert table[1].split()[:2] == ["default", "every-second"] and "* * * * * *" in table[1]

    api = Api(server.grpc_target)
    fired = eventually(lambda: scheduled_tasks(api, "default"), timeout=10, what="a task fired by the schedule")
    assert json.loads(fired[0].payload) == {"from": "schedule"} and fired[0].priority == 3
    assert fired[0].group_key == "nightly"

    deleted = cli(server, "schedules", "delete", "default", "every-second", "--json")
    assert json.loads(deleted.stdout) == {"pool": "default", "name": "every-second"}
    assert cli(server, "schedules", "list", "--json").stdout == ""
    assert "every-second" not in cli(server, "schedules", "list").stdout


def test_schedules_put_options_are_stored(server):
    put = cli(
        server,
        *("schedules", "put", "other", "nightly", "--cron", "0 3 * * *", "--timezone", "Europe/Paris"),
        *("--payload", "hello", "--max-attempts", "2", "--timeout", "1.5s", "--paused", "--fire-all-missed"),
        "--json",
    )
    schedule = json.loads(put.stdout)
    assert schedule["timezone"] == "Europe/Paris" and schedule["max_attempts"] == 2
    assert schedule["timeout_ms"] == "1500" and schedule["paused"] is True and schedule["fire_all_missed"] is True
    assert schedule["payload"] == "aGVsbG8="  # base64 of the text payload's bytes
    (listed,) = [json.loads(line) for line in cli(server, "schedules", "list", "--json").stdout.splitlines()]
    assert listed["name"] == "nightly" and listed["paused"] is True
    assert "yes" in cli(server, "schedules", "list").stdout.splitlines()[1].split()  # PAUSED column
    # --timeout-ms: the deprecated spelling, still taken.
    put = cli(server, "schedules", "put", "other", "nightly", "--cron", "0 3 * * *", "--timeout-ms", "2000", "--json")
    assert json.loads(put.stdout)["timeout_ms"] == "2000"


def test_a_bad_cron_is_one_line_with_the_code(server):
    out = cli(server, "schedules", "put", "default", "bad", "--cron", "every day at noon", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr  # bad input
    assert out.stderr.startswith("cronoq schedules put: INVALID_ARGUMENT: ") and len(out.stderr.splitlines()) == 1


def test_watch_resumes_across_a_server_restart_with_every_event_exactly_once(server, tmp_path):
    """The watcher is stopped (SIGSTOP) across the restart, so the tasks submitted after it
    were created while no stream was open: it sees them only by resuming from its cursor."""
    api = Api(server.grpc_target)
    watcher = Watcher(server, tmp_path / "watch.err")
    try:
        watcher.wait_connected(api)
        before = [api.submit(key=f"before-{i}").id for i in range(5)]
        watcher.wait_created(before)

        os.kill(watcher.proc.pid, signal.SIGSTOP)
        try:
            server.stop()  # SIGTERM: drains, ends the Watch stream
            server.start()  # the same SQLite store and ports
            api = Api(server.grpc_target)
            meanwhile = [api.submit(key=f"meanwhile-{i}").id for i in range(5)]
            worker = api.register()
            for task in api.lease(worker, n=2):
                api.succeed(worker, task)
        finally:
            os.kill(watcher.proc.pid, signal.SIGCONT)
        watcher.wait_created(meanwhile)
        after = [api.submit(key=f"after-{i}").id for i in range(5)]  # live, or replayed if before the reconnect
        watcher.wait_created(after)

        events = watcher.events()
        by_seq = Counter((e["task"]["id"], e["seq"]) for e in events)
        assert [k for k, n in by_seq.items() if n > 1] == []
        assert all(int(e["seq"]) > 0 and e["cursor"] for e in events)
        created = Counter(e["task"]["id"] for e in events if e["task"]["state"] == "TASK_STATE_PENDING")
        assert all(created[str(i)] == 1 for i in before + meanwhile + after), created
        finished = [e for e in events if e["task"]["state"] == "TASK_STATE_SUCCEEDED"]
        assert len(finished) == 2  # the two tasks finished while the watcher was stopped
        assert "reconnecting to " in watcher.stderr() and "after cursor " in watcher.stderr()
        assert watcher.interrupt() == 130
    finally:
        watcher.kill()
