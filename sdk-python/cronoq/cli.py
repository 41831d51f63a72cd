"""`cronoq`: submit, get, wait, cancel, retry, delete, list and watch tasks (cancel, retry and
delete also every task that matches a filter; get and cancel also a task's workflow: what it
spawned, and theirs); list workers; manage schedules; list, pause and resume pools; show a
snapshot of the cluster."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime as dt
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from google.protobuf.message import Message

# grpc core writes its own log lines to stderr ("I1201 ... Handshake failed ...", "E1201 ...
# ENHANCE_YOUR_CALM"), at ERROR level too, while the CLI says every failure in one line of its
# own: NONE silences them unless the user set GRPC_VERBOSITY. grpc reads it once, on import.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from . import __version__, errors, outbox_schema
from ._transport import RetryConfig, TlsConfig
from .client import (
    KEY_MODE_NAMES,
    RUN_WHEN_NAMES,
    TERMINAL_STATES,
    Client,
    Schedule,
    Task,
    TaskEvent,
    TaskFilter,
    payload_of,
    result_of,
    task_filter,
)
from .errors import CronoqError
from .jsonform import task_dict, to_dict
from .v1 import admin_service_pb2, schedule_service_pb2, task_pb2, task_service_pb2, worker_service_pb2

STATE_NAMES = {v: k.removeprefix("TASK_STATE_").lower() for k, v in task_pb2.TaskState.items()}

# Exit codes, one per kind of failure a script may act on; shown by `cronoq --help`.
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_WAIT_TIMEOUT = 3
EXIT_NOT_FOUND = 4
EXIT_PERMISSION = 5
EXIT_UNAVAILABLE = 6
EXIT_FAILED_PRECONDITION = 7
EXIT_TASK_UNSUCCESSFUL = 8
EXIT_INTERRUPTED = 130
EXIT_FOR_ERROR: dict[type[CronoqError], int] = {
    errors.InvalidArgument: EXIT_BAD_INPUT,
    errors.OutOfRange: EXIT_BAD_INPUT,
    errors.NotFound: EXIT_NOT_FOUND,
    errors.Unauthenticated: EXIT_PERMISSION,
    errors.PermissionDenied: EXIT_PERMISSION,
    # UNAVAILABLE to gRPC, but the credentials are at fault: no retry helps.
    errors.TlsError: EXIT_PERMISSION,
    errors.Unavailable: EXIT_UNAVAILABLE,
    errors.DeadlineExceeded: EXIT_UNAVAILABLE,
    errors.FailedPrecondition: EXIT_FAILED_PRECONDITION,
}
EXIT_CODES_HELP = f"""exit codes:
  0    done
  {EXIT_ERROR}    any other failure (INTERNAL, UNIMPLEMENTED, a file that cannot be read, ...)
  {EXIT_BAD_INPUT}    usage error or bad input: a bad option or value, INVALID_ARGUMENT, OUT_OF_RANGE
  {EXIT_BAD_INPUT}    ... and an unknown pool (a pool is a name the server is configured with)
  {EXIT_WAIT_TIMEOUT}    wait, submit --wait: the task had not ended when the timeout passed
  {EXIT_NOT_FOUND}    NOT_FOUND: no such task or schedule (or one you may not read)
  {EXIT_PERMISSION}    UNAUTHENTICATED or PERMISSION_DENIED: no, or not enough, credentials; or a
       TLS handshake that failed (a certificate not trusted, or refused)
  {EXIT_UNAVAILABLE}    UNAVAILABLE or DEADLINE_EXCEEDED: no server (or shard) answered in time; and a
       partial answer: a listing, snapshot or bulk action some shard was missing from
       (named on stderr; --json: a last line {{"unavailable_shards": [...]}}, or the field)
  {EXIT_FAILED_PRECONDITION}    FAILED_PRECONDITION: the task's state does not allow it (cancel of a
       SUCCEEDED or FAILED task, retry of a PENDING one, ...)
  {EXIT_TASK_UNSUCCESSFUL}    wait, submit --wait: the task ended FAILED or CANCELLED
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
Errors are one line on stderr: `cronoq COMMAND: CODE: message`."""


class BadInput(Exception):
    """A value the CLI refuses before calling the server (exit 2, one line)."""


MAX_TASK_ID = 2**64 - 1


def _ref(text: str, force_key: bool) -> int | str:
    """A decimal id (ASCII digits only: '²' or '١' are keys), else a key."""
    if force_key or not (text.isascii() and text.isdigit()):
        return text
    task_id = int(text)
    if task_id > MAX_TASK_ID:
        raise BadInput(f"{text} is too large for a task id (ids fit in 64 bits)")
    return task_id


def task_id_arg(text: str) -> int:
    """A task id: decimal digits, at most 64 bits."""
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_TASK_ID:
        raise argparse.ArgumentTypeError(f"{text!r} is not a task id (decimal digits, at most 64 bits)")
    return int(text)


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d)?")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
DURATION_HELP = "DURATION: a number with a unit (500ms, 30s, 5m, 2h, 1d); a bare number is seconds"


def duration_arg(text: str) -> float:
    """Seconds from "500ms", "30s", "5m", "2h", "1d" or a bare number of seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30s, 500ms, 5m, 2h or 1d")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _ts(msg: Message, field: str, timespec: str = "milliseconds") -> str:
    """A Timestamp field in ISO 8601 (UTC), or "-" when unset."""
    if not msg.HasField(field):
        return "-"
    return str(getattr(msg, field).ToDatetime(dt.UTC).isoformat(timespec=timespec))


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
    group = f"  group={task.group_key}" if task.group_key else ""
    print(
        f"task {task.id}  pool={task.pool}  key={task.key or '-'}{group}  state={STATE_NAMES[task.state]}  "
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
    if task.parent_id:
        print(f"  parent  {task.parent_id}")
    if task.HasField("start_by") or task.key_ttl_ms:
        start_by = f"start by {_ts(task, 'start_by')}" if task.HasField("start_by") else ""
        key_ttl = f"key held {_duration_text(task.key_ttl_ms)} after it ends" if task.key_ttl_ms else ""
        print("  " + "  ".join(p for p in (start_by, key_ttl) if p))
    if task.HasField("progress"):
        print(f"  progress {task.progress.value:g}  {task.progress.message}".rstrip())
    if task.snoozes or task.checkpoint:
        print(f"  snoozed {task.snoozes} time(s)  checkpoint {len(task.checkpoint)} bytes")
    for name, value in extra.items():
        print(f"  {name} {value}")


def _wrap(task: Task) -> dict[str, Any]:
    return to_dict(task_service_pb2.GetTaskResponse(task=task))["task"]


def _title(args: argparse.Namespace) -> str:
    """The command as typed ("get", "schedules put"), for messages."""
    return str(getattr(args, "title", None) or args.command)


def _client(args: argparse.Namespace, retry_for: float = 10.0) -> Client:
    if bool(args.cert) != bool(args.key_file):
        raise BadInput("give --cert and --key-file together (env CRONOQ_CERT and CRONOQ_KEY)")
    tls = TlsConfig(args.ca or None, args.cert or None, args.key_file or None) if (args.ca or args.cert) else None
    return Client(args.endpoint, token=args.token or None, tls=tls, retry=RetryConfig(max_elapsed=retry_for))


def _partial(args: argparse.Namespace, shards: Sequence[str], json_line: bool = True) -> int:
    """A listing's end: the shards missing from it named on stderr (and, for --json lines, in a
    last line of their own), and its exit code: a partial answer is EXIT_UNAVAILABLE."""
    if not shards:
        return 0
    if args.json and json_line:
        print(json.dumps({"unavailable_shards": list(shards)}))
    print(f"cronoq {_title(args)}: shards unavailable (not shown): {', '.join(shards)}", file=sys.stderr)
    return EXIT_UNAVAILABLE


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "") -> list[str]:
    """Columns as wide as their widest cell; columns of numbers (or "-") aligned right."""
    cells = [list(headers), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    right = [
        any(_number(r[i]) for r in rows) and all(_number(r[i]) or r[i] == "-" for r in rows)
        for i in range(len(headers))
    ]
    lines = []
    for row in cells:
        padded = (c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True))
        lines.append((indent + "  ".join(padded)).rstrip())
    return lines


