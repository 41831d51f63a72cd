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
from google.protobuf.timestamp_pb2 import Timestamp
from multidict import MultiMapping

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
_TIMESTAMP = "google.protobuf.Timestamp"
# Messages whose JSON form takes `payload_json` (any JSON value) instead of base64 `payload`.
JSON_PAYLOAD_MESSAGES = frozenset({"cronoq.v1.SubmitTaskRequest", "cronoq.v1.Schedule"})


def build_request(
    rpc: Rpc, route: HttpRoute, match_info: Mapping[str, str], query: MultiMapping[str], body: Any
) -> Message:
    message = rpc.request()
    if route.method in ("POST", "PUT"):
        if body not in (None, {}):
            target = getattr(message, route.body) if route.body else message
            _parse(_checked_body(body, target.DESCRIPTOR, ""), target)
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


def _checked_body(body: Any, desc: Any, where: str) -> Any:
    """The body checked in every message of it (cronoq's own): a JSON object of known fields,
    each named by its proto name (a JSON name is taken as that: later messages name the proto
    name), with each `payload_json` turned into payload (UTF-8 JSON text) and content type, and
    each base64 `payload` checked strictly, in every message that accepts them."""
    fields = [f.name for f in desc.fields]
    if not isinstance(body, dict):
        raise invalid(f"{where.rstrip('.') or 'body'}: expected a JSON object with fields {', '.join(fields)}")
    proto_name: dict[str, str] = {f.json_name: f.name for f in desc.fields}
    out: dict[str, Any] = {}
    for given, value in body.items():
        name = proto_name.get(given, str(given))
        if name in out:
            raise invalid(f"{where}{name}: given twice (as {name} and as its JSON name)")
        out[name] = value
    known = set(fields) | ({"payload_json"} if desc.full_name in JSON_PAYLOAD_MESSAGES else set())
    unknown = sorted(k for k in out if k not in known)
    if unknown:
        raise invalid(f"{where.rstrip('.') or 'body'}: unknown field {unknown[0]!r} (fields: {', '.join(fields)})")
    if desc.full_name in JSON_PAYLOAD_MESSAGES:
        if "payload_json" in out:
            if "payload" in out:
                raise invalid(f"{where}payload_json: give payload or payload_json, not both")
            out["payload"] = base64.b64encode(json.dumps(out.pop("payload_json")).encode()).decode()
            out.setdefault("content_type", JSON_CONTENT_TYPE)
        elif "payload" in out:
            check_base64(out["payload"], f"{where}payload")
    for field in desc.fields:
        value = out.get(field.name)
        nested = field.message_type
        # Maps and well-known types (a Timestamp is a string) are json_format's to read.
        if (
            value is None
            or nested is None
            or nested.GetOptions().map_entry
            or not nested.full_name.startswith("cronoq.")
        ):
            continue
        if field.is_repeated:
            if not isinstance(value, list):
                raise invalid(f"{where}{field.name}: expected a JSON list")
            out[field.name] = [
                _checked_body(item, nested, f"{where}{field.name}[{i}].") for i, item in enumerate(value)
            ]
        else:
            out[field.name] = _checked_body(value, nested, f"{where}{field.name}.")
    return out


def query_fields(desc: Any, prefix: str, skip: set[str]) -> dict[str, tuple[str, Any]]:
    """Each query parameter a request message takes: (its path by proto field names, the field),
    by that path and by its JSON names. A nested message's fields are named by their path
    (filter.key_prefix), as in the JSON body; a Timestamp is one parameter (RFC 3339)."""
    fields: dict[str, tuple[str, Any]] = {}
    for field in desc.fields:
        if field.name in skip:  # set from the path
            continue
        path = prefix + field.name
        names = {path, prefix + field.json_name}
        nested = field.message_type
        if nested is not None and nested.full_name != _TIMESTAMP and not field.is_repeated:
            for name, (inner, f) in query_fields(nested, path + ".", set()).items():
                fields[name] = (inner, f)
                fields[prefix + field.json_name + name.removeprefix(path)] = (inner, f)
            continue
        fields.update(dict.fromkeys(names, (path, field)))
    return fields


def _from_query(message: Message, query: MultiMapping[str], from_path: set[str]) -> None:
    known = query_fields(message.DESCRIPTOR, "", {var.split(".")[0] for var in from_path})
    for name in query:
        if name not in known:
            listed = sorted({path for path, _ in known.values()})
            raise invalid(f"{name}: unknown query parameter (parameters: {', '.join(listed) or 'none'})")
    for name in dict.fromkeys(query):
        path, field = known[name]
        *parents, leaf = path.split(".")
        target = message
        for parent in parents:
            target = getattr(target, parent)
        texts = query.getall(name)
        if field.is_repeated and field.message_type is None:
            getattr(target, leaf).extend(_scalar(field, text, path) for text in texts)
            continue
        if len(texts) > 1:
            raise invalid(f"{path}: given {len(texts)} times; it takes one value")
        if field.message_type is None:
            setattr(target, leaf, _scalar(field, texts[0], path))
        elif field.message_type.full_name == _TIMESTAMP:
            _timestamp(getattr(target, leaf), texts[0], path)
        else:
            raise invalid(f"{path}: cannot be given in the query string")


def _timestamp(ts: Timestamp, text: str, name: str) -> None:
    try:
        ts.FromJsonString(text)
    except ValueError:
        raise invalid(f"{name}: {text[:40]!r} is not an RFC 3339 time such as 2026-12-01T09:30:00Z") from None


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
        named = ", ".join(v.name.removeprefix(prefix).lower() for v in enum.values[1:])
        raise invalid(f"{name}: {text[:40]!r} is not one of {named}")
    return value.number
