"""Hardening of the listeners: /metrics credentials, hostile JSON, aiohttp's own parser errors,
slow and idle connections, the connection cap, Watch over SSE, addresses already in use,
X-Content-Type-Options on every response, and one authorization value per call (both APIs).
Requests from other sites' pages are in test_http_origin.py.

Most tests run against real cronoq-server processes (the `start_server` fixture). The Watch
error paths and ListenError run in-process, over a stand-in node whose stream is scripted, so
that "events, then an error" and "the client went away" happen exactly when the test says.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from ports import free_port  # type: ignore[import-not-found]
from test_bad_input import Client, has_traceback

from cronoq.v1 import task_pb2, task_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb
from cronoq_server.api import grpc as grpc_api
from cronoq_server.api import http as http_api
from cronoq_server.api import http_body, http_listener
from cronoq_server.api.listen import ListenError
from cronoq_server.auth import ANONYMOUS
from cronoq_server.config import Config
from cronoq_server.errors import ApiError

DEPTH = http_body.MAX_JSON_DEPTH  # 64


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


# -- raw sockets --------------------------------------------------------------------


def read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes (or `timeout` passes)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def exchange(port: int, *parts: bytes, pause: float = 0.0, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        for i, part in enumerate(parts):
            if i and pause:
                time.sleep(pause)
            sock.sendall(part)
        return read_all(sock, timeout)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/") else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def read_response(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length, leaving the connection open."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    status, headers, body = parse_response(data)
    while len(body) < int(headers.get("content-length", "0")):
        body += sock.recv(65536)
    return status, headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closed the connection (EOF or reset), without blocking."""
    sock.setblocking(False)
    try:
        return sock.recv(65536, socket.MSG_PEEK) == b"" or _drain_to_eof(sock)
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def _drain_to_eof(sock: socket.socket) -> bool:
    """The server wrote something (a 408 or 503) and may have closed after it."""
    try:
        while chunk := sock.recv(65536):
            del chunk
        return True
    except BlockingIOError:
        return False


# -- A. /metrics ----------------------------------------------------------------------

POOLS = ["zebra-pool", "yak-pool"]
TOKENS = {
    # admin on one pool only: enough for /metrics
    "ops-secret": {"name": "ops", "pools": ["yak-pool"], "permissions": ["admin"]},
    "reader-secret": {"name": "reader", "pools": ["*"], "permissions": ["read", "submit", "cancel", "work"]},
}


def token_config(**server: Any) -> dict[str, Any]:
    return {
        "server": server,
        "pools": [{"name": p} for p in POOLS],
        "tokens": [{"sha256": sha(secret), **spec} for secret, spec in TOKENS.items()],
    }


def check_open_routes(url: str) -> None:
    for path in ("/healthz", "/readyz"):
        status, _, body = get(url + path)
        assert status == 200, (path, body)
        for pool in POOLS:
            assert pool.encode() not in body, f"{path} names pool {pool}: {body!r}"
        assert b"pools" not in body, body


def test_metrics_need_admin_when_credentials_are_configured(start_server: Any) -> None:
    srv = start_server(token_config())
    url = srv.http_url + "/metrics"
    for name, headers in (
        ("no token", {}),
        ("not bearer", {"Authorization": "Basic b3BzOnNlY3JldA=="}),
        ("unknown token", {"Authorization": "Bearer nope"}),
    ):
        status, hdrs, body = get(url, headers)
        assert status == 401, (name, status, body)
        err = json.loads(body)
        assert err["code"] == "UNAUTHENTICATED" and "authorization" in err["message"].lower(), (name, err)
        assert hdrs.get("WWW-Authenticate", "").startswith("Bearer"), (name, hdrs)
        assert b"cronoq_" not in body
    status, _, body = get(url, {"Authorization": "Bearer reader-secret"})
    assert status == 403, body
    err = json.loads(body)
    assert err["code"] == "PERMISSION_DENIED", err
    assert "'reader'" in err["message"] and "'admin'" in err["message"] and "metrics_public" in err["message"], err
    status, hdrs, body = get(url, {"Authorization": "Bearer ops-secret"})
    assert status == 200, body
    assert hdrs["Content-Type"].startswith("text/plain") and b"cronoq_" in body
    check_open_routes(srv.http_url)
    assert not has_traceback(srv.log())


def test_metrics_public_and_metrics_without_credentials(start_server: Any) -> None:
    public = start_server(token_config(metrics_public=True), name="public")
    status, _, body = get(public.http_url + "/metrics")
    assert status == 200 and b"cronoq_" in body, body
    check_open_routes(public.http_url)
    # The API itself still needs a token.
    assert get(public.http_url + "/v1/tasks")[0] == 401
    public.kill()  # the next server uses the same store
    open_server = start_server({"pools": [{"name": p} for p in POOLS]}, name="open")
    status, _, body = get(open_server.http_url + "/metrics")
    assert status == 200 and b"cronoq_" in body, body
    check_open_routes(open_server.http_url)


