"""What README.md and docs/ say about the HTTP API agrees with the routes the server has: every
route they write out is served (its OpenAPI document lists it), and every RPC they say is reachable over HTTP has a route."""

from __future__ import annotations

import re
from pathlib import Path

from openapi_check import route_of

from cronoq_server.registry import registry

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WRITTEN_ROUTE = re.compile(r"\b(GET|POST|PUT|DELETE)`? (/v1/[^\s`)\"?]*)")
BACKTICKED = re.compile(r"`([A-Za-z]+)`")


def blocks(text: str) -> list[str]:
    """Paragraphs and list items, each on one line."""
    parts = re.split(r"\n\s*\n|\n(?=\s*[-*] )", text)
    return [" ".join(part.split()) for part in parts]


def test_every_route_the_docs_write_out_is_served() -> None:
    unknown = [
        f"{doc.name}: {method} {path}"
        for doc in DOCS
        for method, path in WRITTEN_ROUTE.findall(doc.read_text())
        if route_of(method, path) is None
    ]
    assert not unknown, unknown


def test_rpcs_the_docs_say_are_served_over_http_have_routes() -> None:
    rpcs = registry()
    wrong = [
        f"{doc.name}: {name} has no HTTP route, yet: {block[:200]}"
        for doc in DOCS
        for block in blocks(doc.read_text())
        if "over http" in block.lower()
        for name in BACKTICKED.findall(block)
        if name in rpcs and not rpcs[name].http
    ]
    assert not wrong, "\n".join(wrong)
