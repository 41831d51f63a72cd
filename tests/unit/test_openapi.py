"""The HTTP API's OpenAPI document: a valid OpenAPI 3.1 document, the one docs/openapi.json
holds, with a route for every HTTP route the server has."""

from __future__ import annotations

import json
from pathlib import Path

from openapi_spec_validator import validate

from cronoq_server.api.openapi import document, openapi_json, routes_table
from cronoq_server.registry import registry

DOCS = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = document()
    assert doc["openapi"] == "3.1.0"
    validate(doc)


def test_docs_holds_the_current_document() -> None:
    assert DOCS.read_bytes() == openapi_json(), "docs/openapi.json is stale: run `./dev proto` and commit it"


def test_every_route_is_in_it_with_its_rpc_as_operation() -> None:
    paths = document()["paths"]
    for rpc in registry().values():
        for route in rpc.http:
            template = route.path.replace(".", "_")
            operation = paths[template][route.method.lower()]
            assert operation["operationId"].startswith(rpc.name), (rpc.name, route.path)
            assert operation["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")


def test_the_json_form_is_described() -> None:
    schemas = document()["components"]["schemas"]
    task = schemas["Task"]["properties"]
    assert task["id"] == {"type": ["string", "integer"], "pattern": "^[0-9]+$", "minimum": 0, "format": "uint64"}
    assert task["state"]["enum"][1] == "TASK_STATE_PENDING"
    assert task["created_at"] == {"type": "string", "format": "date-time"}
    assert task["payload"]["contentEncoding"] == "base64"
    assert "payload_json" in task and "result_json" in task
    assert "payload_json" in schemas["SubmitTaskRequest"]["properties"]
    assert json.loads(openapi_json())["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_the_http_api_page_lists_every_route() -> None:
    page = (DOCS.parent / "http-api.md").read_text()
    assert routes_table() in page, (
        "docs/http-api.md's routes are stale: paste `python -m cronoq_server.api.openapi --table`"
    )