# -- B. hostile JSON ------------------------------------------------------------------


@pytest.fixture
def client(server: Any) -> Iterator[Client]:
    c = Client(server)
    yield c
    c.close()


def nest(levels: int, inner: Any = 1) -> Any:
    value = inner
    for _ in range(levels):
        value = [value]
    return value


def test_json_nested_too_deep(client: Client) -> None:
    client.server.http("POST", "/v1/tasks", {"pool": "default", "key": "seed"})
    body_cases: list[tuple[str, str, Any]] = [
        # the body is the first level: payload_json nested DEPTH levels makes the body DEPTH + 1
        ("payload_json one level too deep", "/v1/tasks", {"pool": "default", "payload_json": nest(DEPTH)}),
        ("payload_json of objects", "/v1/tasks", {"pool": "default", "payload_json": nest(DEPTH + 5, {"a": {}})}),
        ("resources nested", "/v1/tasks", {"pool": "default", "resources": {"gpu": nest(DEPTH + 2)}}),
        ("unknown field nested", "/v1/tasks", {"pool": "default", "extra": nest(DEPTH + 2)}),
        ("batch task nested", "/v1/batches", {"tasks": [{"pool": "default", "payload_json": nest(DEPTH + 1)}]}),
    ]
    for name, path, body in body_cases:
        client.http_case(name, "POST", path, "INVALID_ARGUMENT", "body", f"at most {DEPTH} levels", body=body)
    raw_cases: list[tuple[str, bytes]] = [
        # far past Python's recursion limit: json.loads alone raises RecursionError (a 500 before)
        ("100,000 open brackets", b"[" * 100_000),
        ("100,000 balanced brackets", b"[" * 100_000 + b"]" * 100_000),
        ("100,000 nested objects in payload_json", b'{"pool": "default", "payload_json": ' + b'{"a":' * 100_000),
        ("2,000 levels in payload_json", b'{"pool":"default","payload_json":' + b"[" * 2000 + b"]" * 2000 + b"}"),
    ]
    for name, raw in raw_cases:
        client.http_case(name, "POST", "/v1/tasks", "INVALID_ARGUMENT", "body", f"at most {DEPTH} levels", raw=raw)
    # Exactly DEPTH levels is admitted, and brackets inside strings are not nesting.
    status, body = client.server.http("POST", "/v1/tasks", {"pool": "default", "payload_json": nest(DEPTH - 1)})
    assert status == 200, body
    assert body["task"]["payload_json"] == nest(DEPTH - 1)
    tricky = {"s": '\\"[[[[' + "[" * 500 + '"{{{', "t": ["]]]", "\\"]}
    status, body = client.server.http("POST", "/v1/tasks", {"pool": "default", "payload_json": tricky})
    assert status == 200, body
    assert body["task"]["payload_json"] == tricky
    client.finish()


def test_json_non_finite_numbers(client: Client) -> None:
    client.server.http("POST", "/v1/tasks", {"pool": "default", "key": "seed"})
    cases: list[tuple[str, bytes, str]] = [
        ("NaN payload_json", b'{"pool": "default", "payload_json": NaN}', "NaN"),
        ("Infinity payload_json", b'{"pool": "default", "payload_json": {"x": Infinity}}', "Infinity"),
        ("-Infinity payload_json", b'{"pool": "default", "payload_json": [1, -Infinity]}', "-Infinity"),
        ("NaN priority", b'{"pool": "default", "priority": NaN}', "NaN"),
        ("NaN in a batch", b'{"tasks": [{"pool": "default", "payload_json": NaN}]}', "NaN"),
        ("1e400 overflows a double", b'{"pool": "default", "payload_json": 1e400}', "1e400"),
        ("-1e400 overflows a double", b'{"pool": "default", "payload_json": {"n": -1e400}}', "-1e400"),
    ]
    for name, raw, fragment in cases:
        path = "/v1/batches" if raw.startswith(b'{"tasks"') else "/v1/tasks"
        client.http_case(name, "POST", path, "INVALID_ARGUMENT", "body", fragment, raw=raw)
    client.finish()