def age(msg: Message, field: str, now: dt.datetime) -> str:
    """How long ago a Timestamp field was ("4s ago", "3m12s ago", "2h5m ago"), or "-"."""
    if not msg.HasField(field):
        return "-"
    seconds = max(0, int((now - getattr(msg, field).ToDatetime(dt.UTC)).total_seconds()))
    if seconds < 60:
        return f"{seconds}s ago"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60}s ago"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60}m ago"
    return f"{seconds // 86400}d{seconds % 86400 // 3600}h ago"


def _payload(json_flag: str, json_text: str | None, text: str | None) -> Any:
    """A JSON value from json_text, else text's bytes, else None."""
    if json_text is not None:
        try:
            return json.loads(json_text)
        except ValueError as err:
            shown = json_text if len(json_text) <= 60 else json_text[:57] + "..."
            raise BadInput(f"{json_flag} {shown!r} is not valid JSON: {err}") from None
    return text.encode() if text is not None else None


def _ms(seconds: float | None) -> int:
    """A duration flag in ms (not given: 0)."""
    return round(seconds * 1000) if seconds is not None else 0


def _resources(given: list[tuple[str, int]]) -> dict[str, int]:
    resources: dict[str, int] = {}
    for name, amount in given:
        if name in resources:
            raise BadInput(f"--resource {name!r} given twice")
        resources[name] = amount
    return resources


async def cmd_submit(args: argparse.Namespace) -> int:
    if sum(x is not None for x in (args.json_payload, args.data, args.file)) > 1:
        raise BadInput("give at most one of --payload-json, --data, --file")
    if args.run_when is not None and not args.depends_on:
        raise BadInput(f"--run-when {args.run_when}: only with --depends-on (when it runs, given them)")
    payload = _payload("--payload-json", args.json_payload, args.data)
    if args.file is not None:
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
            run_when=args.run_when,
            resources=_resources(args.resource),
            timeout=args.timeout,
            group_key=args.group_key,
            key_mode=args.key_mode,
            debounce_ms=_ms(args.debounce),
            max_debounce_ms=_ms(args.max_debounce),
            key_ttl_ms=_ms(args.key_ttl),
            start_by=args.start_by,
        )
        task, done = sub.task, True
        if args.wait is not None:
            waited = await client.wait(task.id, args.wait)
            task, done = waited.task, waited.done
    print_task(task, args.json, deduplicated=sub.deduplicated, replaced=sub.replaced)
    return _waited(args, task, done) if args.wait is not None else 0


def _waited(args: argparse.Namespace, task: Task, done: bool) -> int:
    """How a wait ended, as the exit code: 0 SUCCEEDED, else FAILED or CANCELLED (said on
    stderr), or not ended in time."""
    if not done:
        return EXIT_WAIT_TIMEOUT
    if task.state == task_pb2.TASK_STATE_SUCCEEDED:
        return 0
    print(f"cronoq {_title(args)}: task {task.id} ended {STATE_NAMES[task.state].upper()}", file=sys.stderr)
    return EXIT_TASK_UNSUCCESSFUL


GROUP_KEY_HELP = "the task's group: a pool with max_running_per_group runs its groups in turn, each up to the cap"

OUTCOME_NAMES = {v: k.removeprefix("ATTEMPT_OUTCOME_").lower() for k, v in task_pb2.AttemptOutcome.items()}


def _duration_text(ms: int) -> str:
    return (
        f"{ms}ms" if ms < 1000 else f"{ms / 1000:.3f}s" if ms < 60_000 else f"{ms // 60_000}m{ms % 60_000 / 1000:.0f}s"
    )


def format_attempts(attempts: Sequence[task_pb2.Attempt]) -> list[str]:
    """The attempt history under a task: one row per attempt, oldest first."""
    rows = [
        (
            a.attempt,
            a.worker_name or a.worker_id or "-",
            _ts(a, "started_at"),
            _ts(a, "ended_at"),
            _duration_text(a.duration_ms),
            OUTCOME_NAMES[a.outcome],
            a.error or "-",
        )
        for a in attempts
    ]
    return format_table(("ATTEMPT", "WORKER", "STARTED", "ENDED", "DURATION", "OUTCOME", "ERROR"), rows, "  ")


def _duration_ms(task: Task, now: dt.datetime) -> int | None:
    """How long the task ran: from its start to its end, or to now while it runs; None: never started."""
    if not task.HasField("started_at"):
        return None
    end = task.finished_at.ToDatetime(dt.UTC) if task.HasField("finished_at") else now
    return max(0, round((end - task.started_at.ToDatetime(dt.UTC)).total_seconds() * 1000))


@dataclass
class TreeNode:
    """A task of a workflow and the tasks its handler spawned (each a TreeNode)."""

    task: Task
    children: list[TreeNode] = field(default_factory=list)


# GetTaskResponse.children holds at most this many: past it, ListTasks by parent_id pages through them all.
MAX_CHILDREN_IN_GET = 1000
TREE_CALLS = 8  # GetTask / ListTasks calls at once while reading a tree


async def _children(client: Client, task_id: int, calls: asyncio.Semaphore) -> list[Task]:
    async with calls:
        resp = await client.get(task_id, include_children=True)
        if len(resp.children) < MAX_CHILDREN_IN_GET:
            return list(resp.children)
        return [t async for t in client.iter_tasks(filter=task_filter(parent_id=task_id))]


async def read_tree(client: Client, task: Task, calls: asyncio.Semaphore) -> TreeNode:
    """The task and what it spawned, recursively, each task's children read by its id."""
    children = await _children(client, task.id, calls)

    async def subtree(child: Task) -> TreeNode:
        # A handler spawns only with its success: a task that did not succeed has no children.
        if child.state != task_pb2.TASK_STATE_SUCCEEDED:
            return TreeNode(child)
        return await read_tree(client, child, calls)

    return TreeNode(task, list(await asyncio.gather(*(subtree(c) for c in children))))


async def _tasks_by_id(client: Client, ids: Sequence[int]) -> list[Task]:
    """These tasks (those the caller may read), in id order, by ListTasks' ids filter."""
    found: list[Task] = []
    for start in range(0, len(ids), MAX_CHILDREN_IN_GET):
        chunk = task_filter(ids=ids[start : start + MAX_CHILDREN_IN_GET])
        found += [t async for t in client.iter_tasks(filter=chunk)]
    return sorted(found, key=lambda t: t.id)


def tree_line(task: Task, now: dt.datetime) -> str:
    ms = _duration_ms(task, now)
    key = f"  key={task.key}" if task.key else ""
    return f"{task.id}  {task.pool}  {STATE_NAMES[task.state]}  {'-' if ms is None else _duration_text(ms)}{key}"


def format_tree(node: TreeNode, dependents: Sequence[Task], now: dt.datetime) -> list[str]:
    """The task, then what it spawned as a tree (recursively), then the tasks that depend on it."""
    lines = [tree_line(node.task, now)]

    def branch(children: Sequence[TreeNode], indent: str) -> None:
        for i, child in enumerate(children):
            last = i == len(children) - 1
            lines.append(f"{indent}{'`-- ' if last else '|-- '}{tree_line(child.task, now)}")
            branch(child.children, indent + ("    " if last else "|   "))

    branch(node.children, "")
    if dependents:
        lines.append("depended on by:")
        lines += [f"  {tree_line(t, now)}" for t in dependents]
    return lines


