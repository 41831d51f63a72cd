"""The conformance driver of the Python SDK: one case's input as JSON on stdin, one result as
JSON on stdout (the protocol is in conformance/README.md). It uses the SDK's public API only."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import sys
import time
from typing import Any

import asyncpg
from google.protobuf import json_format
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import cronoq
import cronoq.outbox
from cronoq.errors import RedirectRefused, TlsError, TooManyRedirects
from cronoq.v1 import admin_service_pb2

# The SDK's errors that are more than their gRPC code, by the protocol's kind names.
KINDS = ((TooManyRedirects, "too_many_redirects"), (RedirectRefused, "redirect_refused"), (TlsError, "tls"))


def error_of(err: BaseException) -> dict[str, Any]:
    if not isinstance(err, cronoq.CronoqError):
        return {"code": "", "kind": "other", "message": f"{type(err).__name__}: {err}"}
    kind = next((name for cls, name in KINDS if isinstance(err, cls)), "")
    return {
        "code": err.code.name if err.code else "",
        "kind": kind,
        "message": err.message,
        "shard": err.shard or "",
        "shard_endpoint": err.shard_endpoint or "",
        "leader": err.leader or "",
        "reason": err.reason or "",
    }


def text_of(data: bytes | None) -> str | None:
    """A checkpoint as the protocol gives it: UTF-8 text, or None when empty."""
    return data.decode() if data else None


def value_json(value: Any) -> Any:
    """A decoded result as the protocol gives it: a JSON value, {"bytes_b64"} for bytes."""
    if isinstance(value, bytes):
        return {"bytes_b64": base64.b64encode(value).decode()}
    return value


def dependency_json(d: cronoq.DependencyResult) -> dict[str, Any]:
    return {
        "id": str(d.id),
        "key": d.key,
        "state": cronoq.TaskState.Name(d.state),  # type: ignore[arg-type]
        "value": value_json(d.value),
        "error": d.error,
    }


def refs_of(items: list[dict[str, Any]], parent: int = 0) -> list[int | str]:
    """A step's depends_on: {"key"}, {"id"} (decimal), or {"parent": true} (the spawning task)."""
    return [item["key"] if "key" in item else parent if item.get("parent") else int(item["id"]) for item in items]


def start_by_of(step: dict[str, Any]) -> dt.datetime | None:
    """start_by_in_ms: the task's start_by, that many ms from now."""
    if "start_by_in_ms" not in step:
        return None
    return dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=step["start_by_in_ms"])


def run_when_of(spec: dict[str, Any]) -> int | None:
    return cronoq.RunWhen.Value(spec["run_when"]) if spec.get("run_when") else None


def trace_id() -> str | None:
    """The 32-hex trace id of the current span context, or None when it is not valid."""
    context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else None


def options(case: dict[str, Any]) -> dict[str, Any]:
    tls = case.get("tls")
    retry = case.get("retry", {})
    elapsed = retry.get("max_elapsed_ms")
    keepalive = case.get("keepalive")
    return {
        "token": case.get("token"),
        "tls": cronoq.TlsConfig(ca=tls.get("ca"), cert=tls.get("cert"), key=tls.get("key")) if tls else None,
        "retry": cronoq.RetryConfig(
            initial_backoff=retry.get("initial_backoff_ms", 20) / 1000,
            max_backoff=retry.get("max_backoff_ms", 200) / 1000,
            max_elapsed=None if elapsed is None else elapsed / 1000,
        ),
        **(
            {"keepalive": cronoq.KeepaliveConfig(keepalive["time_ms"] / 1000, keepalive["timeout_ms"] / 1000)}
            if keepalive
            else {}
        ),
    }


