"""An HTTP request to the RPC request message its route declares: path variables, then the
query string (GET, DELETE) or the JSON body (POST, PUT), each field converted by its type."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from cronoq.jsonform import JSON_CONTENT_TYPE

from ..errors import invalid
from ..ids import parse_task_id
from ..registry import HttpRoute, Rpc
from .http_body import check_base64

_INT_MAX = {
    FieldDescriptor.TYPE_INT32: (1 << 31) - 1,
    FieldDescriptor.TYPE_SINT32: (1 << 31) - 1,
    FieldDescriptor.TYPE_UINT32: (1 << 32) - 1,
    FieldDescriptor.TYPE_INT64: (1 << 63) - 1,
    FieldDescriptor.TYPE_SINT64: (1 << 63) - 1,
    FieldDescriptor.TYPE_UINT64: (1 << 64) - 1,
}
# Messages whose JSON form takes `payload_json` (any JSON value) instead of base64 `payload`.
_JSON_PAYLOAD_MESSAGES = frozenset({"cronoq.v1.SubmitTaskRequest", "cronoq.v1.Schedule"})


def build_request(
    rpc: Rpc, route: HttpRoute, match_info: Mapping[str, str], query: Mapping[str, str], body: Any
) -> Message:
    message = rpc.request()
    if route.method in ("POST", "PUT"):
        if body not in (None, {}):
            target = getattr(message, route.body) if route.body else message
            _parse(_with_json_payloads(body, target.DESCRIPTOR, ""), target)
    else:
        _from_query(message, query, set(route.variables))
    for var in route.variables:
        _set_path(message, var, match_info[var.replace(".", "__")])
    return message


def _parse(body: Any, message: Message) -> None:
    try:
        json_format.ParseDict(body, message)
    except json_format.ParseError as err:
        raise invalid(str(err)) from None


def _holds_json_payloads(desc: Any, seen: frozenset[str] = frozenset()) -> bool:
    """Whether the message, or one nested in it, takes payload_json."""
    if desc.full_name in _JSON_PAYLOAD_MESSAGES:
        return True
    seen = seen | {desc.full_name}
    return any(
        f.message_type is not None
        and f.message_type.full_name not in seen
        and _holds_json_payloads(f.message_type, seen)
        for f in desc.fields
    )


def _with_json_payloads(body: Any, desc: Any, where: str) -> Any:
    """The body with each `payload_json` turned into payload (UTF-8 JSON text) and content
    type, and each base64 `payload` checked strictly, in every message that accepts them."""
    fields = [f.name for f in desc.fields]
    if not isinstance(body, dict):
        raise invalid(f"{where.rstrip('.') or 'body'}: expected a JSON object with fields {', '.join(fields)}")
    known = set(fields) | {f.json_name for f in desc.fields}
    if desc.full_name in _JSON_PAYLOAD_MESSAGES:
        known.add("payload_json")
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise invalid(f"{where.rstrip('.') or 'body'}: unknown field {unknown[0]!r} (fields: {', '.join(fields)})")
    out = dict(body)
    if desc.full_name in _JSON_PAYLOAD_MESSAGES:
        if "payload_json" in out:
            if "payload" in out:
                raise invalid(f"{where}payload_json: give payload or payload_json, not both")
            out["payload"] = base64.b64encode(json.dumps(out.pop("payload_json")).encode()).decode()
            out.setdefault("content_type", JSON_CONTENT_TYPE)
        elif "payload" in out:
            check_base64(out["payload"], f"{where}payload")
    for field in desc.fields:
        value = out.get(field.name)
        if value is None or field.message_type is None or not _holds_json_payloads(field.message_type):
            continue
        if field.is_repeated:
            if not isinstance(value, list):
                raise invalid(f"{where}{field.name}: expected a JSON list")
            out[field.name] = [
                _with_json_payloads(item, field.message_type, f"{where}{field.name}[{i}].")
                for i, item in enumerate(value)
            ]
        else:
            out[field.name] = _with_json_payloads(value, field.message_type, f"{where}{field.name}.")
    return out


def _from_query(message: Message, query: Mapping[str, str], from_path: set[str]) -> None:
    for field in message.DESCRIPTOR.fields:
        text = query.get(field.name)
        if text is None or field.name in from_path:
            continue
        if field.is_repeated or field.message_type is not None:
            raise invalid(f"{field.name}: cannot be given in the query string")
        setattr(message, field.name, _scalar(field, text, field.name))


def _set_path(message: Message, var: str, text: str) -> None:
    *parents, leaf = var.split(".")
    target = message
    for name in parents:
        target = getattr(target, name)
    field = target.DESCRIPTOR.fields_by_name[leaf]
    setattr(target, leaf, _scalar(field, text, leaf))


def _scalar(field: Any, text: str, name: str) -> Any:
    """A path or query value converted to the field's type; a message naming the field if not."""
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return text
    if kind == FieldDescriptor.TYPE_BOOL:
        if text.lower() in ("", "false", "0"):
            return False
        if text.lower() in ("true", "1"):
            return True
        raise invalid(f"{name}: {text[:40]!r} is not true or false")
    if kind == FieldDescriptor.TYPE_ENUM:
        return _enum(field.enum_type, text, name)
    if kind in _INT_MAX:
        if field.name == "id" and field.containing_type.full_name == "cronoq.v1.TaskRef":
            if not text.isascii():  # str.isdigit() accepts digits such as '١' and '²'
                raise invalid(f"id: task id {text!r} is not a positive unsigned 64-bit decimal integer")
            try:
                return parse_task_id(text)
            except ValueError as err:
                raise invalid(f"id: {err}") from None
        if not text:
            return 0
        if not (text.isascii() and text.isdigit()):
            raise invalid(f"{name}: {text[:40]!r} is not a non-negative integer")
        if len(text) > 20 or int(text) > _INT_MAX[kind]:
            raise invalid(f"{name}: {text[:40]} is more than {_INT_MAX[kind]}")
        return int(text)
    raise invalid(f"{name}: cannot be given in the path or query string")


def _enum(enum: Any, text: str, name: str) -> int:
    """An enum value by its full name (TASK_STATE_PENDING) or without its prefix (pending)."""
    if not text:
        return 0
    prefix = enum.values[0].name.removesuffix("UNSPECIFIED")
    wanted = text.upper()
    wanted = wanted if wanted.startswith(prefix) else prefix + wanted
    value = enum.values_by_name.get(wanted)
    if value is None:
        raise invalid(f"{name}: unknown {name} {text!r}")
    return value.number