def tree_json(node: TreeNode, now: dt.datetime) -> dict[str, Any]:
    """A task as `get --json` gives it, with its duration_ms and its children, recursively."""
    return {
        **_wrap(node.task),
        "duration_ms": _duration_ms(node.task, now),
        "children": [tree_json(c, now) for c in node.children],
    }


async def get_tree(args: argparse.Namespace, client: Client, ref: int | str) -> int:
    resp = await client.get(ref, include_dependents=True)
    tree = await read_tree(client, resp.task, asyncio.Semaphore(TREE_CALLS))
    dependents = await _tasks_by_id(client, list(resp.dependents))
    now = dt.datetime.now(dt.UTC)
    if args.json:
        dependents_json = [{**_wrap(t), "duration_ms": _duration_ms(t, now)} for t in dependents]
        print(json.dumps({**tree_json(tree, now), "dependents": dependents_json}))
    else:
        print("\n".join(format_tree(tree, dependents, now)))
    return 0


async def cmd_get(args: argparse.Namespace) -> int:
    ref = _ref(args.task, args.key)
    if args.tree and args.attempts:
        raise BadInput("give --tree or --attempts, not both")
    async with _client(args) as client:
        if args.tree:
            return await get_tree(args, client, ref)
        if not args.attempts:
            print_task(await client.get(ref), args.json)
            return 0
        resp = await client.get(ref, include_attempts=True)
    if args.json:
        print(json.dumps({**_wrap(resp.task), "attempts": [to_dict(a) for a in resp.attempts]}))
        return 0
    print_task(resp.task, False)
    print("\n".join(format_attempts(resp.attempts)) if resp.attempts else "  no attempts yet")
    return 0


