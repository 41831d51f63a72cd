"""The OpenAPI 3.1 document of the HTTP API, built from the same registry (the protos' rule
options) that builds the routes: every route with its path and query parameters, its request
body and its answer, in the JSON form the server reads and writes (proto field names, 64-bit
integers as strings, enums by name, timestamps in RFC 3339, bytes in base64, a JSON payload or
result also as `payload_json` / `result_json`), the error body and the bearer token.

Served at GET /v1/openapi.json; `python -m cronoq_server.api.openapi` prints it (`./dev proto`
writes docs/openapi.json with it).
"""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor

from .. import __version__
from ..registry import HttpRoute, Rpc, registry
from .http_request import JSON_PAYLOAD_MESSAGES, query_fields

_REF = "#/components/schemas/"
# Answers give 64-bit integers as strings; a request may give a JSON number too (proto3 JSON).
_INT64 = {"type": ["string", "integer"], "pattern": "^-?[0-9]+$", "format": "int64"}
_UINT64 = {"type": ["string", "integer"], "pattern": "^[0-9]+$", "minimum": 0, "format": "uint64"}
_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1},
    FieldDescriptor.TYPE_INT64: _INT64,
    FieldDescriptor.TYPE_SINT64: _INT64,
    FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT64: _UINT64,
    FieldDescriptor.TYPE_FIXED64: _UINT64,
}
_WELL_KNOWN: dict[str, dict[str, Any]] = {
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]+)?s$"},
}
# Fields the JSON form adds beside the proto's: a JSON payload or result as its value.
_JSON_VALUES = {
    "cronoq.v1.Task": ("payload_json", "result_json"),
    "cronoq.v1.Schedule": ("payload_json",),
    "cronoq.v1.DependencyResult": ("result_json",),
    **{name: ("payload_json",) for name in JSON_PAYLOAD_MESSAGES},
}
_ERROR = "Error"


def _name(desc: Any) -> str:
    return desc.full_name.removeprefix("cronoq.v1.").replace(".", "_")


class _Schemas:
    """The components' schemas, one a message, added as the paths name them."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}

    def ref(self, desc: Any) -> dict[str, Any]:
        if desc.full_name in _WELL_KNOWN:
            return dict(_WELL_KNOWN[desc.full_name])
        name = _name(desc)
        if name not in self.schemas:
            self.schemas[name] = {}  # a message may contain itself
            properties = {f.name: self.field(f) for f in desc.fields}
            for extra in _JSON_VALUES.get(desc.full_name, ()):
                properties[extra] = {"description": "the JSON value, when the content type is application/json"}
            self.schemas[name] = {"type": "object", "properties": properties}
        return {"$ref": _REF + name}

    def field(self, field: FieldDescriptor) -> dict[str, Any]:
        nested = field.message_type
        if nested is not None and nested.GetOptions().map_entry:
            value = nested.fields_by_name["value"]
            return {"type": "object", "additionalProperties": self.single(value)}
        if field.is_repeated:
            return {"type": "array", "items": self.single(field)}
        return self.single(field)

    def single(self, field: FieldDescriptor) -> dict[str, Any]:
        if field.message_type is not None:
            return self.ref(field.message_type)
        if field.enum_type is not None:
            return {"type": "string", "enum": [v.name for v in field.enum_type.values]}
        return dict(_SCALARS[field.type])


def _variable(var: str) -> str:
    """A path variable's name in the document: task.id -> task_id (a name generators take)."""
    return var.replace(".", "_")


def _field_at(desc: Any, path: str) -> FieldDescriptor:
    *parents, leaf = path.split(".")
    for part in parents:
        desc = desc.fields_by_name[part].message_type
    return desc.fields_by_name[leaf]


def _short(name: str, enum: Any) -> str:
    """TASK_STATE_PENDING -> pending: an enum value as the query string may give it."""
    return name.removeprefix(enum.values[0].name.removesuffix("UNSPECIFIED")).lower()


def _in_url(schema: dict[str, Any]) -> dict[str, Any]:
    """A field's schema as a path or query parameter: a 64-bit integer is a string there."""
    if isinstance(schema.get("type"), list):
        return {**schema, "type": "string"}
    if schema.get("type") == "array":
        return {**schema, "items": _in_url(schema["items"])}
    return schema


def _permission(rpc: Rpc) -> str:
    """The permission a call needs on its pool, as docs/security.md names them."""
    if rpc.permission is None:
        return "none (valid credentials)"
    return rpc.permission + (f" or {rpc.or_permission}" if rpc.or_permission else "")


def _operation_id(rpc: Rpc, index: int, route: HttpRoute) -> str:
    if index == 0:
        return rpc.name
    leaf = route.variables[-1].rsplit(".", 1)[-1]
    return rpc.name + "By" + "".join(part.title() for part in leaf.split("_"))


