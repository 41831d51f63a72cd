"""The JSON form of API messages: proto field names, 64-bit ids as strings, a task's (or a
schedule's) payload whose content type is application/json shown decoded as `payload_json` instead of base64,
and such a result shown decoded as `result_json` beside `result`. The server's HTTP API
uses it too."""

from __future__ import annotations

import base64
import json
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

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
    return task


def to_dict(msg: Message) -> dict[str, Any]:
    out = json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if "task" in out:
        task_dict(out["task"])
    for task in out.get("tasks", []):
        task_dict(task)
    if isinstance(out.get("event"), dict) and "task" in out["event"]:
        task_dict(out["event"]["task"])
    # A schedule's task template, shown as its tasks are.
    if "schedule" in out:
        task_dict(out["schedule"])
    for schedule in out.get("schedules", []):
        task_dict(schedule)
    return out