async def run_worker(case: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    """Runs a worker until it has handled `until_handled` tasks (or started
    `stop_after_started`), then stops it gracefully; or until it fails."""
    started: list[str] = []
    handled: list[dict[str, Any]] = []
    enough = asyncio.Event()

    running = most = 0

    async def handler(ctx: cronoq.TaskContext) -> Any:
        nonlocal running, most
        started.append(str(ctx.id))
        running += 1
        most = max(most, running)
        if len(started) == step.get("stop_after_started", 0):
            enough.set()
        payload = ctx.payload if isinstance(ctx.payload, dict) else {}
        checkpoint = text_of(ctx.checkpoint)  # as the handler got it
        in_trace = trace_id()
        workflow: dict[str, Any] = {"dependencies": [dependency_json(d) for d in ctx.dependencies]}
        end = "cancelled"
        try:
            if "checkpoint" in payload:
                ctx.save_checkpoint(payload["checkpoint"].encode())
            for progress in payload.get("progress", []):
                ctx.report_progress(progress["value"], progress["message"])
            if payload.get("sleep_ms"):
                await asyncio.sleep(payload["sleep_ms"] / 1000)
            if "snooze_ms" in payload and ctx.snoozes < payload.get("snooze_times", 1):
                raise cronoq.Snooze(payload["snooze_ms"] / 1000, reason="driver")
            if "lookup_keys" in payload:
                workflow["looked_up"] = {k: value_json(ctx.dependency(k)) for k in payload["lookup_keys"]}
            for spawn in payload.get("spawn", []):
                ctx.spawn(
                    spawn["pool"],
                    spawn.get("payload"),
                    key=spawn.get("key"),
                    depends_on=refs_of(spawn.get("depends_on", []), parent=ctx.id),
                    run_when=run_when_of(spawn),
                )
            if "fail" in payload:
                raise cronoq.TaskError(payload["fail"], retryable=payload.get("retryable", True))
            end = "returned"
            if payload.get("sum_dependencies"):
                return sum(v for v in ctx.dependency_results.values() if type(v) in (int, float))
            if "result_bytes_b64" in payload:
                return base64.b64decode(payload["result_bytes_b64"])
            return payload.get("result")
        except cronoq.Snooze:
            end = "snoozed"
            raise
        except Exception:  # a TaskError, or the SDK's error for a bad report
            end = "raised"
            raise
        finally:
            running -= 1
            handled.append(
                {
                    "id": str(ctx.id),
                    "attempt": ctx.attempt,
                    "snoozes": ctx.snoozes,
                    "checkpoint": checkpoint,
                    "payload": ctx.payload,
                    "end": end,
                    "trace_id": in_trace,
                    **workflow,
                }
            )
            if len(handled) == step.get("until_handled", 0):
                enough.set()

    worker = cronoq.Worker(
        ",".join(case["endpoints"]),
        step["pools"],
        handler,
        concurrency=step.get("concurrency", 4),
        prefetch=step.get("prefetch"),
        insecure_redirect_http=case.get("insecure_redirect_http", False),
        shutdown_grace=step.get("shutdown_grace_ms", 5000) / 1000,
        **options(case),
    )
    run = asyncio.create_task(worker.run())
    waiting = asyncio.create_task(enough.wait())
    error: dict[str, Any] | None = None
    done, _ = await asyncio.wait(
        {run, waiting}, timeout=step.get("timeout_ms", 15000) / 1000, return_when="FIRST_COMPLETED"
    )
    if not done:
        error = {
            "code": "",
            "kind": "timeout",
            "message": f"the worker did not finish in {step.get('timeout_ms', 15000)} ms",
        }
    waiting.cancel()
    worker.stop()
    try:
        await asyncio.wait_for(run, 30)
    except Exception as err:
        error = error or error_of(err)
    return {
        "started": started,
        "handled": handled,
        "max_running": most,
        "endpoint": str(worker.endpoint),
        "error": error,
    }


def task_of(step: dict[str, Any]) -> int | str:
    """The task a step names: "id" (a decimal string) or "key"."""
    return int(step["id"]) if "id" in step else str(step["key"])


async def bulk_step(client: cronoq.Client, step: dict[str, Any]) -> dict[str, Any]:
    filt = json_format.ParseDict(step.get("filter", {}), cronoq.TaskFilter())
    dry_run = step.get("dry_run", False)
    if step["op"] == "bulk_cancel":
        resp: Any = await client.cancel_tasks(filt, dry_run=dry_run)
    elif step["op"] == "bulk_retry":
        resp = await client.retry_tasks(filt, dry_run=dry_run)
    else:
        resp = await client.delete_tasks(filt, dry_run=dry_run)
    return {
        "matched": resp.matched,
        "changed": resp.changed,
        "unavailable_shards": list(resp.unavailable_shards),
        "error": None,
    }


def child_of(task: cronoq.Task) -> dict[str, Any]:
    return {
        "id": str(task.id),
        "pool": task.pool,
        "state": cronoq.TaskState.Name(task.state),
        "parent_id": str(task.parent_id),
    }


def attempt_of(attempt: cronoq.Attempt) -> dict[str, Any]:
    return {"attempt": attempt.attempt, "outcome": cronoq.AttemptOutcome.Name(attempt.outcome), "error": attempt.error}


class RollBack(Exception):
    """Raised in the transaction to roll it back (asyncpg's context manager's way)."""


async def outbox_enqueue(client: cronoq.Client, case: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    """Enqueues one task with the outbox helper in a transaction of the application's database,
    commits or rolls it back; with relay_within_ms, looks the task up by key until it exists."""
    try:
        conn = await asyncpg.connect(case["database_url"])
        try:
            async with conn.transaction():
                row_id = await cronoq.outbox.enqueue(
                    conn, step["pool"], step.get("payload"), key=step.get("key"), schema=case["outbox_schema"]
                )
                if not step.get("commit"):
                    raise RollBack
        except RollBack:
            pass
        finally:
            await conn.close()
        committed = time.monotonic()
        relayed, within = False, step.get("relay_within_ms", 0) / 1000
        while within and not relayed and time.monotonic() - committed < within:
            try:
                await client.get(step["key"])
                relayed = True
            except cronoq.errors.NotFound:
                await asyncio.sleep(0.005)
        relay_ms = (time.monotonic() - committed) * 1000 if within else 0
        return {"id": str(row_id), "relayed": relayed, "relay_ms": relay_ms, "error": None}
    except Exception as err:
        return {"error": error_of(err)}


def schedule_json(schedule: Any) -> dict[str, Any]:
    return {
        "pool": schedule.pool,
        "name": schedule.name,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "paused": schedule.paused,
        "group_key": schedule.group_key,
        "next_fire_set": schedule.HasField("next_fire_at"),
    }


async def read_step(client: cronoq.Client, step: dict[str, Any]) -> dict[str, Any]:
    """The schedule calls and the read calls (workers, the server's info, the snapshot)."""
    op = step["op"]
    if op == "put_schedule":
        put = await client.put_schedule(
            step["pool"],
            step["name"],
            step["cron"],
            payload=step.get("payload"),
            timezone=step.get("timezone"),
            group_key=step.get("group_key"),
            paused=step.get("paused", False),
        )
        return schedule_json(put) | {"error": None}
    if op == "delete_schedule":
        await client.delete_schedule(step["pool"], step["name"])
        return {"error": None}
    if op == "list_schedules":
        listed = await client.list_schedules(step.get("pool"))
        schedules = sorted((schedule_json(s) for s in listed.schedules), key=lambda s: (s["pool"], s["name"]))
        return {"schedules": schedules, "unavailable_shards": list(listed.unavailable_shards), "error": None}
    if op == "list_workers":
        workers = await client.list_workers(step.get("pool"))
        return {"count": len(workers.workers), "unavailable_shards": list(workers.unavailable_shards), "error": None}
    if op == "server_info":
        info = await client.server_info()
        return {
            "shard": info.shard,
            "role": admin_service_pb2.Role.Name(info.role),
            "version": info.version,
            "error": None,
        }
    snapshot = await client.snapshot()
    shards = sorted(s.shard for s in snapshot.shards)
    return {"shards": shards, "unavailable_shards": list(snapshot.unavailable_shards), "error": None}


READ_OPS = ("put_schedule", "delete_schedule", "list_schedules", "list_workers", "server_info", "snapshot")


async def run_client_step(client: cronoq.Client, step: dict[str, Any]) -> dict[str, Any]:
    op = step["op"]
    extra: dict[str, Any] = {}
    try:
        if op == "submit":
            # A traceparent: the submit runs in that remote span context (no tracer provider installed).
            carrier = {k: step[k] for k in ("traceparent", "tracestate") if k in step}
            token = otel_context.attach(TraceContextTextMapPropagator().extract(carrier)) if carrier else None
            try:
                submitted = await client.submit(
                    step["pool"],
                    step.get("payload"),
                    key=step.get("key"),
                    group_key=step.get("group_key"),
                    depends_on=refs_of(step.get("depends_on", [])),
                    run_when=run_when_of(step),
                    key_mode=step.get("key_mode"),
                    debounce_ms=step.get("debounce_ms", 0),
                    max_debounce_ms=step.get("max_debounce_ms", 0),
                    key_ttl_ms=step.get("key_ttl_ms", 0),
                    start_by=start_by_of(step),
                )
            finally:
                if token is not None:
                    otel_context.detach(token)
            return {
                "id": str(submitted.task.id),
                "group_key": submitted.task.group_key,
                "deduplicated": submitted.deduplicated,
                "replaced": submitted.replaced,
                "error": None,
            }
        if op == "sleep":
            await asyncio.sleep(step["ms"] / 1000)
            return {"error": None}
        if op in ("bulk_cancel", "bulk_retry", "bulk_delete"):
            return await bulk_step(client, step)
        if op in READ_OPS:
            return await read_step(client, step)
        if op in ("pause_pool", "resume_pool"):
            pause = await (client.pause_pool if op == "pause_pool" else client.resume_pool)(step["pool"])
            return {"pool": pause.pool, "paused": pause.paused, "error": None}
        if op == "delete":
            return {"id": str(await client.delete(task_of(step))), "error": None}
        if op == "get":
            wants = {
                k: bool(step.get(k)) for k in ("include_attempts", "include_children", "include_dependency_results")
            }
            got: Any = await client.get(task_of(step), **wants)
            whole = wants["include_attempts"] or wants["include_children"]  # a GetTaskResponse
            task = got.task if whole else got
            if wants["include_attempts"]:
                extra["attempts"] = [attempt_of(a) for a in got.attempts]
            if wants["include_children"]:
                extra["children"] = [child_of(c) for c in got.children]
            if wants["include_dependency_results"]:
                extra["dependency_results"] = [dependency_json(d) for d in cronoq.dependencies_of(task)]
        elif op == "cancel" and step.get("include_descendants"):
            cancelled = await client.cancel(task_of(step), include_descendants=True)
            task, extra = cancelled.task, {"descendants_cancelled": cancelled.descendants_cancelled}
        elif op == "cancel":
            task = await client.cancel(task_of(step))
        elif op == "retry":
            task = (await client.retry(task_of(step))).task
        elif op == "wait":
            task = (await client.wait(task_of(step), timeout=step.get("timeout_ms", 10000) / 1000)).task
        else:
            return {"error": {"code": "", "kind": "unsupported", "message": f"unknown op {op!r}"}}
        if op == "get":
            progress = {"value": task.progress.value, "message": task.progress.message}
            extra |= {
                "snoozes": task.snoozes,
                "progress": progress if task.HasField("progress") else None,
                "checkpoint": text_of(task.checkpoint),
                "parent_id": str(task.parent_id),
                "task_error": task.error,
                "result": value_json(cronoq.result_of(task)) if task.result else None,
            }
        return {"id": str(task.id), "state": cronoq.TaskState.Name(task.state), **extra, "error": None}
    except Exception as err:
        return {"error": error_of(err)}


async def main() -> None:
    case = json.load(sys.stdin)
    results: list[dict[str, Any]] = []
    try:
        client = cronoq.Client(
            ",".join(case["endpoints"]), timeout=case.get("timeout_ms", 5000) / 1000, **options(case)
        )
    except cronoq.CronoqError as err:  # e.g. an endpoint that is not one: each step fails with it
        json.dump({"steps": [{"op": step["op"], "error": error_of(err)} for step in case["steps"]]}, sys.stdout)
        return
    async with client:
        for step in case["steps"]:
            if step["op"] == "worker":
                result = await run_worker(case, step)
            elif step["op"] == "outbox_enqueue":
                result = await outbox_enqueue(client, case, step)
            else:
                result = await run_client_step(client, step)
            results.append({"op": step["op"], **result})
    json.dump({"steps": results}, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
