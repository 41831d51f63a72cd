"""The JSON form of API messages: proto field names, 64-bit ids as strings, a task's (or a
schedule's) payload whose content type is application/json shown decoded as `payload_json` instead of base64,
and such a result shown decoded as `result_json` beside `result`. The server's HTTP API
uses it too."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from cronoq.v1 import task_pb2

JSON_CONTENT_TYPE = "application/json"


def _decoded(data: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(base64.b64decode(data) or b"null")
    except ValueError:
        return False, None


def task_dict(task: dict[str, Any]) -> dict[str, Any]:
    """Replaces a JSON task payload (base64 in proto3 JSON) by its value, as payload_json, and
    adds a JSON result's value as result_json."""
    if task.get("content_type") == JSON_CONTENT_TYPE and "payload" in task:
        ok, value = _decoded(task["payload"])
        if ok:
            task["payload_json"] = value
            del task["payload"]
    if task.get("result_content_type") == JSON_CONTENT_TYPE and task.get("result"):
        ok, value = _decoded(task["result"])
        if ok:
            task["result_json"] = value
    for dep in task.get("dependency_results", ()):
        if dep.get("content_type") == JSON_CONTENT_TYPE and dep.get("result"):
            ok, value = _decoded(dep["result"])
            if ok:
                dep["result_json"] = value
    return task


def to_dict(msg: Message) -> dict[str, Any]:
    out = json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if "task" in out:
        task_dict(out["task"])
    for task in [*out.get("tasks", []), *out.get("children", [])]:
        task_dict(task)
    if isinstance(out.get("event"), dict) and "task" in out["event"]:
        task_dict(out["event"]["task"])
    # A schedule's task template, shown as its tasks are.
    if "schedule" in out:
        task_dict(out["schedule"])
    for schedule in out.get("schedules", []):
        task_dict(schedule)
    return out


# -- a fast path for the one message streamed in bulk (Watch over SSE) ----------------------

_STATE_NAMES = {v.number: v.name for v in task_pb2.TaskState.DESCRIPTOR.values}
_RUN_WHEN_NAMES = {v.number: v.name for v in task_pb2.RunWhen.DESCRIPTOR.values}
_TIMESTAMPS = ("run_at", "created_at", "started_at", "finished_at", "lease_expires_at", "start_by")


def _timestamp(ts: Any) -> str:
    """Timestamp.ToJsonString (0, 3, 6 or 9 fractional digits) for a timestamp in its valid
    range, without its validation and datetime arithmetic."""
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts.seconds))
    nanos = ts.nanos
    if nanos == 0:
        return base + "Z"
    if nanos % 1_000_000 == 0:
        return f"{base}.{nanos // 1_000_000:03d}Z"
    if nanos % 1_000 == 0:
        return f"{base}.{nanos // 1_000:06d}Z"
    return f"{base}.{nanos:09d}Z"


def task_to_dict(task: task_pb2.Task, include_payloads: bool = True) -> dict[str, Any]:
    """to_dict(task) (then task_dict), written out for Task: the same keys and values as
    json_format gives, several times faster. Without include_payloads, payload, payload_json,
    result and result_json are left out."""
    out: dict[str, Any] = {
        "id": str(task.id),
        "pool": task.pool,
        "key": task.key,
        "content_type": task.content_type,
        "priority": task.priority,
        "max_attempts": task.max_attempts,
        "depends_on": [str(d) for d in task.depends_on],
        "resources": {k: str(v) for k, v in task.resources.items()},
        "state": _STATE_NAMES.get(task.state, task.state),
        "attempt": task.attempt,
        "worker_id": task.worker_id,
        "error": task.error,
        "cancel_requested": task.cancel_requested,
        "result_content_type": task.result_content_type,
        "timeout_ms": str(task.timeout_ms),
        "group_key": task.group_key,
        "snoozes": task.snoozes,
        "parent_id": str(task.parent_id),
        "run_when": _RUN_WHEN_NAMES.get(task.run_when, task.run_when),
        "key_ttl_ms": str(task.key_ttl_ms),
        "dependency_results": [
            {
                "id": str(d.id),
                "key": d.key,
                "state": _STATE_NAMES.get(d.state, d.state),
                "result": base64.b64encode(d.result).decode(),
                "content_type": d.content_type,
                "error": d.error,
            }
            for d in task.dependency_results
        ],
    }
    for name in _TIMESTAMPS:
        if task.HasField(name):  # type: ignore[arg-type]
            out[name] = _timestamp(getattr(task, name))
    if task.HasField("progress"):
        p = task.progress
        out["progress"] = {"value": p.value, "message": p.message}
        if p.HasField("updated_at"):
            out["progress"]["updated_at"] = _timestamp(p.updated_at)
    if task.HasField("trace"):
        t = task.trace
        out["trace"] = {"traceparent": t.traceparent, "tracestate": t.tracestate, "link": t.link}
    if include_payloads:
        out["payload"] = base64.b64encode(task.payload).decode()
        out["result"] = base64.b64encode(task.result).decode()
        out["checkpoint"] = base64.b64encode(task.checkpoint).decode()
        task_dict(out)
    return out


def task_event_to_dict(event: task_pb2.TaskEvent, include_payloads: bool = True) -> dict[str, Any]:
    """to_dict of a TaskEvent, by task_to_dict."""
    out: dict[str, Any] = {
        "shard": event.shard,
        "seq": str(event.seq),
        "cursor": event.cursor,
        "progress": event.progress,
        "replaced": event.replaced,
    }
    if event.HasField("task"):
        out["task"] = task_to_dict(event.task, include_payloads)
    if event.HasField("time"):
        out["time"] = _timestamp(event.time)
    return out
