"""TLS for both listeners and for channels to peers.

- [server.tls] (cert, key, client_ca) covers the gRPC and the HTTP listener alike. With
  client_ca both REQUIRE a client certificate signed by it: grpcio cannot ask for an
  optional one (require_client_auth=False never requests a certificate), so the HTTP
  listener requires one too rather than behave differently.
- A verified client certificate's subject, in canonical RFC 4514 form (config.subject_string),
  names a [[clients]] principal: grpc_cert_subject and http_cert_subject.
- [server.peer_tls] (ca, cert, key) becomes the channel credentials of this server's calls to
  other servers: peer_channel_credentials.
- check_tls_files: at start, every configured file must be readable and hold what its key
  says (a certificate, an unencrypted private key matching the certificate), else one line.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import os
import ssl
import stat
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from ..config import Config, ConfigError, PeerTlsConfig, TlsConfig, subject_string

log = logging.getLogger("cronoq.tls")

# A TLS handshake on the HTTP listener must finish within this (asyncio's default is 60 s;
# the listener's own header timeout starts only once the handshake is done).
HANDSHAKE_TIMEOUT_S = 10.0
MAX_PEM_BYTES = 1 << 20  # a certificate chain, a key or a CA bundle
_SUBJECT_CACHE = 1024  # distinct client certificates whose subject is kept parsed


# -- the files ----------------------------------------------------------------------


@dataclass(frozen=True)
class ServerFiles:
    """The PEM bytes of [server.tls], checked."""

    cert: bytes
    key: bytes
    client_ca: bytes | None


@dataclass(frozen=True)
class PeerFiles:
    """The PEM bytes of [server.peer_tls], checked; None where not configured."""

    ca: bytes | None
    cert: bytes | None
    key: bytes | None


def _where(source: str, key: str) -> str:
    return f"{source}: {key}"


def _read(path: str, key: str, source: str) -> bytes:
    try:
        # A device (/dev/zero is read forever), a FIFO (open() waits for a writer) or a directory:
        # refused before it is opened.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(f"{_where(source, key)}: cannot read {path!r}: not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as err:
        reason = (err.strerror or type(err).__name__).lower()
        raise ConfigError(f"{_where(source, key)}: cannot read {path!r}: {reason}") from None
    if len(data) > MAX_PEM_BYTES:
        raise ConfigError(f"{_where(source, key)}: {path!r} has more than {MAX_PEM_BYTES >> 20} MiB; not a PEM file")
    return data


def _certificates(data: bytes, path: str, key: str, source: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise ConfigError(f"{_where(source, key)}: {path!r} holds no PEM certificate")
    return certs


def _private_key(data: bytes, path: str, key: str, source: str) -> Any:
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise ConfigError(
            f"{_where(source, key)}: {path!r} is an encrypted private key (cronoq needs it unencrypted)"
        ) from None
    except UnsupportedAlgorithm:
        raise ConfigError(f"{_where(source, key)}: {path!r} holds a private key of an unsupported type") from None
    except ValueError:
        raise ConfigError(f"{_where(source, key)}: {path!r} holds no PEM private key") from None


def _public(obj: Any) -> bytes:
    return obj.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _pair(
    cert_path: str, key_path: str, cert_key: str, key_key: str, source: str, warn: bool = False
) -> tuple[bytes, bytes]:
    """A certificate (chain) and the private key of its first certificate; with warn, a log
    line if the certificate is not valid now (clients will refuse it, but it may be renewed)."""
    cert = _read(cert_path, cert_key, source)
    certs = _certificates(cert, cert_path, cert_key, source)
    key = _read(key_path, key_key, source)
    private = _private_key(key, key_path, key_key, source)
    if _public(private.public_key()) != _public(certs[0].public_key()):
        raise ConfigError(f"{_where(source, key_key)}: {key_path!r} is not the key of the certificate in {cert_path!r}")
    if warn:
        now, leaf = dt.datetime.now(dt.UTC), certs[0]
        if leaf.not_valid_after_utc < now:
            log.warning("%s: %r expired on %s", cert_key, cert_path, leaf.not_valid_after_utc.isoformat())
        elif leaf.not_valid_before_utc > now:
            log.warning("%s: %r is not valid before %s", cert_key, cert_path, leaf.not_valid_before_utc.isoformat())
    return cert, key


def server_files(tls: TlsConfig, source: str = "<config>", warn: bool = False) -> ServerFiles:
    """[server.tls]'s files, read and checked; ConfigError (one line naming the key) otherwise."""
    cert, key = _pair(tls.cert, tls.key, "server.tls.cert", "server.tls.key", source, warn)
    ca = None
    if tls.client_ca is not None:
        ca = _read(tls.client_ca, "server.tls.client_ca", source)
        _certificates(ca, tls.client_ca, "server.tls.client_ca", source)
    return ServerFiles(cert, key, ca)


def peer_files(peer: PeerTlsConfig | None, source: str = "<config>", warn: bool = False) -> PeerFiles:
    """[server.peer_tls]'s files, read and checked; all None when it is not configured."""
    if peer is None:
        return PeerFiles(None, None, None)
    ca = None
    if peer.ca is not None:
        ca = _read(peer.ca, "server.peer_tls.ca", source)
        _certificates(ca, peer.ca, "server.peer_tls.ca", source)
    cert = key = None
    if peer.cert is not None and peer.key is not None:
        cert, key = _pair(peer.cert, peer.key, "server.peer_tls.cert", "server.peer_tls.key", source, warn)
    elif peer.cert is not None or peer.key is not None:
        raise ConfigError(f"{source}: server.peer_tls: give both 'cert' and 'key', or neither")
    return PeerFiles(ca, cert, key)


def check_tls_files(config: Config, source: str = "<config>") -> None:
    """Refuses (ConfigError, one line) a [server.tls] or [server.peer_tls] file that is missing,
    unreadable, or does not hold what its key says."""
    if config.server.tls is not None:
        server_files(config.server.tls, source, warn=True)
    peer_files(config.server.peer_tls, source, warn=True)


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


# -- channels to peers --------------------------------------------------------------


def peer_channel_credentials(config: Config, source: str = "<config>") -> grpc.ChannelCredentials:
    """Credentials for this server's gRPC channels to other servers over https://: the roots of
    server.peer_tls.ca (the system's without it), and the client certificate of
    server.peer_tls.cert/key if given (needed when the peers set server.tls.client_ca).
    Raises ConfigError, one line naming the key, for a missing or unreadable file."""
    files = peer_files(config.server.peer_tls, source)
    return grpc.ssl_channel_credentials(root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert)
