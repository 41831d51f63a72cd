"""Endpoints, channels, credentials and transport retries shared by Client and Worker."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import logging
import random
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from .errors import (
    Cancelled,
    CronoqError,
    InvalidArgument,
    RedirectRefused,
    TlsError,
    Unavailable,
    from_grpc_error,
    tls_failure_reason,
    tls_verify_reason,
)

log = logging.getLogger("cronoq")
T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class RetryConfig:
    """Transport retries: UNAVAILABLE is retried after initial_backoff doubled per failure in
    a row, capped at max_backoff, with equal jitter (backoff_delay); a worker's registration
    and Work stream too, for as long as it runs."""

    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    # None: retry for as long as the caller waits (workers); seconds otherwise.
    max_elapsed: float | None = 30.0


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings for https:// endpoints; all paths are PEM files.

    ca: the CA bundle the server's certificate must chain to (without it, the default roots).
    cert and key: a client certificate and its key, for servers with server.tls.client_ca.
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgument("tls: give both cert and key (a client certificate and its key), or neither")


@dataclass(frozen=True)
class KeepaliveConfig:
    """HTTP/2 keepalive of every channel: a connection quiet for `time` seconds is pinged,
    with or without a call open, and closed when the ping is not answered within `timeout`
    seconds. A server that vanished without closing the connection (a crash, a partition) is
    then noticed in time + timeout seconds, not the kernel's TCP timeout, and the call fails
    UNAVAILABLE like any lost connection: retried, on the next endpoint or the leader named.

    A cronoq server sends GOAWAY (too_many_pings) to a client that pings more often than every
    10 s: keep `time` at 10 s or more against it.
    """

    time: float = 20.0
    timeout: float = 10.0


# A probe that tells why a TLS connection failed gives up after this (per step).
PROBE_TIMEOUT_S = 3.0


# The endpoint grammar (the same in every SDK): [scheme "://"] host [":" port] ["/"].
_ENDPOINT = re.compile(r"(?:(?P<scheme>[A-Za-z]+)://)?(?P<host>\[[^\]]*\]|[^:/\[\]]*)(?::(?P<port>[^/]*))?/?")
_LABEL = re.compile(r"[A-Za-z0-9_-]{1,63}")
_DEC = re.compile(r"0|[1-9][0-9]{0,2}")
_PORT = re.compile(r"[1-9][0-9]{0,4}")
# What an address parser reads as a number: decimal, or hex after 0x.
_NUMBER = re.compile(r"[0-9]+|0[xX][0-9A-Fa-f]*")


def _host(text: str) -> str | None:
    """The host (a name or an IPv6 address in lower case), or None
    when text is not one: a name, dotted-decimal IPv4 with four parts, or [IPv6] without a zone."""
    if text.startswith("["):
        inner = text[1:-1]
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            return None
        return None if "%" in inner else inner.lower()  # a zone names this host's interface
    labels = text.split(".")
    if _NUMBER.fullmatch(labels[-1]):  # ends in a number: dotted decimal, nothing looser
        if len(labels) != 4 or not all(_DEC.fullmatch(part) and int(part) <= 255 for part in labels):
            return None
        return text
    if not all(_LABEL.fullmatch(label) for label in labels):
        return None
    return text.lower()


@dataclass(frozen=True)
class Endpoint:
    """One server: http://host:port or https://host:port."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Reads an endpoint by the one grammar every SDK shares, or raises InvalidArgument
        naming it. Spaces and tabs around it are ignored; nothing is repaired: user info, a
        path, a query, a fragment, percent-encoding, an IPv4 form other than four dotted
        decimals, a port with a leading zero are refused, whatever a URL parser would read."""
        bad = InvalidArgument(
            f"endpoint: {text!r} is not an endpoint (http://host:port or https://host:port; "
            "IPv4 as four dotted decimals, IPv6 in brackets)"
        )
        m = _ENDPOINT.fullmatch(text.strip(" \t"))
        if m is None:
            raise bad
        scheme = (m["scheme"] or "http").lower()
        host = _host(m["host"])
        if scheme not in ("http", "https") or host is None:
            raise bad
        if m["port"] is None:
            port = 443 if scheme == "https" else 80
        elif _PORT.fullmatch(m["port"]) and int(m["port"]) <= 65535:
            port = int(m["port"])
        else:
            raise bad
        return cls(scheme, host, port)

    @property
    def secure(self) -> bool:
        return self.scheme == "https"

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        """localhost, 127.0.0.0/8 or ::1, and nothing else (not ::ffff:127.0.0.1)."""
        if self.host == "localhost":
            return True
        try:
            address = ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return address.is_loopback and (address.version == 4 or address == ipaddress.IPv6Address("::1"))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.target}"


def parse_target(target: str) -> Endpoint:
    """A redirect's or a leader hint's endpoint; one that is not an endpoint is a refused redirect."""
    try:
        return Endpoint.parse(target)
    except InvalidArgument:
        raise RedirectRefused(
            f"redirect to {target!r} refused: not an endpoint (http://host:port or https://host:port)"
        ) from None


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


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise InvalidArgument(f"tls.{what}: cannot read {path!r}: {(err.strerror or str(err)).lower()}") from None


class TlsFiles:
    """A TlsConfig's files, read and checked once: the gRPC channel credentials, and an ssl
    context with the same CA and client certificate for probing a failed handshake."""

    def __init__(self, tls: TlsConfig | None):
        self.config = tls or TlsConfig()
        ca, cert, key = _read(self.config.ca, "ca"), _read(self.config.cert, "cert"), _read(self.config.key, "key")
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.context.set_alpn_protocols(["h2"])
        try:
            if self.config.ca is not None:
                self.context.load_verify_locations(cafile=self.config.ca)
            else:
                self.context.load_default_certs()
        except (ssl.SSLError, ValueError) as err:
            raise InvalidArgument(f"tls.ca: {self.config.ca!r} holds no PEM certificate ({err})") from None
        if self.config.cert is not None and self.config.key is not None:
            try:
                self.context.load_cert_chain(self.config.cert, self.config.key)
            except (ssl.SSLError, OSError, ValueError) as err:
                raise InvalidArgument(
                    f"tls.cert: {self.config.cert!r} with tls.key {self.config.key!r} is not a PEM certificate "
                    f"and its unencrypted key ({err})"
                ) from None
        self.credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def open_channel(
    endpoint: Endpoint, tls: TlsConfig | TlsFiles | None, keepalive: KeepaliveConfig = KeepaliveConfig()
) -> grpc.aio.Channel:
    from . import __version__  # the installed distribution's

    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 0),
        ("grpc.keepalive_time_ms", int(keepalive.time * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive.timeout * 1000)),
        # gRPC core waits for a ping's ack this long (a minute by default), keepalive_timeout_ms or not.
        ("grpc.http2.ping_timeout_ms", int(keepalive.timeout * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),  # a worker waiting for tasks has a stream; a client may not
        ("grpc.http2.max_pings_without_data", 0),  # else gRPC stops pinging after 2 pings on a quiet connection
        ("grpc.primary_user_agent", f"cronoq-python/{__version__}"),  # first; gRPC's own name follows
    ]
    if not endpoint.secure:
        return grpc.aio.insecure_channel(endpoint.target, options=options)
    files = tls if isinstance(tls, TlsFiles) else TlsFiles(tls)
    return grpc.aio.secure_channel(endpoint.target, files.credentials, options=options)


# gRPC's words for a connection the server closed; over TLS, also how a refused client
# certificate shows (the server closes the connection right after the handshake).
_CLOSED = ("Socket closed", "Connection reset", "End of TCP stream", "connection closed")


def _client_cert_reason(tls: TlsConfig) -> str:
    """Why a server that closes the connection after the handshake refused this client."""
    if tls.cert is None:
        return "the server requires a client certificate (none given: set cert and key; CRONOQ_CERT, CRONOQ_KEY)"
    try:
        from cryptography import x509

        with open(tls.cert, "rb") as f:
            leaf = x509.load_pem_x509_certificate(f.read())
        now = dt.datetime.now(dt.UTC)
        if leaf.not_valid_after_utc < now:
            return f"the client certificate {tls.cert!r} has expired (on {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC)"
        if leaf.not_valid_before_utc > now:
            return f"the client certificate {tls.cert!r} is not yet valid"
    except Exception:  # cryptography absent, or a file it cannot read: say what is known
        pass
    return (
        f"the server refused the client certificate {tls.cert!r} "
        "(not signed by a CA in its server.tls.client_ca, or expired)"
    )


_ALERTS = (
    ("CERTIFICATE_REQUIRED", None),  # None: the client certificate's own reason
    ("CERTIFICATE_EXPIRED", None),
    ("UNKNOWN_CA", None),
    ("BAD_CERTIFICATE", None),
    ("HANDSHAKE_FAILURE", "the server refused the handshake (no common protocol or cipher)"),
    ("WRONG_VERSION_NUMBER", "the server does not speak TLS on this port (wrong version number): "
     "is it an http:// endpoint?"),
)  # fmt: skip


def _alert_reason(err: ssl.SSLError, tls: TlsConfig) -> str:
    """The reason for a TLS alert from the server, or for a connection it closed (no alert)."""
    text = f"{err.reason or ''} {err}".upper()
    for marker, reason in _ALERTS:
        if marker in text:
            return reason or _client_cert_reason(tls)
    if isinstance(err, (ssl.SSLEOFError, ssl.SSLZeroReturnError)) or "EOF" in text:
        return _client_cert_reason(tls)
    return " ".join(str(err).split())


# The HTTP/2 client connection preface and an empty SETTINGS frame.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def probe_tls(endpoint: Endpoint, files: TlsFiles, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why a TLS connection to endpoint fails (blocking), or None if it does not, or if the
    server cannot be reached at all (that is not a TLS problem)."""
    try:
        raw = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
    except OSError:
        return None
    with raw:
        try:
            conn = files.context.wrap_socket(raw, server_hostname=endpoint.host)
        except ssl.SSLCertVerificationError as err:
            return tls_verify_reason(err.verify_message or str(err))
        except ssl.SSLError as err:
            return _alert_reason(err, files.config)
        except TimeoutError:
            return None
        except OSError:
            return _client_cert_reason(files.config)  # closed during the handshake
        with conn:
            # TLS 1.3: the server checks the client's certificate after the client's side of the
            # handshake is done; a server that refuses it closes the connection (with an alert,
            # or none). One that accepts it answers the HTTP/2 preface with its SETTINGS frame.
            try:
                conn.sendall(_H2_PREFACE)
                return None if conn.recv(1) else _client_cert_reason(files.config)
            except ssl.SSLError as err:
                return _alert_reason(err, files.config)
            except TimeoutError:
                return None
            except OSError:
                return _client_cert_reason(files.config)


