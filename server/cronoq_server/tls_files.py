"""The TLS files of the configuration, read and checked: [server.tls] (the listeners' certificate,
key and client CA, used by api/tls.py) and [server.peer_tls] (the certificates of this server's
channels to other servers, used by sharding/peers.py).

check_tls_files: at start, every configured file must be readable and hold what its key says
(a certificate, an unencrypted private key matching the certificate), else one line.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import stat
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from .config import Config, ConfigError, PeerTlsConfig, TlsConfig

log = logging.getLogger("cronoq.tls")

MAX_PEM_BYTES = 1 << 20  # a certificate chain, a key or a CA bundle


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
