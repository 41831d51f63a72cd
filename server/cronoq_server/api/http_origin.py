"""What keeps a page of another site from using this server through its visitor's browser.

Any page may make its visitor's browser POST to any address: a form, or fetch in no-cors mode
with a text/plain body (no preflight), with the browser's client certificate; the page cannot
read the answer, but the call is made. And a page whose name its owner makes resolve to
127.0.0.1 (DNS rebinding) is then same-origin with what it reaches, and may read answers too.
So:

- a state-changing request (any method but GET and HEAD) is refused when `Sec-Fetch-Site` says
  another site's page made it (cross-site, same-site) or its `Origin` is not the host it was
  sent to; callers that send neither (curl, the SDKs) are not affected, nor is the dashboard;
- a listener without credentials or TLS answers only to Host names no DNS answer can point at
  it: localhost, IP addresses, and the name it listens on. With credentials, a rebound page
  has none to send; with TLS, the browser finds this server's certificate under the
  attacker's name and refuses it.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

import grpc
from aiohttp import web

from ..errors import ApiError

READ_METHODS = frozenset({"GET", "HEAD"})
ANOTHER_SITE = frozenset({"cross-site", "same-site"})  # Sec-Fetch-Site values for another site's page
_DEFAULT_PORT = {"http": 80, "https": 443}


def check_browser_request(request: web.BaseRequest, any_host: bool, listen_host: str) -> None:
    """Raises PERMISSION_DENIED for a request another site's page made, or, unless any_host
    (credentials or TLS on the listener), one sent to a host name other than its own."""
    host = request.headers.get("Host")  # aiohttp refuses a request with two
    if not any_host and host is not None and not _own_name(host, listen_host):
        raise ApiError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"Host {host!r}: without credentials or TLS configured this server answers only to "
            f"localhost, IP addresses and {listen_host!r} (DNS rebinding); configure [[tokens]] or "
            "server.tls to use other names",
        )
    if request.method in READ_METHODS:
        return
    for site in request.headers.getall("Sec-Fetch-Site", ()):
        if site.strip().lower() in ANOTHER_SITE:
            raise ApiError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"Sec-Fetch-Site {site!r}: a {request.method} from another site's page is refused",
            )
    for origin in request.headers.getall("Origin", ()):
        if host is None or not _same_host(origin, host):
            raise ApiError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"Origin {origin!r}: a {request.method} from another site's page is refused "
                f"(this server was called as {host!r})",
            )


def _name(host: str) -> str | None:
    """The name or address of a Host value, lower case, without port or brackets."""
    try:
        return urlsplit("//" + host).hostname
    except ValueError:
        return None


def _own_name(host: str, listen_host: str) -> bool:
    """Whether a Host value is one DNS cannot rebind: a browser sends an address as the Host
    only for a page served from that address, and resolves localhost to loopback itself."""
    name = _name(host)
    if name is None:
        return False
    if name in ("localhost", listen_host.lower().strip("[]")):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _same_host(origin: str, host: str) -> bool:
    """Whether an Origin names the host and port of the Host header. The scheme is not compared:
    TLS may end at a proxy in front, and one host and port serve one scheme."""
    try:
        parts = urlsplit(origin)
        if parts.scheme not in _DEFAULT_PORT or parts.hostname is None or parts.path or parts.query:
            return False  # "null" (a sandboxed or opaque origin) among others
        default = _DEFAULT_PORT[parts.scheme]
        called = urlsplit("//" + host)
        return (parts.hostname, parts.port or default) == (called.hostname, called.port or default)
    except ValueError:  # a port out of range or not a number
        return False
