"""Credentials: bearer tokens (compared by hash, in constant time) and verified client certificate
subjects (canonical RFC 4514, matched against [[clients]]; see api/tls.py)."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from .config import PERMISSIONS, Config
from .errors import ApiError


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    pools: frozenset[str] | None  # None: every pool
    permissions: frozenset[str]
    token: str | None = None  # kept to forward the caller's own credentials
    via_certificate: bool = False

    @property
    def identity(self) -> str:
        """Who this is, across kinds of credentials: a token named "CN=x" is not certificate CN=x."""
        return f"{'certificate' if self.via_certificate else 'token'}:{self.name}"

    def may(self, permission: str, pool: str) -> bool:
        return permission in self.permissions and (self.pools is None or pool in self.pools)

    def require(self, permission: str, pool: str) -> None:
        if not self.may(permission, pool):
            raise ApiError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self.name!r} lacks permission {permission!r} on pool {pool!r}",
            )


ANONYMOUS = Principal("anonymous", None, frozenset(PERMISSIONS))
MAX_TOKEN_CHARS = 4096
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def _scope(pools: list[str]) -> frozenset[str] | None:
    return None if "*" in pools else frozenset(pools)


class Authenticator:
    def __init__(self, config: Config):
        self._tokens: list[tuple[bytes, Principal]] = []
        for t in config.tokens:
            digest = t.sha256 or os.environ.get(t.env or "", "")
            if len(digest) != 64:
                raise ValueError(f"tokens: token {t.name!r}: variable {t.env!r} must hold a sha256 hex digest")
            self._tokens.append((bytes.fromhex(digest), Principal(t.name, _scope(t.pools), frozenset(t.permissions))))
        self._clients = {
            c.subject: Principal(c.subject, _scope(c.pools), frozenset(c.permissions), via_certificate=True)
            for c in config.clients
        }
        self.enabled = bool(self._tokens or self._clients)

    def authenticate(self, authorization: str | None, cert_subject: str | None) -> Principal:
        """The caller: by its bearer token if it sends one (a token wins over a certificate, and a
        wrong one is refused even with a good certificate), else by the subject of its verified
        client certificate (canonical RFC 4514), else UNAUTHENTICATED."""
        if not self.enabled:
            return ANONYMOUS
        if authorization:
            token = _bearer_token(authorization)
            digest = hashlib.sha256(token.encode()).digest()
            match = None
            for known, principal in self._tokens:  # every entry is compared: constant time
                if hmac.compare_digest(known, digest):
                    match = principal
            if match is None:
                raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "authorization: unknown token")
            return Principal(match.name, match.pools, match.permissions, token=token)
        if cert_subject:
            client = self._clients.get(cert_subject)
            if client is None:
                shown = cert_subject if len(cert_subject) <= 200 else cert_subject[:200] + "..."
                raise ApiError(
                    grpc.StatusCode.UNAUTHENTICATED, f"client certificate {shown!r}: subject not in [[clients]]"
                )
            return client
        wanted = "'authorization: Bearer <token>'" + (" or a client certificate" if self._clients else "")
        raise ApiError(grpc.StatusCode.UNAUTHENTICATED, f"credentials required: send {wanted}")


class RepeatedAuthorization(ApiError):
    """A call with more than one authorization value. HTTP answers it 400, a malformed request
    (RFC 6750's invalid_request), rather than 401: no credentials were looked at."""

    def __init__(self, count: int):
        super().__init__(
            grpc.StatusCode.UNAUTHENTICATED, f"authorization: given {count} times; send one 'Bearer <token>'"
        )

    @property
    def http_status(self) -> int:
        return 400


def one_authorization(values: Sequence[str]) -> str | None:
    """The call's authorization value (None without one). Two or more are refused rather than
    one of them picked: a proxy or client that adds its own beside the caller's must not decide
    who calls."""
    if len(values) > 1:
        raise RepeatedAuthorization(len(values))
    return values[0] if values else None


def _bearer_token(authorization: str) -> str:
    """The token of 'Bearer <token>' (scheme in any case, one or more spaces after it); a token
    must be 1 to MAX_TOKEN_CHARS visible ASCII characters. Never echoes the value."""
    scheme, _, rest = authorization.partition(" ")
    token = rest.lstrip(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "authorization: expected 'Bearer <token>'")
    if len(token) > MAX_TOKEN_CHARS:
        raise ApiError(
            grpc.StatusCode.UNAUTHENTICATED, f"authorization: token longer than {MAX_TOKEN_CHARS} characters"
        )
    if not _VISIBLE_ASCII.fullmatch(token):
        raise ApiError(
            grpc.StatusCode.UNAUTHENTICATED,
            "authorization: a token is visible ASCII only (no spaces, control or non-ASCII characters)",
        )
    return token
