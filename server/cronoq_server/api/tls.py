"""TLS for both listeners.

- [server.tls] (cert, key, client_ca) covers the gRPC and the HTTP listener alike. With
  client_ca both REQUIRE a client certificate signed by it: grpcio cannot ask for an
  optional one (require_client_auth=False never requests a certificate), so the HTTP
  listener requires one too rather than behave differently.
- A verified client certificate's subject, in canonical RFC 4514 form (config.subject_string),
  names a [[clients]] principal: grpc_cert_subject and http_cert_subject.

The files themselves are read and checked by tls_files.py; [server.peer_tls], the credentials of
this server's calls to other servers, by sharding/peers.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl

import grpc
from aiohttp import web
from cryptography import x509

from ..config import ConfigError, TlsConfig, subject_string
from ..tls_files import server_files

log = logging.getLogger("cronoq.tls")

# A TLS handshake on the HTTP listener must finish within this (asyncio's default is 60 s;
# the listener's own header timeout starts only once the handshake is done).
HANDSHAKE_TIMEOUT_S = 10.0
_SUBJECT_CACHE = 1024  # distinct client certificates whose subject is kept parsed


def describe(tls: TlsConfig | None) -> str:
    """For the start-up log line."""
    if tls is None:
        return "off"
    return "on, client certificates required" if tls.client_ca else "on"


# -- the gRPC listener --------------------------------------------------------------


def grpc_server_credentials(tls: TlsConfig | None) -> grpc.ServerCredentials | None:
    """None without [server.tls] (plaintext). With client_ca a client certificate is required."""
    if tls is None:
        return None
    files = server_files(tls)
    if files.client_ca is not None:
        return grpc.ssl_server_credentials(
            [(files.key, files.cert)], root_certificates=files.client_ca, require_client_auth=True
        )
    return grpc.ssl_server_credentials([(files.key, files.cert)])


@functools.lru_cache(maxsize=_SUBJECT_CACHE)
def _subject_of_pem(pem: bytes) -> str:
    return subject_string(x509.load_pem_x509_certificate(pem).subject)


@functools.lru_cache(maxsize=_SUBJECT_CACHE)
def _subject_of_der(der: bytes) -> str:
    return subject_string(x509.load_der_x509_certificate(der).subject)


def grpc_cert_subject(context: grpc.aio.ServicerContext) -> str | None:
    """The subject of the client certificate gRPC verified on this call's connection, in the
    canonical RFC 4514 form; None without one. Parsed from the certificate itself
    (x509_pem_cert) rather than taken from grpc's x509_subject text."""
    pems = list(context.auth_context().get("x509_pem_cert") or ())
    if not pems:
        return None
    try:
        return _subject_of_pem(bytes(pems[0]))
    except ValueError:
        return None


# -- the HTTP listener --------------------------------------------------------------


def http_ssl_context(tls: TlsConfig | None) -> ssl.SSLContext | None:
    """None without [server.tls]. With client_ca a client certificate is required."""
    if tls is None:
        return None
    server_files(tls)  # one-line errors for the files
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except (OSError, ValueError) as err:
        raise ConfigError(f"server.tls.cert: cannot load {tls.cert!r} with {tls.key!r}: {err}") from None
    if tls.client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca)
        except (OSError, ValueError) as err:
            raise ConfigError(f"server.tls.client_ca: cannot load {tls.client_ca!r}: {err}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class _TlsSite(web.TCPSite):
    """aiohttp's TCPSite with a bound on the TLS handshake (aiohttp does not pass one)."""

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


def http_site(runner: web.BaseRunner, host: str, port: int, backlog: int, tls: TlsConfig | None) -> web.TCPSite:
    """The HTTP listener's site: plaintext without [server.tls], else TLS (raises ConfigError)."""
    ctx = http_ssl_context(tls)
    if ctx is None:
        return web.TCPSite(runner, host, port, backlog=backlog)
    return _TlsSite(runner, host, port, backlog=backlog, ssl_context=ctx)


def http_cert_subject(request: web.BaseRequest) -> str | None:
    """The subject of the client certificate the HTTP listener verified on this request's
    connection, in the canonical RFC 4514 form; None without one."""
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    try:
        return _subject_of_der(der)
    except ValueError:
        return None