async def cmd_wait(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        res = await client.wait(_ref(args.task, args.key), args.timeout)
    print_task(res.task, args.json, done=res.done)
    return _waited(args, res.task, res.done)


async def cancel_descendants(args: argparse.Namespace, ref: int | str) -> int:
    """Cancels the task with what it spawned (transitively) and their dependents, whether or not
    the task itself had ended: a workflow's root has often succeeded while its children run."""
    async with _client(args) as client:
        resp = await client.cancel(ref, include_descendants=True)
    task, cancelled = resp.task, resp.descendants_cancelled
    # As in proto JSON: an int64 is a string.
    print_task(task, args.json, descendants_cancelled=str(cancelled))
    if task.state in (task_pb2.TASK_STATE_SUCCEEDED, task_pb2.TASK_STATE_FAILED):
        state = task_pb2.TaskState.Name(task.state).removeprefix("TASK_STATE_")
        print(f"cronoq cancel: task {task.id} already {state}; {cancelled} descendant(s) cancelled", file=sys.stderr)
        return 0 if cancelled else EXIT_FAILED_PRECONDITION
    return 0


async def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancels the task; one that had already ended is left as it is, and said so."""
    _single_or_bulk(args)
    if args.all_matching:
        if args.descendants:
            raise BadInput("--descendants: only with ID|KEY (one task and what it spawned)")
        return await run_bulk(args, "cancel")
    ref = _ref(args.task, args.key)
    if args.descendants:
        return await cancel_descendants(args, ref)
    async with _client(args) as client:
        before = await client.get(ref)
        # By the ref as given: the server decides what a key names (and needs) as for any cancel.
        task = before if before.state in TERMINAL_STATES else await client.cancel(ref)
    print_task(task, args.json)
    # Ended before this call: already so when read, or it finished between the read and the cancel.
    if before.state in TERMINAL_STATES or task.state in (task_pb2.TASK_STATE_SUCCEEDED, task_pb2.TASK_STATE_FAILED):
        state = task_pb2.TaskState.Name(task.state).removeprefix("TASK_STATE_")
        print(f"cronoq cancel: task {task.id} already {state}; nothing to cancel", file=sys.stderr)
        return 0 if task.state == task_pb2.TASK_STATE_CANCELLED else EXIT_FAILED_PRECONDITION
    return 0


# -- retry, delete, and the bulk form of cancel, retry and delete -----------------------------

# The flags of a bulk action's filter: (flag, their dest: task_filter's argument).
FILTER_FLAGS = (
    ("--pool", "pool"),
    ("--state", "states"),
    ("--created-after", "created_after"),
    ("--created-before", "created_before"),
    ("--finished-after", "finished_after"),
    ("--finished-before", "finished_before"),
    ("--key-prefix", "key_prefix"),
    ("--error-contains", "error_contains"),
    ("--parent-id", "parent_id"),
)
# Past tense of each action, for its summary line.
DONE = {"cancel": "cancelled", "retry": "retried", "delete": "deleted"}


def time_arg(text: str, sign: int = -1, said: str = "ago") -> dt.datetime:
    """An ISO 8601 time (no zone: UTC), or a DURATION meaning that long ago ("2h")."""
    if _DURATION.fullmatch(text.strip()):
        return dt.datetime.now(dt.UTC) + sign * dt.timedelta(seconds=duration_arg(text))
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a time such as 2026-12-01T09:30:00Z nor a DURATION {said} such as 2h"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def later_arg(text: str) -> dt.datetime:
    """An ISO 8601 time (no zone: UTC), or a DURATION meaning that long from now ("10m")."""
    return time_arg(text, 1, "from now")


def states_arg(text: str) -> list[int]:
    """One state, or several separated by commas."""
    return [state_arg(part) for part in text.split(",")]


def _given_filter_flags(args: argparse.Namespace) -> list[str]:
    return [flag for flag, dest in FILTER_FLAGS if getattr(args, dest) not in (None, [])]


def _single_or_bulk(args: argparse.Namespace) -> None:
    """ID|KEY, or --all-matching with filter flags: one or the other."""
    flags = _given_filter_flags(args)
    if args.all_matching:
        if args.task is not None:
            raise BadInput(f"give ID|KEY or --all-matching, not both (got {args.task!r})")
        return
    if args.task is None:
        raise BadInput("give the task's ID|KEY, or --all-matching with filter flags")
    bulk_only = flags + [flag for flag in ("--dry-run", "--yes") if getattr(args, flag[2:].replace("-", "_"))]
    if bulk_only:
        raise BadInput(f"{', '.join(bulk_only)}: only with --all-matching (for every task that matches)")


def filter_of(args: argparse.Namespace) -> TaskFilter:
    return task_filter(**{dest: getattr(args, dest) for _, dest in FILTER_FLAGS})


def _describe(args: argparse.Namespace) -> str:
    """The filter as typed, for the confirmation prompt."""
    parts = []
    for flag, dest in FILTER_FLAGS:
        value = getattr(args, dest)
        if value in (None, []):
            continue
        if dest == "states":
            value = ",".join(STATE_NAMES[v] for v in value)
        elif isinstance(value, dt.datetime):
            value = value.isoformat(timespec="seconds")
        parts.append(f"{flag} {value}")
    return " ".join(parts) or "(no filter)"


BulkResponse = (
    task_service_pb2.CancelTasksResponse | task_service_pb2.RetryTasksResponse | task_service_pb2.DeleteTasksResponse
)


def add_bulk(total: BulkResponse, more: BulkResponse) -> BulkResponse:
    """Two answers of the same bulk call as one: counts summed per shard; the shards not
    reached by either; incomplete as the later says."""
    merged = copy.deepcopy(total)
    merged.matched += more.matched
    merged.changed += more.changed
    by_shard = {r.shard: r for r in merged.shards}
    for result in more.shards:
        if result.shard in by_shard:
            by_shard[result.shard].matched += result.matched
            by_shard[result.shard].changed += result.changed
        else:
            merged.shards.add().CopyFrom(result)
    merged.unavailable_shards.extend(s for s in more.unavailable_shards if s not in merged.unavailable_shards)
    merged.incomplete = more.incomplete
    return merged


def format_bulk(action: str, resp: BulkResponse, dry_run: bool) -> list[str]:
    """Per shard what matched (and changed), then one line of totals."""
    if dry_run:
        rows: list[tuple[Any, ...]] = [(r.shard or "-", r.matched) for r in resp.shards]
        lines = format_table(("SHARD", "MATCHED"), rows)
        if resp.incomplete:
            return [*lines, f"dry run: at least {resp.matched} task(s) match (the count stopped at the server's "
                            "time bound); nothing changed"]  # fmt: skip
        return [*lines, f"dry run: {resp.matched} task(s) match; nothing changed"]
    rows = [(r.shard or "-", r.matched, r.changed) for r in resp.shards]
    lines = format_table(("SHARD", "MATCHED", "CHANGED"), rows)
    return [*lines, f"{DONE[action]} {resp.changed} of {resp.matched} matching task(s)"]


def _confirm(question: str) -> bool:
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


async def run_bulk(args: argparse.Namespace, action: str) -> int:
    """The bulk form: a dry run answers the counts; a real one asks first on a terminal, then
    calls again while the server answers incomplete (it stops at a time bound, and a repeated
    call goes on with what is left)."""
    filt = filter_of(args)
    progress = sys.stderr.isatty()
    async with _client(args) as client:

        async def call(dry_run: bool) -> BulkResponse:
            if action == "cancel":
                return await client.cancel_tasks(filt, dry_run=dry_run)
            if action == "delete":
                return await client.delete_tasks(filt, dry_run=dry_run)
            return await client.retry_tasks(
                filt, dry_run=dry_run, run_at=_run_at(args), extra_attempts=args.extra_attempts
            )

        if not args.dry_run and not args.yes:
            if not sys.stdin.isatty():
                raise BadInput("--all-matching changes every task that matches: give --yes (or --dry-run to count)")
            preview = await call(True)
            if not preview.matched:
                print(f"cronoq {_title(args)}: no task matches {_describe(args)}; nothing to do", file=sys.stderr)
                return _partial(args, preview.unavailable_shards, json_line=False)
            count = f"at least {preview.matched}" if preview.incomplete else str(preview.matched)
            question = f"{action} {count} task(s) that match {_describe(args)}"
            if preview.unavailable_shards:
                question += f" (shards not reached: {', '.join(preview.unavailable_shards)})"
            if not _confirm(question + "?"):
                print(f"cronoq {_title(args)}: not confirmed; nothing changed", file=sys.stderr)
                return EXIT_ERROR
        resp = await call(args.dry_run)
        while not args.dry_run and resp.incomplete:
            if progress:
                print(f"\r{DONE[action]} {resp.changed} task(s) so far...", end="", file=sys.stderr, flush=True)
            resp = add_bulk(resp, await call(False))
    if progress and not args.dry_run and resp.changed:
        print("\r\033[K", end="", file=sys.stderr)  # the progress line, erased
    print(json.dumps(to_dict(resp)) if args.json else "\n".join(format_bulk(action, resp, args.dry_run)))
    if resp.unavailable_shards:  # a partial action: said, and told by the exit code
        print(
            f"cronoq {_title(args)}: shards not reached (their tasks are not counted): "
            f"{', '.join(resp.unavailable_shards)}; run it again once they are back",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    return 0


def _run_at(args: argparse.Namespace) -> dt.datetime | None:
    if args.delay is not None:
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=args.delay)
    return args.run_at  # type: ignore[no-any-return]


async def cmd_retry(args: argparse.Namespace) -> int:
    _single_or_bulk(args)
    if args.all_matching:
        return await run_bulk(args, "retry")
    async with _client(args) as client:
        retried = await client.retry(
            _ref(args.task, args.key), run_at=_run_at(args), extra_attempts=args.extra_attempts
        )
    # As in proto JSON: an int64 is a string.
    print_task(retried.task, args.json, dependents_restored=str(retried.dependents_restored))
    return 0


async def cmd_delete(args: argparse.Namespace) -> int:
    _single_or_bulk(args)
    if args.all_matching:
        return await run_bulk(args, "delete")
    async with _client(args) as client:
        task_id = await client.delete(_ref(args.task, args.key))
    print(json.dumps({"id": str(task_id)}) if args.json else f"deleted task {task_id}")
    return 0


TASK_COLUMNS = ("ID", "POOL", "STATE", "ATTEMPT", "SHARD", "KEY", "ERROR")
ERROR_SHOWN = 60  # characters of a task's error in its row (its first line)


def _row(id_: object, pool: str, state: str, attempt: str, shard: object, key: str, error: str) -> str:
    return f"{id_:>20}  {pool:<12} {state:<10} {attempt:>7} {shard:>5}  {key:<20}  {error}".rstrip()


def task_row(task: Task) -> str:
    """One row of `cronoq tasks`: fixed widths, so that pages print as they come. SHARD is the
    shard's number (the id's top 8 bits; 0 unsharded); ERROR the first line of the last error."""
    error = task.error.splitlines()[0] if task.error else "-"
    if len(error) > ERROR_SHOWN:
        error = error[: ERROR_SHOWN - 3] + "..."
    attempt = f"{task.attempt}/{task.max_attempts}"
    return _row(task.id, task.pool, STATE_NAMES[task.state], attempt, task.id >> 56, task.key or "-", error)


def task_header() -> str:
    return _row(*TASK_COLUMNS)


def state_arg(text: str) -> int:
    """A task state by its lower-case name (pending, ..., cancelled)."""
    name = "TASK_STATE_" + text.strip().upper()
    if text.strip().lower() == "unspecified" or name not in task_pb2.TaskState.keys():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not one of " + ", ".join(STATE_NAMES[v] for v in STATE_NAMES if v)
        )
    return task_pb2.TaskState.Value(name)


def list_options(args: argparse.Namespace) -> dict[str, Any]:
    """ListTasks' arguments for the filter flags: a pool and one state as the request's own
    fields (as any server takes them), anything more as its filter."""
    given = _given_filter_flags(args)
    if set(given) <= {"--pool", "--state"} and len(args.states) <= 1:
        return {"pool": args.pool or "", "state": args.states[0] if args.states else 0}
    return {"filter": filter_of(args)}


async def cmd_tasks(args: argparse.Namespace) -> int:
    options = list_options(args)
    limit = None if args.all else args.limit
    shown, token, unavailable = 0, args.page_token, set[str]()
    progress = sys.stderr.isatty() and (limit is None or limit > 500)
    if not args.json:
        print(task_header())
    async with _client(args) as client:
        while limit is None or shown < limit:
            size = 500 if limit is None else min(500, limit - shown)
            page = await client.list(page_size=size, page_token=token, newest_first=args.newest_first, **options)
            unavailable.update(page.unavailable_shards)
            for task in page.tasks:
                print(json.dumps(_wrap(task)) if args.json else task_row(task))
            shown += len(page.tasks)
            token = page.next_page_token
            if progress:
                print(f"\rlisted {shown} task(s)...", end="", file=sys.stderr)
            if not token:
                break
    if progress:
        print(file=sys.stderr)
    if not args.json:
        print(f"{shown} task(s)", file=sys.stderr)
    if token:
        print(f"more: run with --page-token {token}", file=sys.stderr)
    return _partial(args, sorted(unavailable))


def event_line(event: TaskEvent) -> str:
    task = event.task
    return (
        f"{_ts(event, 'time')}  {task.id:>20}  {task.pool:<12} {STATE_NAMES[task.state]:<10} "
        f"{task.attempt}/{task.max_attempts}  {task.key or '-'}"
    )


def event_json(event: TaskEvent) -> dict[str, Any]:
    return to_dict(task_service_pb2.WatchResponse(event=event))["event"]


async def cmd_watch(args: argparse.Namespace) -> int:
    async with _client(args, retry_for=args.retry_for) as client:
        said = ""

        def reconnecting(err: CronoqError | None, cursor: str) -> None:
            nonlocal said
            why = str(err) if err is not None else "the server ended the stream"
            since = f"after cursor {cursor}" if cursor else "live (no cursor to resume from: events meanwhile are lost)"
            line = f"cronoq watch: {why}; reconnecting to {client.endpoint}, {since}"
            if line != said:  # one line per reason, not one per attempt while a server is down
                print(line, file=sys.stderr, flush=True)
                said = line

        async for event in client.watch(
            args.pool or None, cursor=args.cursor, include_payloads=args.include_payloads, on_reconnect=reconnecting
        ):
            print(json.dumps(event_json(event)) if args.json else event_line(event), flush=True)
            said = ""
    return 0


def format_workers(workers: Sequence[worker_service_pb2.Worker], now: dt.datetime) -> list[str]:
    rows = [(w.id, w.name, ",".join(w.pools), w.concurrency, w.running, age(w, "last_seen_at", now)) for w in workers]
    return format_table(("ID", "NAME", "POOLS", "CONCURRENCY", "RUNNING", "LAST HEARTBEAT"), rows)


async def cmd_workers(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        resp = await client.list_workers(args.pool or None)
    if args.json:
        for worker in resp.workers:
            print(json.dumps(to_dict(worker)))
    else:
        print("\n".join(format_workers(resp.workers, dt.datetime.now(dt.UTC))))
    return _partial(args, resp.unavailable_shards)


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    """The proto JSON form, with a JSON payload shown decoded as payload_json (as for tasks)."""
    return task_dict(to_dict(schedule))


def format_schedules(schedules: Sequence[Schedule]) -> list[str]:
    rows = [
        (
            s.pool,
            s.name,
            s.cron,
            s.timezone or "UTC",
            "yes" if s.paused else "no",
            _ts(s, "next_fire_at", "seconds"),
            _ts(s, "last_fire_at", "seconds"),
        )
        for s in schedules
    ]
    return format_table(("POOL", "NAME", "CRON", "TIMEZONE", "PAUSED", "NEXT FIRE", "LAST FIRE"), rows)


def resource_arg(text: str) -> tuple[str, int]:
    name, sep, amount = text.partition("=")
    try:
        if not (sep and name):
            raise ValueError
        return name, int(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=AMOUNT (an integer amount)") from None


async def cmd_schedules_put(args: argparse.Namespace) -> int:
    payload = _payload("--payload-json", args.payload_json, args.data)
    resources = _resources(args.resource)
    async with _client(args) as client:
        schedule = await client.put_schedule(
            args.pool,
            args.name,
            args.cron,
            payload=payload,
            timezone=args.timezone,
            priority=args.priority,
            max_attempts=args.max_attempts,
            resources=resources,
            timeout_ms=args.timeout_ms if args.timeout_ms is not None else round((args.timeout or 0) * 1000),
            paused=args.paused,
            fire_all_missed=args.fire_all_missed,
            group_key=args.group_key,
        )
    print(json.dumps(schedule_json(schedule)) if args.json else "\n".join(format_schedules([schedule])))
    return 0


async def cmd_schedules_delete(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        await client.delete_schedule(args.pool, args.name)
    if args.json:
        print(json.dumps(to_dict(schedule_service_pb2.DeleteScheduleRequest(pool=args.pool, name=args.name))))
    else:
        print(f"deleted schedule {args.name!r} of pool {args.pool!r}")
    return 0


async def cmd_schedules_list(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        resp = await client.list_schedules(args.pool or None)
    if args.json:
        for schedule in resp.schedules:
            print(json.dumps(schedule_json(schedule)))
    else:
        print("\n".join(format_schedules(resp.schedules)))
    return _partial(args, resp.unavailable_shards)


POOL_STATES = ("pending", "blocked", "running", "succeeded", "failed", "cancelled")


def format_snapshot(snap: admin_service_pb2.GetSnapshotResponse) -> list[str]:
    """Per shard: a header line, then tables of pools by state and of resources, and workers."""
    lines: list[str] = []
    for shard in snap.shards:
        if lines:
            lines.append("")
        lines.append(f"shard {shard.shard} (#{shard.number})  leader {shard.leader or '-'}  term {shard.term}")
        pools = [(p.pool, *(getattr(p, state) for state in POOL_STATES)) for p in shard.pools]
        lines += format_table(("POOL", *(state.upper() for state in POOL_STATES)), pools, "  ")
        if shard.resources:
            resources = [
                (
                    r.name,
                    r.in_use if r.capacity else "-",
                    r.capacity or "-",
                    f"{r.rate:g}/s" if r.rate else "-",
                    r.burst or "-",
                )
                for r in shard.resources
            ]
            lines += format_table(("RESOURCE", "IN USE", "CAPACITY", "RATE", "BURST"), resources, "  ")
        running = sum(w.running for w in shard.workers)
        lines.append(f"  workers: {len(shard.workers)}, running {running} task(s)")
        for o in shard.outboxes:
            error = f"; last step failed: {o.last_error}" if o.last_error else ""
            lines.append(
                f"  outbox {o.name}: {o.pending} waiting, oldest {o.lag_seconds:.3f} s;"
                f" relayed {o.relayed}, dead {o.dead}{error}"
            )
    return lines


def pool_rows(snap: admin_service_pb2.GetSnapshotResponse) -> list[tuple[str, admin_service_pb2.PoolCounts]]:
    """(shard, counts) of every pool, by pool name."""
    return sorted(((shard.shard, p) for shard in snap.shards for p in shard.pools), key=lambda r: (r[1].pool, r[0]))


def format_pools(snap: admin_service_pb2.GetSnapshotResponse) -> list[str]:
    rows = [
        (p.pool, shard or "-", "yes" if p.paused else "no", *(getattr(p, state) for state in POOL_STATES))
        for shard, p in pool_rows(snap)
    ]
    return format_table(("POOL", "SHARD", "PAUSED", *(state.upper() for state in POOL_STATES)), rows)


async def cmd_pools_list(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        snap = await client.snapshot()
    if args.json:
        for shard, counts in pool_rows(snap):
            print(json.dumps({**to_dict(counts), "shard": shard}))
    else:
        print("\n".join(format_pools(snap)))
    return _partial(args, snap.unavailable_shards)


async def cmd_pools_pause(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        if args.pools_command == "pause":
            pause = await client.pause_pool(args.pool)
        else:
            pause = await client.resume_pool(args.pool)
    if args.json:
        print(json.dumps(to_dict(pause)))
    elif pause.paused:
        print(f"pool {pause.pool} paused since {_ts(pause, 'paused_at', 'seconds')} by {pause.paused_by or '-'}")
    else:
        print(f"pool {pause.pool} not paused: its tasks are leased")
    return 0


async def _outbox_connection(url: str) -> Any:
    try:
        import asyncpg
    except ImportError:
        raise BadInput("the outbox commands need asyncpg: pip install 'cronoq-sdk[asyncpg]'") from None
    return await asyncpg.connect(url, timeout=10)


async def cmd_outbox_install(args: argparse.Namespace) -> int:
    try:
        statements = outbox_schema.ddl(args.schema)
    except ValueError as err:
        raise BadInput(str(err)) from None
    if args.print:
        print(";\n\n".join(statements) + ";")
        return 0
    if not args.url:
        raise BadInput("--url: required (or --print to only print the DDL)")
    conn = await _outbox_connection(args.url)
    try:
        async with conn.transaction():
            # One installer at a time; the statements are idempotent, so a second run changes nothing.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('cronoq_outbox_install'))")
            for sql in statements:
                await conn.execute(sql)
            version = await conn.fetchval(outbox_schema.version_query(args.schema))
    finally:
        await conn.close()
    table = f"{outbox_schema.quoted(args.schema)}.{outbox_schema.TABLE}"
    if args.json:
        print(json.dumps({"schema": args.schema, "table": table, "version": version}))
    else:
        print(f"outbox {table} installed (version {version})")
    return 0


async def cmd_outbox_status(args: argparse.Namespace) -> int:
    try:
        schema = outbox_schema.quoted(args.schema)
    except ValueError as err:
        raise BadInput(str(err)) from None
    conn = await _outbox_connection(args.url)
    try:
        row = await conn.fetchrow(
            f"SELECT (SELECT count(*) FROM {schema}.cronoq_outbox),"
            f" (SELECT extract(epoch FROM clock_timestamp() - min(created_at)) FROM {schema}.cronoq_outbox),"
            f" (SELECT count(*) FROM {schema}.cronoq_outbox_dead), ({outbox_schema.version_query(args.schema)})"
        )
    finally:
        await conn.close()
    status = {"schema": args.schema, "pending": row[0], "lag_seconds": float(row[1] or 0), "dead": row[2]}
    status["version"] = row[3]
    if args.json:
        print(json.dumps(status))
    else:
        print(f"pending {status['pending']}, oldest {status['lag_seconds']:.3f} s, dead {status['dead']}"
              f" (version {status['version']})")  # fmt: skip
    return 0


async def cmd_snapshot(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        snap = await client.snapshot()
    print(json.dumps(to_dict(snap)) if args.json else "\n".join(format_snapshot(snap)))
    return _partial(args, snap.unavailable_shards, json_line=False)  # the object has the field


class HelpFormatter(argparse.HelpFormatter):
    """Wraps each paragraph of a description or epilog on its own; keeps a paragraph with
    indented lines (a table) as it is."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            lines = paragraph.splitlines()
            if any(line.startswith("  ") for line in lines):
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(super()._fill_text(paragraph, width, indent))
        return "\n\n".join(paragraphs)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the command, with exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see {self.prog} --help)\n")