def probe_speaks_tls(endpoint: Endpoint, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TLS handshake (unverified) with endpoint completes: a TLS server on a port
    the client was told is plaintext (http://)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=endpoint.host):
                return True
    except ssl.SSLError as err:  # a TLS alert from the server (e.g. "certificate required") is TLS too
        return "ALERT" in f"{err.reason or ''}".upper()
    except OSError:
        return False


async def diagnose_tls(endpoint: Endpoint, files: TlsFiles | None, details: str) -> TlsError | None:
    """The TlsError a gRPC UNAVAILABLE (its details) stands for, or None if it is no TLS failure."""
    if endpoint.secure:
        reason = tls_failure_reason(details)
        if reason is None and files is not None and any(m in details for m in _CLOSED):
            reason = await asyncio.to_thread(probe_tls, endpoint, files)
        if reason is None:
            return None
        if reason.startswith("hostname mismatch"):
            reason = f"hostname mismatch: the server's certificate is not valid for {endpoint.host!r}"
        return TlsError(f"{endpoint}: TLS handshake failed: {reason}")
    if any(m in details for m in _CLOSED) and await asyncio.to_thread(probe_speaks_tls, endpoint):
        secure = Endpoint("https", endpoint.host, endpoint.port)
        return TlsError(f"{endpoint}: the server speaks TLS on this port: use {secure}")
    return None


def backoff_delay(retry: RetryConfig, failures: int) -> float:
    """Seconds to wait after `failures` earlier failures in a row (0 for the first): the step,
    initial_backoff doubled per failure and capped at max_backoff, with equal jitter: half the
    step fixed, the other half uniformly random. Clients that failed together spread out, and
    none retries sooner than half the step."""
    step = min(retry.max_backoff, retry.initial_backoff * 2 ** min(failures, 32))
    return step / 2 + random.uniform(0, step / 2)


# A stream that delivered a message, or stayed open this long, was healthy: its end starts a
# new row of failures (the backoff from initial_backoff again; max_elapsed bounds a row).
HEALTHY_STREAM_S = 5.0


class Backoff:
    """A row of failed attempts at one thing (a registration, a Work stream): the delay before
    the next attempt (backoff_delay), and one log line when the row starts and one when it ends,
    not one per attempt."""

    def __init__(
        self, retry: RetryConfig, what: str, logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = log
    ):
        self.retry, self.what, self.log = retry, what, logger
        self.failures = 0

    def failed(self, err: BaseException) -> float:
        """Counts a failure and returns how long to wait before the next attempt."""
        delay = backoff_delay(self.retry, self.failures)
        if self.failures == 0:
            self.log.warning("%s failed (%s); retrying with backoff up to %gs", self.what, err, self.retry.max_backoff)
        else:
            self.log.debug("%s failed again (%s); retrying in %.2fs", self.what, err, delay)
        self.failures += 1
        return delay

    def succeeded(self) -> None:
        """The attempt worked (a stream: it was healthy): the next failure starts a new row."""
        if self.failures:
            self.log.info("%s works again after %d failed attempt(s)", self.what, self.failures)
        self.failures = 0


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


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
    """Runs call, translating gRPC errors to the SDK tree and retrying UNAVAILABLE (and
    CANCELLED the caller did not ask for) after backoff_delay, for at most retry.max_elapsed.

    on_unavailable sees each UNAVAILABLE before the retry (to switch to the leader).
    """
    started = time.monotonic()
    failures = 0
    while True:
        try:
            return await call_once(call)
        # CANCELLED that the caller did not ask for comes from a server that closed while the call
        # waited for a handler: as safe to retry as UNAVAILABLE (submissions carry a request_id).
        except (Unavailable, Cancelled) as err:
            if retry.max_elapsed is not None and time.monotonic() - started >= retry.max_elapsed:
                raise
            if on_unavailable:
                on_unavailable(err)
            delay = backoff_delay(retry, failures)
            failures += 1
            log.debug("%s: %s; retrying in %.2fs", what, err, delay)
            await asyncio.sleep(delay)


def parse_endpoints(text: str) -> list[Endpoint]:
    """One endpoint, or several separated by commas (servers of one deployment)."""
    endpoints = [Endpoint.parse(part) for part in text.split(",") if part.strip(" \t")]
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
        keepalive: KeepaliveConfig = KeepaliveConfig(),
    ):
        self.configured = parse_endpoints(endpoints)
        self.current = self.configured[0]
        self._next = 0
        self._factory = stub_factory
        self._token = token
        self._tls = tls
        self._tls_files = TlsFiles(tls) if tls is not None or any(e.secure for e in self.configured) else None
        self._insecure_redirect_http = insecure_redirect_http
        self._keepalive = keepalive
        self._channel: grpc.aio.Channel | None = None
        self._retired: list[grpc.aio.Channel] = []
        self._stub: Any = None
        self.metadata = call_metadata(token)

    @property
    def stub(self) -> Any:
        if self._stub is None:  # channels belong to the running loop: create them lazily
            if self.current.secure and self._tls_files is None:  # a redirect to https://
                self._tls_files = TlsFiles(self._tls)
            self._channel = open_channel(self.current, self._tls_files, self._keepalive)
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
        dest = parse_target(target)
        check_redirect(self.current, dest, self._token, self._insecure_redirect_http)
        self.switch(dest)

    def on_unavailable(self, err: CronoqError) -> None:
        if err.leader:
            try:
                if parse_target(err.leader) != self.current:
                    self.follow(err.leader)
                    return
            except CronoqError as refused:
                log.warning("not following leader %s: %s", err.leader, refused)
        if len(self.configured) > 1 or self.current != self.configured[0]:
            self._next = (self._next + 1) % len(self.configured)
            self.switch(self.configured[self._next])

    def rpc(self, method: str) -> Any:
        """The stub's method; a unary one raises TlsError (not retried) for a failed handshake."""
        call = getattr(self.stub, method)
        if not isinstance(call, grpc.aio.UnaryUnaryMultiCallable):
            return call
        endpoint, files = self.current, self._tls_files

        async def unary(request: Any, **kwargs: Any) -> Any:
            try:
                return await call(request, **kwargs)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    failure = await diagnose_tls(endpoint, files, err.details() or "")
                    if failure is not None:
                        raise failure from None
                raise

        return unary

    async def diagnose(self, err: CronoqError) -> TlsError | None:
        """The TlsError an UNAVAILABLE from the current endpoint stands for (a stream's; unary
        calls are diagnosed by rpc), or None when it is no TLS failure."""
        return await diagnose_tls(self.current, self._tls_files, err.message)

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
