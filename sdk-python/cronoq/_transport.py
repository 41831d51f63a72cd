"""Endpoints, channels, credentials and transport retries shared by Client and Worker."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, stop_never, wait_exponential_jitter

from .errors import Cancelled, CronoqError, InvalidArgument, RedirectRefused, Unavailable, from_grpc_error

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
    """The connection rules for following a shard redirect (or a standby's leader hint):
    never from https:// to http://, and a bearer token goes over plain http:// only to a
    loopback host unless insecure_redirect_http is set."""
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
    # CANCELLED that the caller did not ask for comes from a server that closed while the call
    # waited for a handler: as safe to retry as UNAVAILABLE (submissions carry a request_id).
    return isinstance(err, (Unavailable, Cancelled))


async def call_once(call: Callable[[], Awaitable[T]]) -> T:
    """Runs call once, translating gRPC errors to the SDK tree."""
    try:
        return await call()
    except grpc.aio.AioRpcError as err:
        raise from_grpc_error(err) from None


async def with_retries(
    call: Callable[[], Awaitable[T]],
    retry: RetryConfig,
    what: str,
    on_unavailable: Callable[[CronoqError], None] | None = None,
) -> T:
    """Runs call, translating gRPC errors to the SDK tree and retrying UNAVAILABLE.

    on_unavailable sees each UNAVAILABLE before the retry (to switch to the leader).
    """
    try:
        return await call_once(call)  # the fast path: no retry machinery per call
    except (Unavailable, Cancelled) as err:
        if retry.max_elapsed is not None and retry.max_elapsed <= 0:
            raise
        log.debug("%s: %s; retrying", what, err)
        if on_unavailable:
            on_unavailable(err)

    def before_sleep(state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if on_unavailable and isinstance(exc, (Unavailable, Cancelled)):
            on_unavailable(exc)

    async for attempt in AsyncRetrying(
        retry=retry_if_exception(_is_unavailable),
        wait=wait_exponential_jitter(
            multiplier=retry.initial_backoff, max=retry.max_backoff, jitter=retry.initial_backoff
        ),
        stop=stop_never if retry.max_elapsed is None else stop_after_delay(retry.max_elapsed),
        before_sleep=before_sleep,
        reraise=True,
    ):
        with attempt:
            return await call_once(call)
    raise CronoqError(f"{what}: gave up")  # unreachable: reraise=True


def parse_endpoints(text: str) -> list[Endpoint]:
    """One endpoint, or several separated by commas (servers of one deployment)."""
    endpoints = [Endpoint.parse(part.strip()) for part in text.split(",") if part.strip()]
    if not endpoints:
        raise InvalidArgument(f"endpoint: {text!r} names no endpoint")
    return endpoints


class Connection:
    """A channel to one server of the configured endpoints, moved on UNAVAILABLE.

    A standby's UNAVAILABLE names the leader (cronoq-leader): the connection goes there,
    within the redirect rules. Otherwise it tries the next configured endpoint.
    """

    def __init__(
        self,
        endpoints: str,
        stub_factory: Callable[[grpc.aio.Channel], Any],
        *,
        token: str | None,
        tls: TlsConfig | None,
        insecure_redirect_http: bool = False,
    ):
        self.configured = parse_endpoints(endpoints)
        self.current = self.configured[0]
        self._next = 0
        self._factory = stub_factory
        self._token = token
        self._tls = tls
        self._insecure_redirect_http = insecure_redirect_http
        self._channel: grpc.aio.Channel | None = None
        self._retired: list[grpc.aio.Channel] = []
        self._stub: Any = None
        self.metadata = call_metadata(token)

    @property
    def stub(self) -> Any:
        if self._stub is None:  # channels belong to the running loop: create them lazily
            self._channel = open_channel(self.current, self._tls)
            self._stub = self._factory(self._channel)
        return self._stub

    def switch(self, endpoint: Endpoint) -> None:
        if endpoint == self.current and self._stub is not None:
            return
        if self._channel is not None:
            # Closed in close(): a channel left open keeps grpc.aio bound to this event loop.
            self._retired.append(self._channel)
        self.current, self._channel, self._stub = endpoint, None, None

    def follow(self, target: str) -> None:
        """Moves to target (a redirect or the leader) if the connection rules allow it."""
        dest = Endpoint.parse(target)
        check_redirect(self.current, dest, self._token, self._insecure_redirect_http)
        self.switch(dest)

    def on_unavailable(self, err: CronoqError) -> None:
        if err.leader:
            try:
                if Endpoint.parse(err.leader) != self.current:
                    self.follow(err.leader)
                    return
            except CronoqError as refused:
                log.warning("not following leader %s: %s", err.leader, refused)
        if len(self.configured) > 1 or self.current != self.configured[0]:
            self._next = (self._next + 1) % len(self.configured)
            self.switch(self.configured[self._next])

    def rpc(self, method: str) -> Any:
        return getattr(self.stub, method)

    async def call(self, method: str, request: Any, timeout: float, retry: RetryConfig) -> Any:
        return await with_retries(
            lambda: self.rpc(method)(request, metadata=self.metadata, timeout=timeout),
            retry,
            method,
            self.on_unavailable,
        )

    async def close(self) -> None:
        channels = [*self._retired, *([self._channel] if self._channel is not None else [])]
        self._retired, self._channel, self._stub = [], None, None
        for channel in channels:
            await channel.close(None)
