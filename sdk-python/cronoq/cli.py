"""`cronoq`: submit, get, wait, cancel and list tasks from the shell."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from typing import Any

from . import __version__
from ._transport import RetryConfig, TlsConfig
from .client import Client, Task, payload_of, result_of
from .errors import CronoqError
from .jsonform import to_dict
from .v1 import task_pb2, task_service_pb2

STATE_NAMES = {v: k.removeprefix("TASK_STATE_").lower() for k, v in task_pb2.TaskState.items()}


MAX_TASK_ID = 2**64 - 1


def _ref(text: str, force_key: bool) -> int | str:
    """A decimal id (ASCII digits only: '²' or '١' are keys), else a key."""
    if force_key or not (text.isascii() and text.isdigit()):
        return text
    task_id = int(text)
    if task_id > MAX_TASK_ID:
        raise SystemExit(f"cronoq: {text} is too large for a task id (ids fit in 64 bits)")
    return task_id


def _ts(task: Task, field: str) -> str:
    if not task.HasField(field):  # type: ignore[arg-type]
        return "-"
    return str(getattr(task, field).ToDatetime(dt.UTC).isoformat(timespec="milliseconds"))


def _show(value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value.hex()
    return json.dumps(value)


def print_task(task: Task, as_json: bool, **extra: Any) -> None:
    if as_json:
        print(json.dumps({**_wrap(task), **extra}))
        return
    print(
        f"task {task.id}  pool={task.pool}  key={task.key or '-'}  state={STATE_NAMES[task.state]}  "
        f"attempt={task.attempt}/{task.max_attempts}"
    )
    print(
        f"  created {_ts(task, 'created_at')}  started {_ts(task, 'started_at')}  finished {_ts(task, 'finished_at')}"
    )
    if task.payload:
        print(f"  payload {_show(payload_of(task))}")
    if task.result:
        print(f"  result  {_show(result_of(task))}")
    if task.error:
        print(f"  error   {task.error}")
    for name, value in extra.items():
        print(f"  {name} {value}")


def _wrap(task: Task) -> dict[str, Any]:
    return to_dict(task_service_pb2.GetTaskResponse(task=task))["task"]


def _client(args: argparse.Namespace) -> Client:
    if bool(args.cert) != bool(args.key_file):
        raise SystemExit(f"cronoq {args.command}: give --cert and --key-file together (env CRONOQ_CERT and CRONOQ_KEY)")
    tls = TlsConfig(args.ca or None, args.cert or None, args.key_file or None) if (args.ca or args.cert) else None
    return Client(args.endpoint, token=args.token or None, tls=tls, retry=RetryConfig(max_elapsed=10))


async def cmd_submit(args: argparse.Namespace) -> int:
    if sum(x is not None for x in (args.json_payload, args.data, args.file)) > 1:
        raise SystemExit("cronoq submit: give at most one of --json, --data, --file")
    payload: Any = None
    if args.json_payload is not None:
        try:
            payload = json.loads(args.json_payload)
        except ValueError as err:
            raise SystemExit(f"cronoq submit: --json is not valid JSON: {err}") from None
    elif args.data is not None:
        payload = args.data.encode()
    elif args.file is not None:
        payload = sys.stdin.buffer.read() if args.file == "-" else open(args.file, "rb").read()
    async with _client(args) as client:
        sub = await client.submit(
            args.pool,
            payload,
            key=args.key,
            priority=args.priority,
            max_attempts=args.max_attempts,
            delay=args.delay,
            depends_on=[_ref(d, False) for d in args.depends_on],
        )
        task = sub.task
        if args.wait is not None:
            task = (await client.wait(task.id, args.wait)).task
    print_task(task, args.json, deduplicated=sub.deduplicated)
    return 0


async def cmd_get(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        print_task(await client.get(_ref(args.task, args.key)), args.json)
    return 0


async def cmd_wait(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        res = await client.wait(_ref(args.task, args.key), args.timeout)
    print_task(res.task, args.json, done=res.done)
    return 0 if res.done else 3


async def cmd_cancel(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        print_task(await client.cancel(_ref(args.task, args.key)), args.json)
    return 0


async def cmd_tasks(args: argparse.Namespace) -> int:
    state = 0
    if args.state:
        name = "TASK_STATE_" + args.state.upper()
        if name not in task_pb2.TaskState.keys():
            raise SystemExit(
                f"cronoq tasks: --state {args.state!r} is not one of "
                + ", ".join(STATE_NAMES[v] for v in STATE_NAMES if v)
            )
        state = task_pb2.TaskState.Value(name)
    shown, token = 0, ""
    async with _client(args) as client:
        while shown < args.limit:
            page = await client.list(args.pool, state, min(500, args.limit - shown), token)
            for task in page.tasks:
                if args.json:
                    print(json.dumps(_wrap(task)))
                else:
                    print(
                        f"{task.id:>20}  {task.pool:<12} {STATE_NAMES[task.state]:<10} "
                        f"{task.attempt:>3}  {task.key or '-'}"
                    )
            shown += len(page.tasks)
            token = page.next_page_token
            if args.limit > 500 and sys.stderr.isatty():
                print(f"\rlisted {shown} task(s)...", end="", file=sys.stderr)
            if not token:
                break
    if args.limit > 500 and sys.stderr.isatty():
        print(file=sys.stderr)
    if not args.json:
        print(f"{shown} task(s)" + ("; more remain (raise --limit)" if token else ""), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--endpoint",
        default=os.environ.get("CRONOQ_ENDPOINT", "http://127.0.0.1:7070"),
        help="http://host:port, or https://host:port for TLS (env CRONOQ_ENDPOINT)",
    )
    common.add_argument("--token", default=os.environ.get("CRONOQ_TOKEN"), help="bearer token (env CRONOQ_TOKEN)")
    common.add_argument(
        "--ca",
        default=os.environ.get("CRONOQ_CA"),
        help="CA bundle (PEM) the server's certificate must chain to, for https:// endpoints; "
        "default: the system's roots (env CRONOQ_CA)",
    )
    common.add_argument(
        "--cert",
        default=os.environ.get("CRONOQ_CERT"),
        help="client certificate (PEM), for servers that require one (env CRONOQ_CERT)",
    )
    common.add_argument(
        "--key-file",
        dest="key_file",  # not "key": submit's --key (a task key) and get's --key (by key) have that dest
        default=os.environ.get("CRONOQ_KEY"),
        help="the client certificate's private key (PEM, unencrypted) (env CRONOQ_KEY)",
    )
    common.add_argument("--json", action="store_true", help="print JSON (proto field names, ids as strings)")

    parser = argparse.ArgumentParser(prog="cronoq", description="Submit and inspect cronoq tasks.")
    parser.add_argument("--version", action="version", version=f"cronoq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("submit", parents=[common], help="submit a task", description="Submit one task.")
    p.add_argument("--pool", default="default")
    p.add_argument("--key", help="deduplication key (unique within a shard)")
    p.add_argument("--json-payload", "--payload-json", dest="json_payload", metavar="JSON", help="a JSON payload")
    p.add_argument("--data", help="a text payload, stored as bytes")
    p.add_argument("--file", help="payload bytes from a file ('-' for stdin)")
    p.add_argument("--priority", type=int, default=0, help="higher runs first")
    p.add_argument("--max-attempts", type=int, default=0, help="0 takes the pool's default")
    p.add_argument("--delay", type=float, help="seconds before the task may start")
    p.add_argument("--depends-on", action="append", default=[], metavar="ID|KEY", help="repeatable")
    p.add_argument("--wait", type=float, metavar="SECONDS", help="wait for the task to end")
    p.set_defaults(run=cmd_submit)

    for name, fn, text in (("get", cmd_get, "show a task"), ("cancel", cmd_cancel, "cancel a task")):
        p = sub.add_parser(name, parents=[common], help=text, description=f"{text.capitalize()} by id or key.")
        p.add_argument("task", metavar="ID|KEY", help="a decimal id, or else a key")
        p.add_argument("--key", action="store_true", help="treat ID|KEY as a key even if it is all digits")
        p.set_defaults(run=fn)

    p = sub.add_parser(
        "wait",
        parents=[common],
        help="wait for a task to end",
        description="Wait until the task ends or the timeout passes (exit 3 on timeout).",
    )
    p.add_argument("task", metavar="ID|KEY")
    p.add_argument("--key", action="store_true", help="treat ID|KEY as a key even if it is all digits")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")
    p.set_defaults(run=cmd_wait)

    p = sub.add_parser("tasks", parents=[common], help="list tasks", description="List tasks in id order.")
    p.add_argument("--pool", default="")
    p.add_argument("--state", help="pending, blocked, running, succeeded, failed or cancelled")
    p.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    p.set_defaults(run=cmd_tasks)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = asyncio.run(args.run(args))
    except CronoqError as err:
        print(f"cronoq {args.command}: {err}", file=sys.stderr)
        code = 1
    except OSError as err:
        print(f"cronoq {args.command}: {err}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
