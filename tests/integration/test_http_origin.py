"""Requests that browsers send for other sites' pages, over plain HTTP to a real server: a
state-changing request whose Origin is another origin, or whose Sec-Fetch-Site is cross-site or
same-site, is refused; one with neither header (curl, the SDKs) or from the server's own origin
is served. A listener without credentials or TLS answers only to Host names that DNS cannot
rebind to it. The same attacks from a real Chromium are in test_dashboard.py."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_http_hardening import exchange, parse_response, sha
from test_tls import TlsServer
from tls_pki import Pki

TOKEN = "origin-test-secret"
STATE_CHANGING = [
    ("POST", "/v1/tasks", {"pool": "default", "key": "made-by-{case}"}),
    ("POST", "/v1/batches", {"tasks": [{"pool": "default", "key": "made-by-{case}"}]}),
    ("POST", "/v1/keys/invoice-42/cancel", None),
    ("PUT", "/v1/pools/default/schedules/made-by-{case}", {"cron": "0 * * * *"}),
    ("DELETE", "/v1/pools/default/schedules/nightly", None),
]


def request(
    srv: Any, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """One request with exactly these headers (a Host given here replaces the URL's)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=10)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "text/plain", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode(errors="replace")}
    finally:
        conn.close()


def fill(value: Any, case: str) -> Any:
    return json.loads(json.dumps(value).replace("{case}", case)) if value is not None else None


def state(srv: Any) -> tuple[list[str], str, list[str]]:
    """Keys of the tasks, the state of invoice-42, names of the schedules."""
    status, tasks = srv.http("GET", "/v1/tasks?page_size=1000", token=TOKEN)
    assert status == 200, tasks
    status, task = srv.http("GET", "/v1/keys/invoice-42", token=TOKEN)
    assert status == 200, task
    status, schedules = srv.http("GET", "/v1/schedules", token=TOKEN)
    assert status == 200, schedules
    keys = sorted(t.get("key", "") for t in tasks["tasks"])
    return keys, task["task"]["state"], sorted(s["name"] for s in schedules.get("schedules", []))


def seed(srv: Any) -> None:
    assert srv.http("POST", "/v1/tasks", {"pool": "default", "key": "invoice-42"}, token=TOKEN)[0] == 200
    status, body = srv.http("PUT", "/v1/pools/default/schedules/nightly", {"cron": "0 3 * * *"}, token=TOKEN)
    assert status == 200, body


@pytest.fixture(params=["open", "tokens"])
def srv(request: Any, start_server: Any) -> Any:
    """A server without credentials (the default) and one with a token: the Origin checks hold on both."""
    config: dict[str, Any] = {"pools": [{"name": "default"}]}
    if request.param == "tokens":
        config["tokens"] = [{"name": "ops", "sha256": sha(TOKEN), "pools": ["*"], "permissions": ["admin", "submit",
                             "read", "cancel", "schedule"]}]  # fmt: skip
    server = start_server(config)
    seed(server)
    return server


def test_state_changing_requests_from_other_origins_are_refused(srv: Any) -> None:
    own = f"http://127.0.0.1:{srv.http_port}"
    auth = {"Authorization": f"Bearer {TOKEN}"} if srv.config.get("tokens") else {}
    before = state(srv)
    refused = {
        "another origin": {"Origin": f"http://127.0.0.2:{srv.http_port}"},
        "another port": {"Origin": "http://127.0.0.1:1"},
        "localhost is not 127.0.0.1": {"Origin": f"http://localhost:{srv.http_port}"},
        "an opaque origin": {"Origin": "null"},
        "cross-site": {"Sec-Fetch-Site": "cross-site"},
        "same-site": {"Sec-Fetch-Site": "same-site"},
        "cross-site with the own Origin": {"Sec-Fetch-Site": "cross-site", "Origin": own},
        "same-origin with another Origin": {"Sec-Fetch-Site": "same-origin", "Origin": "http://127.0.0.2"},
    }
    for case, headers in refused.items():
        for method, path, body in STATE_CHANGING:
            status, err = request(srv, method, path, fill(body, case), {**auth, **headers})
            assert status == 403, (case, method, path, status, err)
            assert err["code"] == "PERMISSION_DENIED", (case, err)
            assert "another site" in err["message"] and any(h in err["message"] for h in headers), (case, err)
    assert state(srv) == before
    # Reads stay open to other origins: a link from elsewhere to the dashboard or a task, and a
    # no-cors read's answer is opaque to the page that made it.
    for path in ("/v1/tasks", "/v1/keys/invoice-42", "/ui/"):
        status, body = request(srv, "GET", path, None, {**auth, "Sec-Fetch-Site": "cross-site",
                                                         "Origin": "http://127.0.0.2"})  # fmt: skip
        assert status == 200, (path, body)


def test_requests_from_the_own_origin_and_without_browser_headers_are_served(srv: Any) -> None:
    own = f"http://127.0.0.1:{srv.http_port}"
    auth = {"Authorization": f"Bearer {TOKEN}"} if srv.config.get("tokens") else {}
    allowed = {
        "curl": {},
        "same-origin": {"Sec-Fetch-Site": "same-origin", "Origin": own},
        "the own origin, no Sec-Fetch-Site": {"Origin": own},
        "typed by the user": {"Sec-Fetch-Site": "none"},
    }
    for case, headers in allowed.items():
        status, body = request(srv, "POST", "/v1/tasks", {"pool": "default", "key": f"ok-{case}"}, {**auth, **headers})
        assert status == 200, (case, body)
    status, body = request(srv, "POST", "/v1/keys/invoice-42/cancel", None, {**auth, "Origin": own})
    assert status == 200 and body["task"]["state"] == "TASK_STATE_CANCELLED", body
    status, body = request(srv, "DELETE", "/v1/pools/default/schedules/nightly", None, {**auth, "Origin": own})
    assert status == 200, body
    keys, _, schedules = state(srv)
    assert [k for k in keys if k.startswith("ok-")] == sorted(f"ok-{c}" for c in allowed) and schedules == []


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io:{port}"])
def test_a_listener_without_credentials_refuses_other_host_names(start_server: Any, host: str) -> None:
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 is same-origin
    with what it reaches, so only the Host it sends tells it apart."""
    srv = start_server({"pools": [{"name": "default"}]})
    host = host.format(port=srv.http_port)
    assert srv.http("POST", "/v1/tasks", {"pool": "default", "key": "invoice-42"})[0] == 200
    for method, path in (("GET", "/v1/tasks"), ("GET", "/v1/keys/invoice-42"), ("POST", "/v1/keys/invoice-42/cancel"),
                         ("POST", "/v1/tasks"), ("GET", "/ui/"), ("GET", "/v1/watch"), ("GET", "/metrics")):  # fmt: skip
        body = {"pool": "default"} if path == "/v1/tasks" and method == "POST" else None
        status, err = request(srv, method, path, body, {"Host": host})
        assert status == 403, (host, method, path, status, err)
        assert err["code"] == "PERMISSION_DENIED" and repr(host) in err["message"], err
        assert "[[tokens]]" in err["message"], err
    status, tasks = srv.http("GET", "/v1/tasks")
    assert [(t["key"], t["state"]) for t in tasks["tasks"]] == [("invoice-42", "TASK_STATE_PENDING")], tasks


def test_a_listener_without_credentials_answers_to_loopback_names(start_server: Any) -> None:
    srv = start_server({"pools": [{"name": "default"}]})
    port = srv.http_port
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LOCALHOST", f"127.9.8.7:{port}",
                 f"[::1]:{port}", "[::1]"):  # fmt: skip
        status, body = request(srv, "GET", "/v1/tasks", None, {"Host": host})
        assert status == 200, (host, body)
    # HTTP/1.0 needs no Host.
    status, _, body = parse_response(exchange(port, b"GET /v1/tasks HTTP/1.0\r\n\r\n"))
    assert status == 200, body
    # Two Host headers: which one would the check be about?
    raw = exchange(port, b"GET /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n")
    status, _, body = parse_response(raw)
    assert status == 400, raw
    assert "Host" in json.loads(body)["message"], body


def test_a_listener_with_credentials_answers_to_any_host_name(start_server: Any) -> None:
    """A rebound page has no token to send (nothing rides on a cookie), so names are not checked."""
    ops = {"name": "ops", "sha256": sha(TOKEN), "pools": ["*"], "permissions": ["read", "submit"]}
    srv = start_server({"pools": [{"name": "default"}], "tokens": [ops]})
    status, body = request(srv, "GET", "/v1/tasks", None, {"Host": "queue.example:443"})
    assert status == 401 and body["code"] == "UNAUTHENTICATED", body
    status, body = request(srv, "GET", "/v1/tasks", None, {"Host": "queue.example", "Authorization": f"Bearer {TOKEN}"})
    assert status == 200, body
    own = {"Host": "queue.example", "Origin": "https://queue.example", "Authorization": f"Bearer {TOKEN}"}
    status, body = request(srv, "POST", "/v1/tasks", {"pool": "default"}, own)
    assert status == 200, body  # TLS ended at a proxy in front: the scheme differs, the host is the same
    status, body = request(srv, "POST", "/v1/tasks", {"pool": "default"}, {**own, "Origin": "https://evil.example"})
    assert status == 403, body


def test_a_listener_with_tls_answers_to_any_host_name(tmp_path: Path) -> None:
    """No rebinding through TLS: the browser would find this server's certificate under the
    attacker's name and refuse it. So with TLS, even without credentials, any Host is
    answered; the Origin checks still hold."""
    pki = Pki(tmp_path)
    srv = TlsServer(tmp_path, "tls", pki, pki.server("127.0.0.1", "queue.internal"), client_ca=False, tail="")
    srv.start(None)
    try:

        def call(method: str, path: str, headers: dict[str, str]) -> int:
            body = json.dumps({"pool": "default"}).encode() if method == "POST" else None
            req = urllib.request.Request(f"https://127.0.0.1:{srv.http_port}{path}", body, headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=10, context=srv.context()) as r:
                    return int(r.status)
            except urllib.error.HTTPError as err:
                return err.code

        assert call("GET", "/v1/tasks", {"Host": "queue.internal:7080"}) == 200
        assert call("POST", "/v1/tasks", {"Host": "queue.internal", "Origin": "https://queue.internal"}) == 200
        assert call("POST", "/v1/tasks", {"Host": "queue.internal", "Origin": "https://evil.example"}) == 403
        assert call("POST", "/v1/tasks", {"Host": "queue.internal", "Sec-Fetch-Site": "cross-site"}) == 403
    finally:
        srv.kill()
