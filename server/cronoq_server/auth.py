"""Credentials: bearer tokens (compared by hash, in constant time) and mTLS subjects."""

from __future__ import annotations

import hashlib
import hmac
import os
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

    def may(self, permission: str, pool: str) -> bool:
        return permission in self.permissions and (self.pools is None or pool in self.pools)

    def require(self, permission: str, pool: str) -> None:
        if not self.may(permission, pool):
            raise ApiError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self.name!r} lacks permission {permission!r} on pool {pool!r}",
            )


ANONYMOUS = Principal("anonymous", None, frozenset(PERMISSIONS))


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
        if not self.enabled:
            return ANONYMOUS
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "authorization: expected 'Bearer <token>'")
            digest = hashlib.sha256(token.encode()).digest()
            match = None
            for known, principal in self._tokens:  # every entry is compared: constant time
                if hmac.compare_digest(known, digest):
                    match = principal
            if match is None:
                raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "authorization: unknown token")
            return Principal(match.name, match.pools, match.permissions, token=token)
        if cert_subject and cert_subject in self._clients:
            return self._clients[cert_subject]
        raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "credentials required: send 'authorization: Bearer <token>'")
