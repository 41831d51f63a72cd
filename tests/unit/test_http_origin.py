"""The browser checks of the HTTP listener on their own: which Origin, Sec-Fetch-Site and Host
values a request may carry (the same over a real server and Chromium: tests/integration)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from cronoq_server.api.http_origin import check_browser_request
from cronoq_server.errors import ApiError


def allowed(method: str, headers: list[tuple[str, str]], any_host: bool = False, listen: str = "127.0.0.1") -> bool:
    request = make_mocked_request(method, "/v1/tasks", headers=CIMultiDict(headers))
    try:
        check_browser_request(request, any_host, listen)
    except ApiError as err:
        assert err.code.name == "PERMISSION_DENIED" and err.http_status == 403
        return False
    return True


@pytest.mark.parametrize(
    ("host", "origin", "ok"),
    [
        ("127.0.0.1:7080", "http://127.0.0.1:7080", True),
        ("queue.example", "https://queue.example", True),  # TLS ended at a proxy
        ("queue.example:443", "https://queue.example", True),
        ("queue.example", "https://queue.example:443", True),
        ("Queue.Example", "https://queue.example", True),
        ("[::1]:7080", "http://[::1]:7080", True),
        ("queue.example", "http://queue.example:8080", False),
        ("queue.example:8080", "http://queue.example", False),
        ("queue.example", "https://evil.example", False),
        ("queue.example", "null", False),
        ("queue.example", "file://", False),
        ("queue.example", "https://queue.example/path", False),
        ("queue.example", "https://queue.example:99999", False),
        ("queue.example", "", False),
    ],
)
def test_origin_must_name_the_host_called(host: str, origin: str, ok: bool) -> None:
    headers = [("Host", host), ("Origin", origin)]
    assert allowed("POST", headers, any_host=True) is ok
    assert allowed("GET", headers, any_host=True)  # reads are not checked


def test_sec_fetch_site_and_repeated_headers() -> None:
    own = [("Host", "127.0.0.1:7080")]
    for site, ok in (("cross-site", False), ("same-site", False), ("Cross-Site", False), ("same-origin", True),
                     ("none", True)):  # fmt: skip
        assert allowed("PUT", [*own, ("Sec-Fetch-Site", site)]) is ok, site
    assert not allowed("DELETE", [*own, ("Sec-Fetch-Site", "same-origin"), ("Sec-Fetch-Site", "cross-site")])
    assert not allowed("POST", [*own, ("Origin", "http://127.0.0.1:7080"), ("Origin", "http://127.0.0.2")])
    assert not allowed("POST", [("Origin", "http://127.0.0.1:7080")])  # no Host to compare with (HTTP/1.0)
    assert allowed("POST", [])


@pytest.mark.parametrize(
    ("host", "listen", "ok"),
    [
        ("localhost:7080", "127.0.0.1", True),
        ("127.0.0.1", "127.0.0.1", True),
        ("127.3.2.1:7080", "127.0.0.1", True),
        ("[::1]:7080", "::1", True),
        ("10.1.2.3:7080", "0.0.0.0", True),  # allow_unauthenticated: an address DNS did not give
        ("[fe80::1]:7080", "::", True),
        ("queue.internal:7080", "queue.internal", True),  # its own listen name
        ("QUEUE.internal", "queue.internal", True),
        ("evil.example:7080", "127.0.0.1", False),
        ("127.0.0.1.nip.io", "127.0.0.1", False),
        ("localhost.evil.example", "127.0.0.1", False),
        ("0x7f.1", "127.0.0.1", False),  # browsers send 127.0.0.1 for it; a name otherwise
        ("evil.example:notaport", "127.0.0.1", False),
        ("", "127.0.0.1", False),
    ],
)
def test_a_listener_without_credentials_answers_to_names_dns_cannot_rebind(host: str, listen: str, ok: bool) -> None:
    assert allowed("GET", [("Host", host)], listen=listen) is ok
    assert allowed("GET", [("Host", host)], any_host=True, listen=listen)  # credentials or TLS
