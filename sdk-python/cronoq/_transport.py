"""Endpoints, channels, credentials and transport retries shared by Client and Worker."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, stop_never, wait_exponential_jitter

from .errors import CronoqError, InvalidArgument, RedirectRefused, Unavailable, from_grpc_error

log = logging.getLogger("cronoq")
T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class RetryConfig:
    """Transport retries: UNAVAILABLE is retried with exponential backoff and jitter."""

    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    # None: retry for as long as the caller waits (workers); seconds otherwise.
    max_elapsed: float | None = 30.0


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings for https:// endpoints; all paths are PEM files."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        parts = urlsplit(text if "://" in text else f"http://{text}")
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise InvalidArgument(f"endpoint: {text!r} is not http://host:port or https://host:port")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise InvalidArgument(f"endpoint: {text!r} has a bad port") from None
        return cls(parts.scheme, parts.hostname, port)

    @property
    def secure(self) -> bool:
        return self.scheme == "https"

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return f"{self.scheme}://{self.target}"


def check_redirect(current: Endpoint, target: Endpoint, token: str | None, insecure_redirect_http: bool) -> None:
    """The connection rules of SPEC.md §10 for following a shard redirect."""
    if current.secure and not target.secure:
        raise RedirectRefused(f"redirect from {current} to {target} refused: never follow https:// to http://")
    if token and not target.secure and not target.is_loopback and not insecure_redirect_http:
        raise RedirectRefused(
            f"redirect to {target} refused: the token would go over plain http:// to a non-loopback host "
            "(set insecure_redirect_http on trusted networks only)"
        )


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def open_channel(endpoint: Endpoint, tls: TlsConfig | None) -> grpc.aio.Channel:
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 0),
    ]
    if not endpoint.secure:
        return grpc.aio.insecure_channel(endpoint.target, options=options)
    tls = tls or TlsConfig()
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca), private_key=_read(tls.key), certificate_chain=_read(tls.cert)
    )
    return grpc.aio.secure_channel(endpoint.target, creds, options=options)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _is_unavailable(err: BaseException) -> bool:
    return isinstance(err, Unavailable)


async def call_once(call: Callable[[], Awaitable[T]]) -> T:
    """Runs call once, translating gRPC errors to the SDK tree."""
    try:
        return await call()
    except grpc.aio.AioRpcError as err:
        raise from_grpc_error(err) from None


async def with_retries(call: Callable[[], Awaitable[T]], retry: RetryConfig, what: str) -> T:
    """Runs call, translating gRPC errors to the SDK tree and retrying UNAVAILABLE."""
    try:
        return await call_once(call)  # the fast path: no retry machinery per call
    except Unavailable as err:
        if retry.max_elapsed is not None and retry.max_elapsed <= 0:
            raise
        log.debug("%s: %s; retrying", what, err)
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(_is_unavailable),
        wait=wait_exponential_jitter(
            multiplier=retry.initial_backoff, max=retry.max_backoff, jitter=retry.initial_backoff
        ),
        stop=stop_never if retry.max_elapsed is None else stop_after_delay(retry.max_elapsed),
        reraise=True,
    ):
        with attempt:
            return await call_once(call)
    raise CronoqError(f"{what}: gave up")  # unreachable: reraise=True