def test_payload_must_be_strict_base64(client: Client) -> None:
    client.server.http("POST", "/v1/tasks", {"pool": "default", "key": "seed"})
    for bad in ("!!!", "abc$", "QQ=", "Q", "QQ==QQ==", " QUJD", "QUJD\n", "QU JD", "Q===", "ü"):
        client.http_case(
            f"payload {bad!r}", "POST", "/v1/tasks", "INVALID_ARGUMENT", "payload", repr(bad)[1:-1],
            body={"pool": "default", "payload": bad},
        )  # fmt: skip
    client.http_case(
        "bad payload in a batch task",
        "POST",
        "/v1/batches",
        "INVALID_ARGUMENT",
        "tasks[1].payload",
        "'!!!'",
        body={"tasks": [{"pool": "default", "payload": "QUJD"}, {"pool": "default", "payload": "!!!"}]},
    )
    # Standard and URL-safe alphabets, padded or not, are all proto3 JSON.
    for text, data in (("QUJD", b"ABC"), ("QQ", b"A"), ("QQ==", b"A"), ("-_8=", b"\xfb\xff"), ("+/8", b"\xfb\xff")):
        status, body = client.server.http("POST", "/v1/tasks", {"pool": "default", "payload": text})
        assert status == 200, (text, body)
        assert base64.b64decode(body["task"]["payload"]) == data, (text, body)
    client.finish()


def test_oversized_numbers_in_the_query(client: Client) -> None:
    """int() of 5,000 digits raises ValueError (Python's digit limit): a 500 before."""
    seeded = client.server.http("POST", "/v1/tasks", {"pool": "default", "key": "seed"})[1]["task"]["id"]
    digits = "9" * 5000
    client.http_case("page_size 5,000 digits", "GET", f"/v1/tasks?page_size={digits}", "INVALID_ARGUMENT", "page_size")
    client.http_case(
        "timeout_ms 5,000 digits", "GET", f"/v1/tasks/{seeded}/wait?timeout_ms={digits}", "INVALID_ARGUMENT",
        "timeout_ms",
    )  # fmt: skip
    client.http_case("include_payloads not a bool", "GET", "/v1/watch?include_payloads=yes", "INVALID_ARGUMENT",
                     "include_payloads", "'yes'")  # fmt: skip
    client.finish()


def test_core_refusals_of_page_tokens_and_run_at(client: Client) -> None:
    """Checked in the core (core/tasks.py): a page_token that is not this shard's, and run_at
    outside google.protobuf.Timestamp's range (0001-01-01 .. 9999-12-31), are 400, not 500."""
    client.server.http("POST", "/v1/tasks", {"pool": "default", "key": "seed"})
    for name, token in (
        ("5,000 digits", "7" * 5000),
        ("2**70", str(2**70)),
        ("another shard's", str((5 << 56) | 1)),
    ):
        client.http_case(f"page_token {name}", "GET", f"/v1/tasks?page_token={token}", "INVALID_ARGUMENT", "page_token")
        req = tpb.ListTasksRequest(page_token=token)
        client.grpc_case(
            f"gRPC page_token {name}", lambda req=req: client.tasks.ListTasks(req, timeout=10), "INVALID_ARGUMENT",
            "page_token",
        )  # fmt: skip
    for text in ("10000-01-01T00:00:00Z", "0000-12-31T23:59:59Z", "-0001-01-01T00:00:00Z"):
        client.http_case(
            f"run_at {text}", "POST", "/v1/tasks", "INVALID_ARGUMENT", "run_at",
            body={"pool": "default", "run_at": text},
        )  # fmt: skip
    for seconds, nanos in ((253402300800, 0), (-62135596801, 0), (2**62, 0), (0, -1), (0, 1_000_000_000)):
        req = tpb.SubmitTaskRequest(pool="default")
        req.run_at.seconds, req.run_at.nanos = seconds, nanos
        client.grpc_case(
            f"gRPC run_at seconds={seconds} nanos={nanos}", lambda req=req: client.tasks.SubmitTask(req, timeout=10),
            "INVALID_ARGUMENT", "run_at",
        )  # fmt: skip
    client.finish()


# -- B. aiohttp's own parser errors -----------------------------------------------------