def add_global_flags(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """--endpoint, --token, the TLS files and --json. On the top parser (defaults: from the
    environment) they go before the command; on each command's (defaults SUPPRESSed, so a value
    given before the command stands) after it: `cronoq --endpoint X get 1` = `cronoq get 1 --endpoint X`."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    group = parser.add_argument_group("global options (before or after the command)")
    group.add_argument(
        "--endpoint",
        default=default(os.environ.get("CRONOQ_ENDPOINT", "http://127.0.0.1:7070")),
        help="http://host:port, or https://host:port for TLS; several, separated by commas (env CRONOQ_ENDPOINT)",
    )
    group.add_argument(
        "--token", default=default(os.environ.get("CRONOQ_TOKEN")), help="bearer token (env CRONOQ_TOKEN)"
    )
    group.add_argument(
        "--ca",
        default=default(os.environ.get("CRONOQ_CA")),
        help="CA bundle (PEM) the server's certificate must chain to, for https:// endpoints; "
        "default: the system's roots (env CRONOQ_CA)",
    )
    group.add_argument(
        "--cert",
        default=default(os.environ.get("CRONOQ_CERT")),
        help="client certificate (PEM), for servers that require one (env CRONOQ_CERT)",
    )
    group.add_argument(
        "--key-file",
        dest="key_file",  # not "key": submit's --key (a task key) and get's --key (by key) have that dest
        default=default(os.environ.get("CRONOQ_KEY")),
        help="the client certificate's private key (PEM, unencrypted) (env CRONOQ_KEY)",
    )
    group.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON (proto field names, ids as strings)"
    )


BULK_HELP = f"""With --all-matching, the filter flags choose the tasks: those that match every flag given.
--dry-run counts them per shard and changes nothing. Otherwise, on a terminal, the count is
shown and the action asked for first (--yes: do not ask; not on a terminal, --yes is needed).
A shard that cannot be reached is named on stderr, and the exit code is then {EXIT_UNAVAILABLE}: run it again
once the shard is back (a repeated action changes only what it has not changed yet).

TIME: an ISO 8601 time (2026-12-01T09:30:00Z; no zone: UTC), or a DURATION ago (2h).

{DURATION_HELP}."""


def add_task_or_filter(parser: argparse.ArgumentParser, action: str) -> None:
    """ID|KEY for one task, or --all-matching and the filter flags for a bulk action."""
    parser.add_argument("task", metavar="ID|KEY", nargs="?", help="a decimal id, or else a key")
    parser.add_argument("--key", action="store_true", help="treat ID|KEY as a key even if it is all digits")
    bulk = parser.add_argument_group("every task that matches (instead of ID|KEY)")
    bulk.add_argument("--all-matching", action="store_true", help=f"{action} every task that matches the flags below")
    add_filter_flags(bulk, "every pool you may act on", "every state the action applies to")
    bulk.add_argument("--dry-run", action="store_true", help="count the tasks that match, per shard; change nothing")
    bulk.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def add_filter_flags(group: Any, every_pool: str, every_state: str) -> None:
    """The filter flags (FILTER_FLAGS) of the bulk actions and `tasks`: one filter for both."""
    group.add_argument("--pool", help=f"of this pool (default: {every_pool})")
    group.add_argument(
        "--state",
        dest="states",
        type=states_arg,
        action="extend",
        default=[],
        metavar="STATE",
        help=f"in this state (repeatable, or comma-separated; default: {every_state})",
    )
    for flag, what in (("created", "created"), ("finished", "ended")):
        group.add_argument(f"--{flag}-after", type=time_arg, metavar="TIME", help=f"{what} at or after TIME")
        group.add_argument(f"--{flag}-before", type=time_arg, metavar="TIME", help=f"{what} before TIME")
    group.add_argument("--key-prefix", metavar="PREFIX", help="whose key starts with PREFIX")
    group.add_argument("--error-contains", metavar="TEXT", help="whose error contains TEXT (case-sensitive)")
    group.add_argument("--parent-id", type=task_id_arg, metavar="ID", help="spawned by the handler of task ID")


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    add_global_flags(common, defaults=False)

    parser = Parser(
        prog="cronoq",
        description="Submit, inspect, watch, cancel, retry and delete cronoq tasks (one, or every task that "
        "matches a filter); list workers; manage schedules; list, pause and resume pools.",
        epilog=f"{DURATION_HELP}.\n\n{EXIT_CODES_HELP}",
    )
    parser.add_argument("--version", action="version", version=f"cronoq {__version__}")
    add_global_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str, description: str, parents: Sequence[argparse.ArgumentParser] = (common,),
                subparsers: Any = sub, **options: Any) -> argparse.ArgumentParser:  # fmt: skip
        return subparsers.add_parser(name, parents=list(parents), help=text, description=description, **options)

    p = command("submit", "submit a task", "Submit one task.", epilog=DURATION_HELP)
    p.add_argument("--pool", default="default")
    p.add_argument("--key", help="deduplication key (unique within a shard)")
    p.add_argument(
        "--key-mode",
        choices=sorted(KEY_MODE_NAMES),
        help="when --key already names a task: return it unchanged (return_existing), give a PENDING one this "
        "payload, priority and due time (replace_pending), or that and due --debounce after this submission "
        "(debounce); default: the pool's default_key_mode",
    )
    p.add_argument(
        "--debounce",
        type=duration_arg,
        metavar="DURATION",
        help="with --key-mode debounce: due this long after the latest submission",
    )
    p.add_argument(
        "--max-debounce",
        type=duration_arg,
        metavar="DURATION",
        help="with --key-mode debounce: due at most this long after the first submission",
    )
    p.add_argument(
        "--key-ttl",
        type=duration_arg,
        metavar="DURATION",
        help="the key is free again this long after the task ended (unique for a period)",
    )
    p.add_argument(
        "--start-by",
        type=later_arg,
        metavar="TIME",
        help="if it has not started by then (a time, or a DURATION from now), it ends EXPIRED without running",
    )
    p.add_argument("--json-payload", "--payload-json", dest="json_payload", metavar="JSON", help="a JSON payload")
    p.add_argument("--data", help="a text payload, stored as bytes")
    p.add_argument("--file", help="payload bytes from a file ('-' for stdin)")
    p.add_argument("--priority", type=int, default=0, help="higher runs first")
    p.add_argument("--group-key", default="", metavar="KEY", help=GROUP_KEY_HELP)
    p.add_argument("--max-attempts", type=int, default=0, help="0 takes the pool's default")
    p.add_argument("--delay", type=duration_arg, metavar="DURATION", help="how long before the task may start")
    p.add_argument("--depends-on", action="append", default=[], metavar="ID|KEY", help="repeatable")
    p.add_argument(
        "--run-when",
        choices=sorted(RUN_WHEN_NAMES),
        help="with --depends-on: run once they all succeeded (the default), or once they all ended, "
        "however (a finalizer: its handler sees each one's state and error)",
    )
    p.add_argument(
        "--resource",
        type=resource_arg,
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="a resource the task needs while it runs (repeatable)",
    )
    p.add_argument(
        "--timeout", type=duration_arg, metavar="DURATION", help="each attempt's timeout (capped by the pool's)"
    )
    p.add_argument(
        "--wait",
        type=duration_arg,
        metavar="DURATION",
        help="wait that long for the task to end (exit 3 if it has not)",
    )
    p.set_defaults(run=cmd_submit)

    p = command("get", "show a task", "Show a task by id or key.")
    p.add_argument("task", metavar="ID|KEY", help="a decimal id, or else a key")
    p.add_argument("--key", action="store_true", help="treat ID|KEY as a key even if it is all digits")
    p.add_argument(
        "--attempts",
        action="store_true",
        help="and its attempts, oldest first: worker, start, end, duration, outcome, error (--json: attempts)",
    )
    p.add_argument(
        "--tree",
        action="store_true",
        help="its workflow instead: the task, the tasks its handler spawned and theirs, as a tree, then the "
        "tasks that depend on it; a line each: id, pool, state, duration (start to end, or to now while it "
        "runs), key (--json: one nested object: each task with duration_ms and children; dependents)",
    )
    p.set_defaults(run=cmd_get)

    p = command(
        "cancel",
        "cancel a task, or every task that matches",
        "Cancel a task by id or key: a PENDING or BLOCKED task ends CANCELLED, a RUNNING one is asked to stop. "
        "A task that had already ended is left as it is, said so on stderr: exit 0 if it was CANCELLED, "
        f"{EXIT_FAILED_PRECONDITION} if it SUCCEEDED or FAILED. With --descendants: also the tasks its handler "
        "spawned, theirs, and so on, with the tasks that depend on any of them (said: descendants_cancelled), "
        f"even when the task itself has ended (exit {EXIT_FAILED_PRECONDITION} only if it had and nothing was "
        "cancelled). With --all-matching: every unfinished task that matches the filter flags, on every shard.",
        epilog=BULK_HELP,
    )
    add_task_or_filter(p, "cancel")
    p.add_argument(
        "--descendants",
        action="store_true",
        help="also cancel what the task spawned (transitively) and their dependents, in pools you may cancel in",
    )
    p.set_defaults(run=cmd_cancel)

    p = command(
        "retry",
        "run a FAILED or CANCELLED task again, or every one that matches",
        "Put a FAILED or CANCELLED task back to PENDING, due now (or --run-at, --delay), keeping its attempts "
        "and their history; a task that used all its attempts gets --extra-attempts more (default 1). A task in "
        f"another state is refused (FAILED_PRECONDITION, exit {EXIT_FAILED_PRECONDITION}). With --all-matching: "
        "every FAILED and CANCELLED task that matches the filter flags, on every shard.",
        epilog=BULK_HELP,
    )
    add_task_or_filter(p, "retry")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--run-at", type=time_arg, metavar="TIME", help="when it may run again (default: now)")
    when.add_argument("--delay", type=duration_arg, metavar="DURATION", help="how long from now it may run again")
    p.add_argument(
        "--extra-attempts",
        type=int,
        default=0,
        metavar="N",
        help="attempts given to a task that used all of its own (default 0: one more)",
    )
    p.set_defaults(run=cmd_retry)

    p = command(
        "delete",
        "delete an ended task, or every one that matches",
        "Delete a SUCCEEDED, FAILED or CANCELLED task with its attempts and events (another state is refused: "
        f"exit {EXIT_FAILED_PRECONDITION}). With --all-matching: every ended task that matches the filter "
        "flags, on every shard.",
        epilog=BULK_HELP,
    )
    add_task_or_filter(p, "delete")
    p.set_defaults(run=cmd_delete)

    p = command(
        "wait",
        "wait for a task to end",
        "Wait until the task ends or the timeout passes (exit 3 on timeout).",
        epilog=DURATION_HELP,
    )
    p.add_argument("task", metavar="ID|KEY")
    p.add_argument("--key", action="store_true", help="treat ID|KEY as a key even if it is all digits")
    p.add_argument("--timeout", type=duration_arg, default=30.0, metavar="DURATION", help="default 30s")
    p.set_defaults(run=cmd_wait)

    p = command(
        "tasks",
        "list tasks",
        "List tasks in id order (--newest-first: newest created first), a row each under a header (--json: one object "
        "per line). When more remain than --limit, stderr says the --page-token to go on from; --all lists every "
        "page. The filter flags match as those of cancel, retry and delete --all-matching do: the tasks a bulk "
        "--dry-run counted are those listed with the same flags.",
        epilog=f"TIME: an ISO 8601 time (2026-12-01T09:30:00Z; no zone: UTC), or a DURATION ago (2h).\n\n"
        f"{DURATION_HELP}.",
    )
    add_filter_flags(
        p.add_argument_group("filter (every flag given must match)"),
        "every pool you may read",
        "every state; pending, blocked, running, succeeded, failed or cancelled",
    )
    pages = p.add_mutually_exclusive_group()
    pages.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    pages.add_argument("--all", action="store_true", help="every task, page after page (progress on stderr)")
    p.add_argument("--page-token", default="", metavar="TOKEN", help="go on from where a listing stopped")
    p.add_argument(
        "--newest-first", action="store_true", help="newest created first, across shards too (then --page-token: older)"
    )
    p.set_defaults(run=cmd_tasks)

    p = command(
        "watch",
        "print task events as they happen",
        "Print one line per task event as it happens (--json: one object per line, with the cursor "
        "to resume from) until Ctrl-C (exit 130). When the stream breaks (a server restart, a new leader) it "
        "reconnects, saying so on stderr, from the last event's cursor: the events in between are printed, "
        "none twice.",
        epilog=DURATION_HELP,
    )
    p.add_argument("--pool", default="", help="one pool (default: every pool you may read)")
    p.add_argument("--cursor", help="start after this event's cursor (from --json output) instead of live")
    p.add_argument("--include-payloads", action="store_true", help="events carry payloads and results")
    p.add_argument(
        "--retry-for",
        type=duration_arg,
        default=60.0,
        metavar="DURATION",
        help="give up when no server answers for this long after the stream breaks (default 60s)",
    )
    p.set_defaults(run=cmd_watch)

    p = command(
        "workers",
        "list workers",
        "List registered workers: id, name, pools, concurrency, tasks running, last heartbeat.",
    )
    p.add_argument("--pool", default="", help="only workers of this pool")
    p.set_defaults(run=cmd_workers)

    p = command(
        "schedules",
        "put, delete and list schedules",
        "Cron schedules that create tasks in a pool, named by (pool, name).",
    )
    schedules = p.add_subparsers(dest="schedules_command", required=True, metavar="SUBCOMMAND")
    p = command(
        "put",
        "create or replace a schedule",
        "Create or replace the schedule NAME of POOL; prints it with its next fire time.",
        subparsers=schedules,
        epilog=DURATION_HELP,
    )
    p.add_argument("pool", metavar="POOL")
    p.add_argument("name", metavar="NAME")
    p.add_argument(
        "--cron",
        required=True,
        metavar="EXPR",
        help="five fields (minute hour day-of-month month day-of-week), or six with seconds first",
    )
    p.add_argument("--timezone", metavar="ZONE", help="IANA timezone name, e.g. Europe/Paris (default UTC)")
    payload = p.add_mutually_exclusive_group()
    payload.add_argument(
        "--payload-json",
        "--json-payload",
        dest="payload_json",
        metavar="JSON",
        help="a JSON payload for every task it fires",
    )
    # --data as submit's; --payload: its old spelling, still taken.
    payload.add_argument("--data", "--payload", dest="data", metavar="TEXT", help="a text payload, stored as bytes")
    p.add_argument("--priority", type=int, default=0, help="of the tasks it fires; higher runs first")
    p.add_argument("--group-key", default="", metavar="KEY", help=f"of the tasks it fires: {GROUP_KEY_HELP}")
    p.add_argument("--max-attempts", type=int, default=0, help="of the tasks it fires; 0 takes the pool's default")
    p.add_argument(
        "--resource",
        type=resource_arg,
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="a resource each fired task needs (repeatable)",
    )
    timeout = p.add_mutually_exclusive_group()
    timeout.add_argument(
        "--timeout", type=duration_arg, metavar="DURATION", help="each fired task's timeout (default: the pool's)"
    )
    timeout.add_argument("--timeout-ms", type=int, help=argparse.SUPPRESS)  # deprecated: --timeout 1500ms
    p.add_argument("--paused", action="store_true", help="keep it, but fire nothing until put again without this")
    p.add_argument(
        "--fire-all-missed", action="store_true", help="after downtime, fire every missed slot (not only the latest)"
    )
    p.set_defaults(run=cmd_schedules_put, title="schedules put")

    p = command("delete", "delete a schedule", "Delete the schedule NAME of POOL.", subparsers=schedules)
    p.add_argument("pool", metavar="POOL")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(run=cmd_schedules_delete, title="schedules delete")

    p = command(
        "list",
        "list schedules",
        "List schedules: pool, name, cron, timezone, paused, next and last fire (UTC).",
        subparsers=schedules,
    )
    p.add_argument("--pool", default="", help="only schedules of this pool")
    p.set_defaults(run=cmd_schedules_list, title="schedules list")

    p = command(
        "pools",
        "list pools (with task counts and paused), pause or resume one",
        "Without a subcommand (or with list): every pool, its shard, whether it is paused and its tasks by "
        "state. pause POOL: lease none of its tasks (stored; submissions and schedule fires are still taken, "
        "running tasks finish); resume POOL: lease them again.",
    )
    p.set_defaults(run=cmd_pools_list, title="pools")
    pools = p.add_subparsers(dest="pools_command", metavar="SUBCOMMAND")
    p = command("list", "list pools", "Every pool: shard, paused, tasks by state.", subparsers=pools)
    p.set_defaults(run=cmd_pools_list, title="pools list")
    for name, text in (("pause", "stop leasing a pool's tasks"), ("resume", "lease a paused pool's tasks again")):
        p = command(name, text, f"{text[0].upper()}{text[1:]}; prints whether it is paused, since when, by whom.",
                    subparsers=pools)  # fmt: skip
        p.add_argument("pool", metavar="POOL")
        p.set_defaults(run=cmd_pools_pause, title=f"pools {name}")

    p = command(
        "snapshot",
        "show the state of every shard",
        "Per shard: its leader and term, task counts by pool and state, resources in use, workers.",
    )
    p.set_defaults(run=cmd_snapshot)

    p = command(
        "outbox",
        "install and inspect an outbox",
        "The outbox: tasks an application inserts in its own PostgreSQL transactions "
        "(cronoq.outbox.enqueue), relayed to cronoq by the servers configured with [[outboxes]].",
    )
    outbox = p.add_subparsers(dest="outbox_command", required=True, metavar="SUBCOMMAND")
    for name, text, description in (
        (
            "install",
            "create or upgrade the outbox tables",
            "Create (or bring up to this release's version) the outbox tables in the application's "
            "database: cronoq_outbox, cronoq_outbox_dead, cronoq_outbox_meta and the insert trigger that "
            "wakes the relay. Idempotent; --print prints the DDL instead, for your own migrations.",
        ),
        ("status", "show an outbox's backlog", "Rows waiting, the oldest one's age, rows in the dead table."),
    ):
        p = command(name, text, description, subparsers=outbox)
        p.add_argument("--url", required=name == "status", help="the application's PostgreSQL URL")
        p.add_argument("--schema", default=outbox_schema.DEFAULT_SCHEMA, help="the outbox's schema (default cronoq)")
        if name == "install":
            p.add_argument("--print", action="store_true", help="print the DDL, change nothing")
        p.set_defaults(run=cmd_outbox_install if name == "install" else cmd_outbox_status, title=f"outbox {name}")
    return parser


RETRY_NOTICE_AFTER_S = 1.0


class RetryNotice(logging.Handler):
    """The SDK's log while a command runs: once its transport has retried an unanswered call
    (UNAVAILABLE) for RETRY_NOTICE_AFTER_S, one line on stderr says so (it retries for 10s);
    warnings pass on to stderr as logging's last resort shows them."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(logging.DEBUG)
        self.args, self.started, self.said = args, time.monotonic(), False

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            print(record.getMessage(), file=sys.stderr)
            return
        # The transport's "<method>: <error>; retrying in <delay>" (with_retries).
        retrying = isinstance(record.args, tuple) and len(record.args) == 3 and "retrying in" in str(record.msg)
        if retrying and not self.said and time.monotonic() - self.started >= RETRY_NOTICE_AFTER_S:
            self.said = True
            error = record.args[1]  # type: ignore[index]
            print(f"cronoq {_title(self.args)}: {error}; retrying (Ctrl-C to stop)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sdk_log = logging.getLogger("cronoq")
    notice, level = RetryNotice(args), sdk_log.level
    sdk_log.addHandler(notice)
    sdk_log.setLevel(logging.DEBUG)
    try:
        code = asyncio.run(args.run(args))
    except CronoqError as err:
        print(f"cronoq {_title(args)}: {err}", file=sys.stderr)
        code = next((code for kind, code in EXIT_FOR_ERROR.items() if isinstance(err, kind)), EXIT_ERROR)
    except BadInput as err:
        print(f"cronoq {_title(args)}: {err}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C: how `watch` is meant to end; any command, no traceback
        code = EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed by the reader (`cronoq watch | head`): quiet, as if by SIGPIPE
        with contextlib.suppress(OSError):  # the exit's flush of stdout must not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    except OSError as err:
        print(f"cronoq {_title(args)}: {err}", file=sys.stderr)
        code = EXIT_ERROR
    finally:
        sdk_log.removeHandler(notice)
        sdk_log.setLevel(level)
    sys.exit(code)


if __name__ == "__main__":
    main()