def _operation(rpc: Rpc, index: int, route: HttpRoute, schemas: _Schemas) -> dict[str, Any]:
    desc = rpc.request.DESCRIPTOR
    parameters: list[dict[str, Any]] = [
        {
            "name": _variable(var),
            "in": "path",
            "required": True,
            "schema": _in_url(schemas.single(_field_at(desc, var))),
        }
        for var in route.variables
    ]
    operation: dict[str, Any] = {
        "operationId": _operation_id(rpc, index, route),
        "tags": [rpc.service.rsplit(".", 1)[-1]],
        "summary": f"{rpc.name} ({rpc.service.rsplit('.', 1)[-1]}), permission {_permission(rpc)}",
        "x-cronoq-permission": _permission(rpc),
        "parameters": parameters,
    }
    if route.method in ("POST", "PUT"):
        body = desc.fields_by_name[route.body].message_type if route.body else desc
        operation["requestBody"] = {"content": {"application/json": {"schema": schemas.ref(body)}}}
    else:
        from_path = {var.split(".")[0] for var in route.variables}
        for name, (path, field) in sorted(query_fields(desc, "", from_path).items()):
            if name != path:  # the same parameter by its JSON name
                continue
            schema = _in_url(schemas.field(field) if field.is_repeated else schemas.single(field))
            if field.enum_type is not None:  # the query also takes an enum's value without its prefix
                values = schema["items"] if field.is_repeated else schema
                values["enum"] += [_short(v.name, field.enum_type) for v in field.enum_type.values[1:]]
            parameters.append({"name": name, "in": "query", "required": False, "schema": schema})
    if route.sse:
        answer = {
            "description": f"a stream of {_name(rpc.response.DESCRIPTOR)} as server-sent events",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
        schemas.ref(rpc.response.DESCRIPTOR)  # each event's schema, named in the description
    else:
        answer = {
            "description": "the answer",
            "content": {"application/json": {"schema": schemas.ref(rpc.response.DESCRIPTOR)}},
        }
    operation["responses"] = {
        "200": answer,
        "default": {
            "description": "a refusal: the gRPC code's HTTP status, the code and a message naming the field",
            "content": {"application/json": {"schema": {"$ref": _REF + _ERROR}}},
        },
    }
    return operation


def _status(operation_id: str, description: str, answers: dict[str, str]) -> dict[str, Any]:
    """/healthz or /readyz: open to anyone, a JSON status."""
    schema = {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string"}, "shard": {"type": "string"}},
    }
    return {
        "get": {
            "operationId": operation_id,
            "summary": description,
            "security": [{}],
            "responses": {
                code: {"description": text, "content": {"application/json": {"schema": schema}}}
                for code, text in answers.items()
            },
        }
    }


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of this server's HTTP API."""
    schemas = _Schemas()
    paths: dict[str, Any] = {}
    for rpc in registry().values():
        for index, route in enumerate(rpc.http):
            path = re.sub(r"\{([^}]+)\}", lambda m: "{" + _variable(m.group(1)) + "}", route.path)
            paths.setdefault(path, {})[route.method.lower()] = _operation(rpc, index, route, schemas)
    paths["/v1/openapi.json"] = {
        "get": {
            "operationId": "GetOpenApi",
            "summary": "this document",
            "security": [{}],
            "responses": {"200": {"description": "this document", "content": {"application/json": {"schema": {}}}}},
        }
    }
    paths["/healthz"] = _status("Healthz", "the server runs", {"200": '{"status": "ok"}'})
    paths["/readyz"] = _status(
        "Readyz",
        "whether the server leads its shard",
        {"200": "the shard's leader: status leader", "503": "a standby, or a leader draining: status standby"},
    )
    paths["/metrics"] = {
        "get": {
            "operationId": "Metrics",
            "summary": "the Prometheus metrics",
            "x-cronoq-permission": "none without tokens or with server.metrics_public; else admin on any pool",
            "responses": {
                "200": {
                    "description": "the Prometheus text format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                "default": {
                    "description": "a refusal",
                    "content": {"application/json": {"schema": {"$ref": _REF + _ERROR}}},
                },
            },
        }
    }
    schemas.schemas[_ERROR] = {
        "type": "object",
        "required": ["code", "message"],
        "properties": {
            "code": {"type": "string", "enum": [c.name for c in grpc.StatusCode]},
            "message": {"type": "string", "description": "what was refused, naming the field and its value"},
            "reason": {"type": "string"},
            "shard": {"type": "string", "description": "the shard that owns the pool (a redirect)"},
            "shard_endpoint": {"type": "string", "description": "that shard's endpoint (a redirect)"},
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "cronoq HTTP API",
            "version": __version__,
            "description": (
                "The JSON form of cronoq's gRPC API. Fields by their proto names (a request may also "
                "use their JSON names), 64-bit integers as decimal strings, enums by name, timestamps "
                "in RFC 3339, bytes in base64; a task's JSON payload as `payload_json`. A server with "
                "tokens configured takes `Authorization: Bearer <token>`; one without takes none."
            ),
        },
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": dict(sorted(schemas.schemas.items())),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
    }


@cache
def openapi_json() -> bytes:
    """The document as the server serves it and `./dev proto` writes it."""
    return (json.dumps(document(), indent=2, ensure_ascii=False) + "\n").encode()


def routes_table() -> str:
    """The routes as docs/http-api.md lists them: route, operation, permission."""
    lines = ["| route | operation | permission |", "|---|---|---|"]
    for path, operations in document()["paths"].items():
        for method, op in operations.items():
            permission = op.get("x-cronoq-permission", "none")
            lines.append(f"| `{method.upper()} {path}` | `{op['operationId']}` | {permission} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Writes the document to the file named, or prints it; --table: the routes' table."""
    if sys.argv[1:] == ["--table"]:
        sys.stdout.write(routes_table())
    elif len(sys.argv) > 1:
        Path(sys.argv[1]).write_bytes(openapi_json())
    else:
        sys.stdout.buffer.write(openapi_json())


if __name__ == "__main__":
    main()
