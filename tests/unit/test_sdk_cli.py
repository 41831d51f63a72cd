"""The CLI without a server: ID|KEY arguments (ASCII decimal digits name an id, anything
else a key), the parser, and the tables and JSON lines printed from hand-built messages."""

from __future__ import annotations

import datetime as dt

import pytest

from cronoq import cli
from cronoq.cli import _ref, build_parser, format_table
from cronoq.v1 import admin_service_pb2, schedule_service_pb2, task_pb2, task_service_pb2, worker_service_pb2


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("42", 42),
        ("042", 42),
        ("18446744073709551615", 2**64 - 1),
        ("invoice-42", "invoice-42"),
        ("", ""),
        ("-1", "-1"),
        ("²", "²"),  # str.isdigit() is True for it, but int() refuses it
        ("4²", "4²"),
        ("١٢", "١٢"),  # Arabic-Indic digits: int() accepts them, but they are a key here
        ("１２", "１２"),  # fullwidth digits
    ],
)
def test_ref_is_an_id_only_for_ascii_digits(text: str, ref: int | str) -> None:
    assert _ref(text, False) == ref and type(_ref(text, False)) is type(ref)


@pytest.mark.parametrize("text", ["42", "²", "x"])
def test_key_flag_always_names_a_key(text: str) -> None:
    assert _ref(text, True) == text


def test_an_id_past_64_bits_is_a_clear_error() -> None:
    with pytest.raises(cli.BadInput, match="too large for a task id"):
        _ref("18446744073709551616", False)


# -- the parser and the output of watch, workers, schedules and snapshot --------------

