"""Every HTTP exchange of the integration tests (ServerProcess.http) checked against the
server's OpenAPI document: each answer, whatever its status, and each request the server
accepted (a request refused on purpose may break the document: the answer says why)."""

from __future__ import annotations

import re
import urllib.parse
from functools import cache

from openapi_core import Config, OpenAPI
from openapi_core.testing import MockRequest, MockResponse

from cronoq_server.api.openapi import document

HOST = "http://cronoq.test"


@cache
def _openapi() -> OpenAPI:
    # Server-sent events are text: read as text/plain is.
    config = Config(extra_media_type_deserializers={"text/event-stream": lambda data: data.decode()})
    return OpenAPI.from_dict(document(), config=config)


@cache
def _routes() -> list[tuple[re.Pattern[str], str, frozenset[str]]]:
    """Each path of the document as a regular expression with its methods, literal paths first
    (/v1/tasks/bulk-cancel before /v1/tasks/{task_id})."""
    paths = document()["paths"]
    return [
        (re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(p)) + "$"), p, frozenset(paths[p]))
        for p in sorted(paths, key=lambda p: ("{" in p, p))
    ]


def route_of(method: str, path: str) -> str | None:
    """The document's route ("GET /v1/tasks/{task_id}") that a request takes; None: it lists none."""
    url_path = urllib.parse.urlsplit(path).path
    for pattern, template, methods in _routes():
        if method.lower() in methods and pattern.match(url_path):
            return f"{method.upper()} {template}"
    return None


def check(method: str, path: str, data: bytes | None, status: int, answer: bytes, content_type: str) -> None:
    """Raises AssertionError naming what does not match the document. A path it does not list
    (the dashboard's files, a path made up on purpose) is not the document's to describe:
    tests/integration/test_openapi.py calls every route it does list."""
    if route_of(method, path) is None:
        return
    url = urllib.parse.urlsplit(path)
    args = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
    request = MockRequest(HOST, method.lower(), url.path, args=args, data=data or b"")
    response = MockResponse(answer, status_code=status, content_type=content_type.split(";")[0])
    openapi = _openapi()
    if 200 <= status < 300:
        errors = [f"{e} {e.__cause__ or ''}" for e in openapi.iter_request_errors(request)]
        assert not errors, f"{method} {path} {data!r}: the request does not match the document: {errors}"
    errors = [f"{e} {e.__cause__ or ''}" for e in openapi.iter_response_errors(request, response)]
    assert not errors, f"{method} {path} -> {status} {answer[:300]!r}: the answer does not match the document: {errors}"