def test_parser_errors_answer_with_the_json_error_body(client: Client) -> None:
    client.server.http("POST", "/v1/tasks", {"pool": "default", "key": "seed"})
    before = client.listing()
    port = client.server.http_port
    many_headers = b"".join(b"X-H%d: 1\r\n" % i for i in range(200))
    cases: list[tuple[str, tuple[bytes, ...], int, str]] = [
        ("URL over 8 KiB", (b"GET /v1/tasks/" + b"1" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",), 414, "URL"),
        ("header over 8 KiB", (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",), 431,
         "header"),
        ("200 headers", (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + many_headers + b"\r\n",), 431, "header fields"),
        ("garbage request line", (b"GARBAGE\r\n\r\n",), 400, "request line"),
        ("TLS hello on the HTTP port", (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,), 400,
         "request"),
        ("HTTP/2 preface", (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",), 400, "request"),
        ("no Host in HTTP/1.1", (b"GET /healthz HTTP/1.1\r\n\r\n",), 400, "Host"),
        ("Content-Length not a number",
         (b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",), 400, "Content-Length"),
        ("two Content-Lengths",
         (b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",), 400,
         "Content-Length"),
        ("Expect: 100-continue for a body over the limit",
         (b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5242880\r\nExpect: 100-continue\r\n\r\n",), 413,
         "body"),
        ("Expect: something else",
         (b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nExpect: 200-ok\r\n\r\n{}",), 417, "Expect"),
        ("bad chunk size with the headers",
         (b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",), 400, "chunk"),
        ("bad chunk size after the handler started reading",
         (b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\n{\"poo\r\nzz\r\n"),
         400, "chunk"),
    ]  # fmt: skip
    for name, parts, want, fragment in cases:
        raw = exchange(port, *parts, pause=0.3)
        if raw.startswith(b"HTTP/1.1 100"):
            client.fail(name, f"answered 100 Continue: {raw[:300]!r}")
            continue
        status, headers, body = parse_response(raw)
        if status != want:
            client.fail(name, f"HTTP status {status}, want {want}: {raw[:300]!r}")
            continue
        if not headers.get("content-type", "").startswith("application/json"):
            client.fail(name, f"Content-Type {headers.get('content-type')!r}, want application/json")
            continue
        try:
            err = json.loads(body)
        except ValueError:
            client.fail(name, f"body is not JSON: {body[:300]!r}")
            continue
        if set(err) != {"code", "message", "reason"} or err["code"] != "INVALID_ARGUMENT":
            client.fail(name, f"body {err!r}, want code INVALID_ARGUMENT and a message")
        elif fragment.lower() not in err["message"].lower():
            client.fail(name, f"message {err['message']!r} does not name {fragment!r}")
        if has_traceback(body.decode(errors="replace")):
            client.fail(name, "traceback in the body")
    assert client.listing() == before
    client.finish()


# -- C. slow and idle connections ---------------------------------------------------------


def test_slow_headers_are_cut_off_idle_keepalive_is_not(server: Any) -> None:
    port = server.http_port
    limit = http_listener.HEADER_TIMEOUT_S
    silent = socket.create_connection(("127.0.0.1", port))
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    kept = socket.create_connection(("127.0.0.1", port))
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert read_response(kept)[0] == 200
    start = time.monotonic()
    closed_at: dict[str, float] = {}
    answers: dict[str, bytes] = {}
    for name, sock in (("silent", silent), ("slow", slow)):
        sock.setblocking(False)
        answers[name] = b""
    while time.monotonic() - start < limit + 3 and len(closed_at) < 2:
        elapsed = time.monotonic() - start
        if "slow" not in closed_at:
            try:
                slow.send(b"X")  # one byte of a header name a second: never a whole header
            except OSError:
                pass
        for name, sock in (("silent", silent), ("slow", slow)):
            if name in closed_at:
                continue
            try:
                while chunk := sock.recv(65536):
                    answers[name] += chunk
                closed_at[name] = elapsed
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed_at[name] = elapsed
        time.sleep(1.0 if "slow" not in closed_at else 0.05)
    for name in ("silent", "slow"):
        assert name in closed_at, f"{name} connection still open after {time.monotonic() - start:.1f}s"
        assert limit - 1.5 <= closed_at[name] <= limit + 2, (name, closed_at)
        if answers[name]:  # the 408 can be lost to a reset when the client keeps sending
            status, _, body = parse_response(answers[name])
            assert status == 408, answers[name]
            assert json.loads(body)["code"] == "DEADLINE_EXCEEDED"
            assert f"{limit:g}s" in json.loads(body)["message"]
    assert answers["silent"], "the silent connection got no 408"
    # A kept-alive connection idle that long is not a slow request: it still serves.
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    status, _, body = read_response(kept)
    assert status == 200, body
    for sock in (silent, slow, kept):
        sock.close()
    print(f"closed after: {closed_at}")
    assert not has_traceback(server.log())


def test_connection_cap_closes_idle_first_and_refuses_when_all_are_busy(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 100
    monkeypatch.setenv(http_listener.MAX_CONNECTIONS_ENV, str(cap))
    srv = start_server({"pools": [{"name": "default"}]})
    port = srv.http_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(500)]
    time.sleep(0.5)
    started = time.monotonic()
    status, _, body = get(srv.http_url + "/v1/info")
    latency = time.monotonic() - started
    assert status == 200, body
    assert latency < 2.0, latency
    closed = sum(closed_by_server(s) for s in idle)
    assert closed >= 500 - cap, f"only {closed} of 500 idle connections were closed with a cap of {cap}"

    # Every slot busy (long polls): a new connection is refused with 503 and the JSON body.
    task_id = srv.http("POST", "/v1/tasks", {"pool": "default"})[1]["task"]["id"]
    waits = []
    for _ in range(cap):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(f"GET /v1/tasks/{task_id}/wait?timeout_ms=3000 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        waits.append(s)
    time.sleep(0.7)
    refused_at = time.monotonic()
    status, headers, body = get(srv.http_url + "/v1/info")
    refusal_latency = time.monotonic() - refused_at
    assert status == 503, body
    err = json.loads(body)
    assert err["code"] == "UNAVAILABLE" and "too many connections" in err["message"] and str(cap) in err["message"]
    assert headers.get("Retry-After") == "1" and headers.get("X-Content-Type-Options") == "nosniff", headers
    for s in waits:
        got, _, body = read_response(s, timeout=10)
        assert got == 200, body
    # The long polls are done and idle again: callers get through.
    assert get(srv.http_url + "/v1/info")[0] == 200
    for s in idle + waits:
        s.close()
    print(f"cap {cap}: 500 idle sockets, {closed} closed by the server; a call took {latency * 1000:.0f} ms; "
          f"the refusal took {refusal_latency * 1000:.0f} ms")  # fmt: skip
    assert not has_traceback(srv.log())


async def test_keepalive_and_header_timeouts_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timers with short values: an idle kept-alive connection closes after KEEPALIVE_TIMEOUT_S;
    a next request whose head trickles, HEADER_TIMEOUT_S after its first byte; a body that stops
    arriving, BODY_TIMEOUT_S after its headers."""
    monkeypatch.setattr(http_listener, "HEADER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http_listener, "KEEPALIVE_TIMEOUT_S", 2.0)
    monkeypatch.setattr(http_api, "BODY_TIMEOUT_S", 0.5)
    runner, port = await start_scripted_http(ScriptedNode(0))
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200"), head
        served = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), 6)  # the body, then EOF
        idle_for = time.monotonic() - served
        assert rest == b'{"status": "ok"}', rest
        assert 1.8 <= idle_for <= 3.5, idle_for
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        await asyncio.wait_for(reader.readuntil(b'{"status": "ok"}'), 5)
        await asyncio.sleep(0.8)  # idle longer than the header timeout: still open
        writer.write(b"GET /hea")
        started = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), 5)
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer
        assert b"\r\nX-Content-Type-Options: nosniff\r\n" in answer.partition(b"\r\n\r\n")[0] + b"\r\n", answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["code"] == "DEADLINE_EXCEEDED"
        assert 0.4 <= took <= 1.5, took
        writer.close()

        # A body that never completes: 408 after BODY_TIMEOUT_S, and the connection closes.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b'POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"pool": ')
        started = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), 5)
        body_took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"\r\nX-Content-Type-Options: nosniff\r\n" in answer.partition(b"\r\n\r\n")[0] + b"\r\n", answer
        err = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert err["code"] == "DEADLINE_EXCEEDED" and "body" in err["message"] and "100" in err["message"], err
        assert 0.4 <= body_took <= 1.5, body_took
        writer.close()
        print(f"idle keep-alive closed after {idle_for:.2f}s (2.0); slow head cut after {took:.2f}s (0.5); "
              f"slow body cut after {body_took:.2f}s (0.5)")  # fmt: skip
    finally:
        await runner.cleanup()


# -- C. gRPC keep-alive ---------------------------------------------------------------------


def test_grpc_keepalive_options_are_set_and_clients_work(server: Any) -> None:
    options = dict(grpc_api.server_options(SimpleNamespace(config=Config())))  # type: ignore[arg-type]
    assert options["grpc.keepalive_time_ms"] == 60_000
    assert options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert options["grpc.http2.max_pings_without_data"] == 0
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= 10_000
    # A client that pings every 10 s, even with no call open, is within the server's policy.
    channel = grpc.insecure_channel(
        server.grpc_target,
        options=[("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_permit_without_calls", 1)],
    )
    try:
        stub = task_service_pb2_grpc.TaskServiceStub(channel)
        task = stub.SubmitTask(tpb.SubmitTaskRequest(pool="default", payload=b"x"), timeout=10).task
        got = stub.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), timeout=10).task
        assert got.payload == b"x"
    finally:
        channel.close()


# -- D. Watch over SSE (real server) ----------------------------------------------------------


class SmallBufferConnection(http.client.HTTPConnection):
    """A client that reads nothing can buffer only 64 KiB: the server's writes back up fast."""

    def connect(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.settimeout(self.timeout)
        sock.connect((self.host, self.port))
        self.sock = sock


def sse_events(resp: http.client.HTTPResponse) -> Iterator[tuple[str, str]]:
    """(event name, data) per server-sent event; comments are skipped."""
    name, data = "message", ""
    while line := resp.readline():
        text = line.decode().rstrip("\n")
        if text.startswith(":"):
            continue
        if text.startswith("event: "):
            name = text[7:]
        elif text.startswith("data: "):
            data = text[6:]
        elif text == "" and data:
            yield name, data
            name, data = "message", ""


def open_watch(srv: Any, query: str, conn_class: type[http.client.HTTPConnection] = http.client.HTTPConnection):
    conn = conn_class("127.0.0.1", srv.http_port, timeout=20)
    conn.request("GET", "/v1/watch" + query)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.readline() == b": watching\n"
    return conn, resp


def test_watch_include_payloads(server: Any) -> None:
    bare_conn, bare = open_watch(server, "")
    full_conn, full = open_watch(server, "?include_payloads=true&pool=default")
    time.sleep(0.2)
    status, _ = server.http("POST", "/v1/tasks", {"pool": "default", "payload_json": {"secret": 7}})
    assert status == 200
    _, data = next(sse_events(bare))
    assert "payload" not in json.loads(data)["task"] and "payload_json" not in json.loads(data)["task"], data
    _, data = next(sse_events(full))
    assert json.loads(data)["task"]["payload_json"] == {"secret": 7}, data
    bare_conn.close()
    full_conn.close()


def test_watch_that_falls_behind_ends_with_an_error_event(start_server: Any) -> None:
    srv = start_server({"pools": [{"name": "default"}], "limits": {"max_payload_bytes": 1 << 20}})
    conn, resp = open_watch(srv, "?include_payloads=true", SmallBufferConnection)
    channel = grpc.insecure_channel(srv.grpc_target)
    stub = task_service_pb2_grpc.TaskServiceStub(channel)
    for i in range(48):  # 48 MiB of events: past the watcher's 16 MiB plus every socket buffer
        stub.SubmitTask(tpb.SubmitTaskRequest(pool="default", payload=bytes([i]) * (1 << 20)), timeout=30)
    channel.close()
    events = list(sse_events(resp))  # the stream ends: the response is complete
    conn.close()
    names = [name for name, _ in events]
    assert names[-1] == "error", names
    assert set(names[:-1]) == {"message"} and 0 < len(names) - 1 < 48, names
    err = json.loads(events[-1][1])
    assert err["code"] == "ABORTED" and "fell behind" in err["message"] and "reconnect" in err["message"], err
    print(f"{len(names) - 1} events, then: {err['message']}")
    assert not has_traceback(srv.log())


# -- D. Watch error paths, in-process over a scripted node -------------------------------------


class ScriptedNode:
    """Enough of Node for the APIs' Watch: `count` events, then `error` (or a wait forever)."""

    def __init__(self, count: int, error: ApiError | None = None, end: bool = False):
        self.config = Config()
        self.shard_number = 0  # unsharded
        self.is_leader = True
        self.end = end
        self.auth = SimpleNamespace(enabled=False)
        self.count = count
        self.error = error
        self.requests: list[tpb.WatchRequest] = []
        self.closed = asyncio.Event()

    def authenticate(self, authorization: str | None, cert_subject: str | None) -> Any:
        return ANONYMOUS

    def admit(self, method: str, caller: Any, *, leading: bool = True) -> None:
        pass

    async def call(self, method: str, request: Any, caller: Any) -> Any:
        raise ApiError(grpc.StatusCode.UNIMPLEMENTED, f"{method}: not scripted")

    async def open_watch(self, request: tpb.WatchRequest, caller: Any) -> tuple[int, AsyncIterator[tpb.WatchResponse]]:
        self.requests.append(request)
        return 0, self._stream()

    async def _stream(self) -> AsyncIterator[tpb.WatchResponse]:
        try:
            for i in range(self.count):
                task = task_pb2.Task(id=i + 1, pool="default")
                yield tpb.WatchResponse(event=task_pb2.TaskEvent(task=task, shard="unsharded"))
            if self.error is not None:
                raise self.error
            if not self.end:
                await asyncio.Event().wait()
        finally:
            self.closed.set()


BEHIND = ApiError(grpc.StatusCode.ABORTED, "watch fell behind: 10000 events unread; reconnect to resume")


async def read_sse(reader: asyncio.StreamReader, want: int) -> list[bytes]:
    """The first `want` non-comment SSE blocks (the body is chunked: chunk-size lines are dropped)."""
    blocks: list[bytes] = []
    buf = b""
    while len(blocks) < want:
        line = await asyncio.wait_for(reader.readline(), 5)
        assert line, f"EOF after {blocks}"
        if line.startswith((b"event:", b"data:")):
            buf += line
        elif line == b"\n" and buf:
            blocks.append(buf)
            buf = b""
    return blocks


async def start_scripted_http(node: ScriptedNode) -> tuple[Any, int]:
    port = free_port()
    runner = await http_api.start_http(node, f"127.0.0.1:{port}")  # type: ignore[arg-type]
    return runner, port


async def test_sse_error_event_after_events_and_include_payloads() -> None:
    node = ScriptedNode(2, BEHIND)
    runner, port = await start_scripted_http(node)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/watch?pool=default&include_payloads=true HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        blocks = await read_sse(reader, 3)
        rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)  # the chunked body's last chunk
        writer.close()
        assert [b.startswith(b"data: ") for b in blocks] == [True, True, False], blocks
        assert json.loads(blocks[1][6:])["task"]["id"] == "2"
        assert blocks[2].startswith(b"event: error\ndata: "), blocks[2]
        err = json.loads(blocks[2].split(b"data: ", 1)[1])
        assert err == {"code": "ABORTED", "message": BEHIND.message, "reason": BEHIND.reason}
        assert rest.strip() == b"0", rest  # nothing after the error event
        assert node.requests[0].include_payloads is True and node.requests[0].pool == "default"
        assert node.closed.is_set()
    finally:
        await runner.cleanup()


async def test_sse_stream_that_ends_ends_the_response() -> None:
    """As at a drain: the events, then the end of the body; no error event."""
    node = ScriptedNode(2, end=True)
    runner, port = await start_scripted_http(node)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/watch HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        body = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 5)
        writer.close()
        assert body.count(b"data: ") == 2 and b"event: error" not in body, body
        assert b'"payload' not in body and b'"result"' not in body, body  # include_payloads not set
        assert node.closed.is_set()
    finally:
        await runner.cleanup()


async def test_sse_client_disconnect_closes_the_stream() -> None:
    node = ScriptedNode(1)
    runner, port = await start_scripted_http(node)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/watch HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await read_sse(reader, 1)
        assert not node.closed.is_set()
        assert node.requests[0].include_payloads is False
        writer.close()
        started = time.monotonic()
        await asyncio.wait_for(node.closed.wait(), 3)  # not at the next heartbeat, not never
        print(f"stream closed {1000 * (time.monotonic() - started):.0f} ms after the client left")
    finally:
        await runner.cleanup()


async def grpc_watch(node: ScriptedNode) -> tuple[grpc.aio.Server, grpc.aio.Channel, Any]:
    port = free_port()
    server, _ = await grpc_api.start_grpc(node, f"127.0.0.1:{port}")  # type: ignore[arg-type]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, task_service_pb2_grpc.TaskServiceStub(channel)


async def test_grpc_watch_aborts_after_events() -> None:
    node = ScriptedNode(2, BEHIND)
    server, channel, stub = await grpc_watch(node)
    try:
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for item in stub.Watch(tpb.WatchRequest(pool="default", include_payloads=True), timeout=5):
                got.append(item.event.task.id)
        assert got == [1, 2]
        assert info.value.code() == grpc.StatusCode.ABORTED and info.value.details() == BEHIND.message
        assert node.requests[0].include_payloads is True
        await asyncio.wait_for(node.closed.wait(), 3)
    finally:
        await channel.close()
        await server.stop(None)


async def test_grpc_watch_cancelled_closes_the_stream() -> None:
    node = ScriptedNode(1)
    server, channel, stub = await grpc_watch(node)
    try:
        call = stub.Watch(tpb.WatchRequest(), timeout=10)
        assert (await call.read()).event.task.id == 1
        call.cancel()
        await asyncio.wait_for(node.closed.wait(), 3)
    finally:
        await channel.close()
        await server.stop(None)


# -- E. an address already in use -------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


async def test_listen_errors_name_the_key_and_the_reason(taken_port: int) -> None:
    node = ScriptedNode(0)
    with pytest.raises(ListenError) as info:
        await http_api.start_http(node, f"127.0.0.1:{taken_port}")  # type: ignore[arg-type]
    assert str(info.value) == f"server.http_listen: cannot listen on 127.0.0.1:{taken_port}: address already in use"
    with pytest.raises(ListenError) as info:
        await grpc_api.start_grpc(node, f"127.0.0.1:{taken_port}")  # type: ignore[arg-type]
    assert str(info.value) == f"server.listen: cannot listen on 127.0.0.1:{taken_port}: address already in use"
    with pytest.raises(ListenError) as info:
        await http_api.start_http(node, "203.0.113.7:8080")  # type: ignore[arg-type]  # TEST-NET-3: not ours
    assert str(info.value) == "server.http_listen: cannot listen on 203.0.113.7:8080: cannot assign requested address"


def test_server_exits_2_with_one_line_when_the_port_is_taken(start_server: Any, taken_port: int) -> None:
    """main.py catches ListenError: exit code 2 and one line on stderr, no traceback."""
    for key in ("listen", "http_listen"):
        srv = start_server({"server": {key: f"127.0.0.1:{taken_port}"}}, name=f"taken-{key}", wait_ready=False)
        assert srv.proc is not None
        code = srv.proc.wait(15)
        log = srv.log()
        assert code == 2, log
        assert not has_traceback(log), log
        assert f"server.{key}: cannot listen on 127.0.0.1:{taken_port}: address already in use" in log, log


# -- E. X-Content-Type-Options on every response --------------------------------------------


def head_of(port: int, request: bytes) -> tuple[int, dict[str, str]]:
    """The status and headers of the response to `request`, without waiting for its body (SSE)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status, headers, _ = parse_response(data)
    return status, headers


def test_every_response_says_nosniff(server: Any) -> None:
    """JSON, SSE, errors of the API, of the router and of aiohttp's parser, the /ui redirect."""
    port = server.http_port
    task_id = server.http("POST", "/v1/tasks", {"pool": "default"})[1]["task"]["id"]

    def get_(path: str, *headers: str) -> bytes:
        return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{''.join(headers)}\r\n".encode()

    cases: list[tuple[str, bytes, int]] = [
        ("a task", get_(f"/v1/tasks/{task_id}"), 200),
        ("a listing", get_("/v1/tasks"), 200),
        ("a bad query", get_("/v1/tasks?page_size=abc"), 400),
        ("a missing task", get_("/v1/tasks/999999"), 404),
        ("no such route", get_("/nope"), 404),
        ("a method not allowed", b"DELETE /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 405),
        ("Watch (SSE)", get_("/v1/watch"), 200),
        ("/metrics", get_("/metrics"), 200),
        ("/healthz", get_("/healthz"), 200),
        ("/readyz", get_("/readyz"), 200),
        ("the /ui redirect", get_("/ui"), 301),
        ("a dashboard file", get_("/ui/"), 200),
        ("a missing dashboard file", get_("/ui/nope.js"), 404),
        ("a POST", b'POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 19\r\n\r\n{"pool": "default"}', 200),
        ("a body that is not JSON", b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\n\r\n{", 400),
        ("Expect: 100-continue over the limit",
         b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5242880\r\nExpect: 100-continue\r\n\r\n", 413),
        ("Expect: something else",
         b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nExpect: 200-ok\r\n\r\n{}", 417),
        ("another site's form", b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://127.0.0.2\r\n"
         b"Content-Length: 2\r\n\r\n{}", 403),
        ("another host name", get_("/v1/tasks").replace(b"Host: 127.0.0.1", b"Host: evil.example"), 403),
        ("two authorization headers", get_("/v1/tasks", "Authorization: Bearer a\r\n", "Authorization: Bearer b\r\n"),
         400),
        ("the parser: garbage", b"GARBAGE\r\n\r\n", 400),
        ("the parser: a URL over 8 KiB", b"GET /v1/tasks/" + b"1" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 414),
        ("the parser: no Host", b"GET /healthz HTTP/1.1\r\n\r\n", 400),
    ]  # fmt: skip
    wrong = []
    for name, raw, want in cases:
        status, headers = head_of(port, raw)
        if status != want or headers.get("x-content-type-options") != "nosniff":
            wrong.append(f"{name}: HTTP {status} (want {want}), X-Content-Type-Options "
                         f"{headers.get('x-content-type-options')!r}")  # fmt: skip
    assert not wrong, "\n".join(wrong)


# -- F. one authorization per call ----------------------------------------------------------------


@pytest.mark.parametrize("with_tokens", [True, False], ids=["tokens", "open"])
def test_two_authorization_values_are_refused_on_both_apis(start_server: Any, with_tokens: bool) -> None:
    """Which one would be meant? Neither is used: HTTP 400 (RFC 6750's invalid_request), gRPC UNAUTHENTICATED."""
    srv = start_server(token_config() if with_tokens else {"pools": [{"name": p} for p in POOLS]})
    good, bad = "Bearer reader-secret", "Bearer nope"
    for pair in ((good, bad), (bad, good), (good, good), (good, "Basic b3BzOnNlY3JldA==")):
        for path in ("/v1/tasks", "/v1/watch", "/v1/info"):
            request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            request += "".join(f"Authorization: {value}\r\n" for value in pair) + "\r\n"
            status, _, body = parse_response(exchange(srv.http_port, request.encode(), timeout=2))
            assert status == 400, (pair, path, status, body)
            err = json.loads(body)
            assert err["code"] == "UNAUTHENTICATED" and "authorization" in err["message"], err
            assert "2 " in err["message"] and "reader-secret" not in err["message"], err
        channel = grpc.insecure_channel(srv.grpc_target)
        try:
            stub = task_service_pb2_grpc.TaskServiceStub(channel)
            metadata = [("authorization", value) for value in pair]
            with pytest.raises(grpc.RpcError) as unary:
                stub.SubmitTask(tpb.SubmitTaskRequest(pool=POOLS[0]), metadata=metadata, timeout=10)
            with pytest.raises(grpc.RpcError) as stream:
                next(iter(stub.Watch(tpb.WatchRequest(), metadata=metadata, timeout=10)))
            for err in (unary.value, stream.value):
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (pair, err)
                assert "authorization" in err.details() and "2 " in err.details(), err.details()
        finally:
            channel.close()
    # One value is served as before.
    status, _, body = get(srv.http_url + "/v1/tasks", {"Authorization": good})
    assert status == 200, body
    assert srv.http("GET", "/v1/tasks", token="reader-secret")[0] == 200