NOW = dt.datetime(2025, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def test_schedules_put_parses_every_option() -> None:
    args = build_parser().parse_args(
        [
            *("schedules", "put", "default", "nightly", "--cron", "0 3 * * *", "--timezone", "Europe/Paris"),
            *("--payload-json", '{"n": 1}', "--priority", "5", "--max-attempts", "2", "--resource", "gpu=1"),
            *("--resource", "api=2", "--timeout-ms", "1500", "--paused", "--fire-all-missed", "--json"),
        ]
    )
    assert (args.pool, args.name, args.cron, args.timezone) == ("default", "nightly", "0 3 * * *", "Europe/Paris")
    assert (args.payload_json, args.data, args.priority, args.max_attempts) == ('{"n": 1}', None, 5, 2)
    assert args.resource == [("gpu", 1), ("api", 2)] and args.timeout_ms == 1500
    assert args.paused and args.fire_all_missed and args.json
    assert args.run is cli.cmd_schedules_put and args.title == "schedules put"


@pytest.mark.parametrize(
    "argv",
    [
        ["schedules", "put", "p", "n"],  # --cron is required
        ["schedules", "put", "p", "n", "--cron", "* * * * *", "--payload", "x", "--payload-json", "1"],
        ["schedules", "put", "p", "n", "--cron", "* * * * *", "--resource", "gpu"],
        ["schedules", "put", "p", "n", "--cron", "* * * * *", "--resource", "gpu=x"],
        ["schedules", "put", "p", "n", "--cron", "* * * * *", "--resource", "=1"],
        ["schedules"],  # a subcommand is required
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    command = "cronoq " + " ".join(argv[:2] if len(argv) > 1 else argv[:1])
    assert err.startswith(f"{command}: ") and err.endswith(f" (see {command} --help)\n"), err


def test_watch_workers_snapshot_and_schedule_listing_parse() -> None:
    parse = build_parser().parse_args
    args = parse(["watch", "--pool", "p", "--cursor", "c9", "--include-payloads", "--json"])
    assert (args.pool, args.cursor, args.include_payloads, args.json, args.retry_for) == ("p", "c9", True, True, 60)
    assert parse(["workers", "--pool", "p"]).run is cli.cmd_workers
    assert parse(["schedules", "list"]).pool == "" and parse(["schedules", "delete", "p", "n"]).name == "n"
    assert parse(["snapshot", "--json"]).run is cli.cmd_snapshot


def test_format_table_aligns_numbers_right_and_text_left() -> None:
    assert format_table(("NAME", "N", "WHEN"), [("a", 1, "-"), ("bbb", 100, "now")]) == [
        "NAME    N  WHEN",
        "a       1  -",
        "bbb   100  now",
    ]


def test_event_line_and_json() -> None:
    task = task_pb2.Task(
        id=2**63 + 1, pool="default", key="k", state=task_pb2.TASK_STATE_RUNNING, attempt=1, max_attempts=3
    )
    task.payload, task.content_type = b'{"n": 1}', "application/json"
    event = task_pb2.TaskEvent(task=task, shard="s0", seq=7, cursor="s0:7")
    event.time.FromDatetime(NOW)
    assert cli.event_line(event) == f"2025-01-01T12:00:00.000+00:00  {2**63 + 1:>20}  default      running    1/3  k"
    out = cli.event_json(event)
    assert out["task"]["id"] == str(2**63 + 1) and out["task"]["payload_json"] == {"n": 1}
    assert (out["seq"], out["cursor"], out["shard"], out["time"]) == ("7", "s0:7", "s0", "2025-01-01T12:00:00Z")


def test_workers_table_shows_the_heartbeat_age() -> None:
    seen = worker_service_pb2.Worker(id="w-1", name="host-1", pools=["default", "other"], concurrency=32, running=3)
    seen.last_seen_at.FromDatetime(NOW - dt.timedelta(seconds=75))
    never = worker_service_pb2.Worker(id="w-22", name="h", pools=["x"], concurrency=1)
    assert cli.format_workers([seen, never], NOW) == [
        "ID    NAME    POOLS          CONCURRENCY  RUNNING  LAST HEARTBEAT",
        "w-1   host-1  default,other           32        3  1m15s ago",
        "w-22  h       x                        1        0  -",
    ]


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s ago"), (59, "59s ago"), (61, "1m1s ago"), (3720, "1h2m ago"), (90000, "1d1h ago")]
)
def test_age(seconds: int, text: str) -> None:
    worker = worker_service_pb2.Worker()
    worker.last_seen_at.FromDatetime(NOW - dt.timedelta(seconds=seconds))
    assert cli.age(worker, "last_seen_at", NOW) == text


def test_schedules_table_and_json() -> None:
    nightly = schedule_service_pb2.Schedule(
        pool="default", name="nightly", cron="0 3 * * *", timezone="Europe/Paris", payload=b"[1]"
    )
    nightly.content_type = "application/json"
    nightly.next_fire_at.FromDatetime(NOW)
    paused = schedule_service_pb2.Schedule(pool="p", name="n", cron="* * * * * *", paused=True)
    assert cli.format_schedules([nightly, paused]) == [
        "POOL     NAME     CRON         TIMEZONE      PAUSED  NEXT FIRE                  LAST FIRE",
        "default  nightly  0 3 * * *    Europe/Paris  no      2025-01-01T12:00:00+00:00  -",
        "p        n        * * * * * *  UTC           yes     -                          -",
    ]
    out = cli.schedule_json(nightly)
    assert out["payload_json"] == [1] and "payload" not in out and out["next_fire_at"] == "2025-01-01T12:00:00Z"
    assert cli.schedule_json(paused)["paused"] is True


def test_snapshot_table_per_shard() -> None:
    busy = worker_service_pb2.Worker(id="w", running=3)
    snap = admin_service_pb2.GetSnapshotResponse(
        shards=[
            admin_service_pb2.ShardSnapshot(
                shard="eu",
                number=1,
                leader="http://10.0.0.1:7070",
                term=4,
                pools=[admin_service_pb2.PoolCounts(pool="default", pending=12, running=3, succeeded=1234)],
                resources=[
                    admin_service_pb2.ResourceUsage(name="gpu", in_use=1, capacity=4),
                    admin_service_pb2.ResourceUsage(name="api", rate=2.5, burst=20),
                ],
                workers=[busy, worker_service_pb2.Worker(id="idle")],
            ),
            admin_service_pb2.ShardSnapshot(shard="us", number=2, leader="http://10.0.0.2:7070"),
        ]
    )
    assert cli.format_snapshot(snap) == [
        "shard eu (#1)  leader http://10.0.0.1:7070  term 4",
        "  POOL     PENDING  BLOCKED  RUNNING  SUCCEEDED  FAILED  CANCELLED",
        "  default       12        0        3       1234       0          0",
        "  RESOURCE  IN USE  CAPACITY  RATE   BURST",
        "  gpu            1         4  -          -",
        "  api            -         -  2.5/s     20",
        "  workers: 2, running 3 task(s)",
        "",
        "shard us (#2)  leader http://10.0.0.2:7070  term 0",
        "  POOL  PENDING  BLOCKED  RUNNING  SUCCEEDED  FAILED  CANCELLED",
        "  workers: 0, running 0 task(s)",
    ]


@pytest.mark.parametrize(("raised", "code"), [(KeyboardInterrupt(), 130), (BrokenPipeError(), 141)])
def test_ctrl_c_and_a_closed_pipe_end_without_a_traceback(
    raised: BaseException, code: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def interrupted(args: object) -> int:
        raise raised

    monkeypatch.setattr(cli, "cmd_watch", interrupted)
    monkeypatch.setattr(cli.os, "dup2", lambda *a: None)  # keeps pytest's stdout
    with pytest.raises(SystemExit) as exit_:
        cli.main(["watch"])
    assert exit_.value.code == code and capsys.readouterr().err == ""


@pytest.mark.parametrize("flag", ["--payload-json", "--json-payload"])
def test_submit_with_bad_payload_json_names_the_flag_and_the_value(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["submit", "--pool", "p", flag, "{n: 1}"])
    message = capsys.readouterr().err
    assert exit_.value.code == 2
    assert message.startswith("cronoq submit: --payload-json '{n: 1}' is not valid JSON: "), message
    assert "property name enclosed in double quotes" in message  # the value's problem, as json says it
    assert "--json " not in message


def test_schedules_put_with_bad_payload_json_names_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["schedules", "put", "p", "n", "--cron", "* * * * *", "--payload-json", "[1,"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("cronoq schedules put: --payload-json '[1,' is not valid JSON: ")


# -- durations, times, global flags, and the day-2 commands' output -------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30", 30.0), ("2.5", 2.5), ("500ms", 0.5), ("30s", 30.0), ("5m", 300.0), ("2h", 7200.0), ("1d", 86400.0),
     (".5s", 0.5), ("0", 0.0)],
)  # fmt: skip
def test_durations_take_a_unit(text: str, seconds: float) -> None:
    assert cli.duration_arg(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5x", "-1s", "1h30m", "s", "1e3", "inf", "nan"])
def test_a_bad_duration_says_what_one_looks_like(text: str) -> None:
    with pytest.raises(cli.argparse.ArgumentTypeError, match=r"is not a duration such as 30s"):
        cli.duration_arg(text)


def test_times_are_iso_8601_or_a_duration_ago() -> None:
    assert cli.time_arg("2026-11-01T00:00:00Z") == dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    assert cli.time_arg("2026-11-01 02:00") == dt.datetime(2026, 11, 1, 2, tzinfo=dt.UTC)  # no zone: UTC
    paris = cli.time_arg("2026-11-01T01:00:00+01:00")
    assert paris == dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    ago = dt.datetime.now(dt.UTC) - cli.time_arg("2h")
    assert 7199 <= ago.total_seconds() <= 7260
    with pytest.raises(cli.argparse.ArgumentTypeError, match="'yesterday' is neither a time"):
        cli.time_arg("yesterday")


def test_global_flags_parse_before_and_after_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRONOQ_ENDPOINT", "http://from-env:1")
    parse = build_parser().parse_args
    assert parse(["get", "1"]).endpoint == "http://from-env:1" and parse(["get", "1"]).json is False
    before = parse(["--endpoint", "http://a:1", "--token", "t", "--json", "get", "1"])
    after = parse(["get", "1", "--endpoint", "http://a:1", "--token", "t", "--json"])
    assert (before.endpoint, before.token, before.json) == (after.endpoint, after.token, after.json)
    assert (before.endpoint, before.token, before.json) == ("http://a:1", "t", True)
    assert parse(["--endpoint", "http://a:1", "get", "1", "--endpoint", "http://b:1"]).endpoint == "http://b:1"
    nested = parse(["--json", "schedules", "--token", "t", "list", "--ca", "ca.pem"])
    assert (nested.json, nested.token, nested.ca, nested.endpoint) == (True, "t", "ca.pem", "http://from-env:1")
    pools = parse(["--json", "pools", "pause", "default"])
    assert pools.json and pools.run is cli.cmd_pools_pause and pools.pool == "default"
    assert parse(["pools"]).run is cli.cmd_pools_list and parse(["pools", "list"]).run is cli.cmd_pools_list


def test_bulk_flags_build_the_filter() -> None:
    args = build_parser().parse_args(
        [
            *("retry", "--all-matching", "--pool", "default", "--state", "failed,cancelled", "--state", "failed"),
            *("--created-after", "2026-11-01T00:00:00Z", "--finished-before", "2026-11-02"),
            *("--key-prefix", "import-", "--error-contains", "timeout", "--extra-attempts", "2", "--dry-run"),
        ]
    )
    filt = cli.filter_of(args)
    assert filt.pool == "default" and filt.key_prefix == "import-" and filt.error_contains == "timeout"
    assert list(filt.states) == [task_pb2.TASK_STATE_FAILED, task_pb2.TASK_STATE_CANCELLED, task_pb2.TASK_STATE_FAILED]
    assert filt.created_after.ToDatetime(dt.UTC) == dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    assert filt.finished_before.ToDatetime(dt.UTC) == dt.datetime(2026, 11, 2, tzinfo=dt.UTC)
    assert not filt.HasField("created_before") and not filt.HasField("finished_after")
    assert args.extra_attempts == 2 and args.dry_run and args.task is None
    assert cli._describe(args) == (
        "--pool default --state failed,cancelled,failed --created-after 2026-11-01T00:00:00+00:00 "
        "--finished-before 2026-11-02T00:00:00+00:00 --key-prefix import- --error-contains timeout"
    )


def test_bulk_output_per_shard() -> None:
    resp = task_service_pb2.RetryTasksResponse(
        matched=40_012,
        changed=40_000,
        shards=[
            task_service_pb2.BulkShardResult(shard="cpu", matched=40_000, changed=40_000),
            task_service_pb2.BulkShardResult(shard="gpu", matched=12, changed=0),
        ],
    )
    assert cli.format_bulk("retry", resp, dry_run=False) == [
        "SHARD  MATCHED  CHANGED",
        "cpu      40000    40000",
        "gpu         12        0",
        "retried 40000 of 40012 matching task(s)",
    ]
    assert cli.format_bulk("delete", resp, dry_run=True) == [
        "SHARD  MATCHED",
        "cpu      40000",
        "gpu         12",
        "dry run: 40012 task(s) match; nothing changed",
    ]
    resp.incomplete = True
    assert cli.format_bulk("delete", resp, dry_run=True)[-1] == (
        "dry run: at least 40012 task(s) match (the count stopped at the server's time bound); nothing changed"
    )


def test_attempts_table() -> None:
    first = task_pb2.Attempt(
        attempt=1, worker_id="w-1", worker_name="host-1", outcome=task_pb2.ATTEMPT_OUTCOME_FAILED, error="boom",
        duration_ms=1500,
    )  # fmt: skip
    first.started_at.FromDatetime(NOW)
    first.ended_at.FromDatetime(NOW + dt.timedelta(milliseconds=1500))
    running = task_pb2.Attempt(attempt=2, worker_id="w-2", outcome=task_pb2.ATTEMPT_OUTCOME_RUNNING, duration_ms=80)
    running.started_at.FromDatetime(NOW + dt.timedelta(seconds=2))
    assert cli.format_attempts([first, running]) == [
        "  ATTEMPT  WORKER  STARTED                        ENDED                          DURATION  OUTCOME  ERROR",
        "        1  host-1  2025-01-01T12:00:00.000+00:00  2025-01-01T12:00:01.500+00:00  1.500s    failed   boom",
        "        2  w-2     2025-01-01T12:00:02.000+00:00  -                              80ms      running  -",
    ]


def test_pools_table_across_shards() -> None:
    snap = admin_service_pb2.GetSnapshotResponse(
        shards=[
            admin_service_pb2.ShardSnapshot(
                shard="gpu", pools=[admin_service_pb2.PoolCounts(pool="llm", pending=3, paused=True)]
            ),
            admin_service_pb2.ShardSnapshot(
                shard="cpu", pools=[admin_service_pb2.PoolCounts(pool="default", running=2, failed=1)]
            ),
        ]
    )
    assert cli.format_pools(snap) == [
        "POOL     SHARD  PAUSED  PENDING  BLOCKED  RUNNING  SUCCEEDED  FAILED  CANCELLED",
        "default  cpu    no            0        0        2          0       1          0",
        "llm      gpu    yes           3        0        0          0       0          0",
    ]


def test_answers_of_a_repeated_bulk_call_add_up() -> None:
    shard = task_service_pb2.BulkShardResult
    first = task_service_pb2.CancelTasksResponse(
        matched=300,
        changed=290,
        shards=[shard(shard="cpu", matched=300, changed=290, incomplete=True)],
        unavailable_shards=["gpu"],
        incomplete=True,
    )
    second = task_service_pb2.CancelTasksResponse(
        matched=15,
        changed=15,
        shards=[shard(shard="cpu", matched=10, changed=10), shard(shard="gpu", matched=5, changed=5)],
    )
    total = cli.add_bulk(first, second)
    assert (total.matched, total.changed, list(total.unavailable_shards)) == (315, 305, ["gpu"])
    assert not total.incomplete  # as the later answer says
    assert [(r.shard, r.matched, r.changed) for r in total.shards] == [("cpu", 310, 300), ("gpu", 5, 5)]
    assert first.matched == 300 and len(first.shards) == 1  # the answers themselves are left as they were


def tree_task(task_id: int, state: int, started_s: float | None = None, ended_s: float | None = None, key: str = ""):
    task = task_pb2.Task(id=task_id, pool="default", state=state, key=key)
    if started_s is not None:
        task.started_at.FromDatetime(NOW + dt.timedelta(seconds=started_s))
    if ended_s is not None:
        task.finished_at.FromDatetime(NOW + dt.timedelta(seconds=ended_s))
    return task


def test_a_workflow_tree_a_line_per_task_with_its_duration() -> None:
    succeeded, running, pending = (
        task_pb2.TASK_STATE_SUCCEEDED,
        task_pb2.TASK_STATE_RUNNING,
        task_pb2.TASK_STATE_PENDING,
    )
    now = NOW + dt.timedelta(seconds=90)
    tree = cli.TreeNode(
        tree_task(1, succeeded, 0, 1.25, key="root"),
        [
            cli.TreeNode(tree_task(2, succeeded, 2, 2.004), [cli.TreeNode(tree_task(4, running, 30))]),
            cli.TreeNode(tree_task(3, pending)),
        ],
    )
    dependents = [tree_task(9, pending, key="after")]
    assert cli.format_tree(tree, dependents, now) == [
        "1  default  succeeded  1.250s  key=root",
        "|-- 2  default  succeeded  4ms",
        "|   `-- 4  default  running  1m0s",  # running: until now
        "`-- 3  default  pending  -",
        "depended on by:",
        "  9  default  pending  -  key=after",
    ]
    assert cli.format_tree(cli.TreeNode(tree_task(5, pending)), [], now) == ["5  default  pending  -"]
    as_json = cli.tree_json(tree, now)
    assert (as_json["id"], as_json["duration_ms"]) == ("1", 1250)
    assert [(c["id"], c["duration_ms"]) for c in as_json["children"]] == [("2", 4), ("3", None)]
    assert as_json["children"][0]["children"][0]["duration_ms"] == 60_000


def test_workflow_flags_parse() -> None:
    parse = build_parser().parse_args
    assert parse(["get", "--tree", "7"]).tree
    assert parse(["cancel", "--descendants", "7"]).descendants
    assert parse(["submit", "--depends-on", "7", "--run-when", "ended"]).run_when == "ended"
    assert cli.filter_of(parse(["tasks", "--parent-id", "18446744073709551615"])).parent_id == 2**64 - 1
    assert cli.list_options(parse(["tasks", "--parent-id", "7"]))["filter"].parent_id == 7  # a filter, not pool/state


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["tasks", "--parent-id", "18446744073709551616"], "is not a task id"),
        (["tasks", "--parent-id", "-1"], "is not a task id"),
        (["submit", "--run-when", "later"], "invalid choice: 'later'"),
    ],
)
def test_bad_workflow_flags_are_usage_errors(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(argv)
    assert exit.value.code == 2 and words in capsys.readouterr().err
