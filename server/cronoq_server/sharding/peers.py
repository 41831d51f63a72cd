"""Calls to other shards: the pooled channels to their endpoints (with [server.peer_tls]), the
leader each endpoint last named, when a call must not be sent at all, what a forwarded call
carries, and how a peer's refusal becomes this server's answer."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import grpc
from google.protobuf.message import Message

from cronoq.status import decode_details

from ..auth import Principal
from ..config import Config, ShardConfig
from ..core.limits import largest_request
from ..core.tasks import wait_ms
from ..errors import ApiError
from ..registry import Rpc
from ..tls_files import peer_files
from ..tracing import trace_metadata

FORWARDED_HEADER = "cronoq-forwarded"
UNAVAILABLE_HEADER = "cronoq-unavailable-shards"
# A shard that went away is retried at least this often by its channel, so it is used again
# within about this long of coming back (gRPC's default backoff grows to 120 s).
PEER_RECONNECT_MAX_MS = 2_000
# Peer answers that mean "this shard cannot answer now": it is named in unavailable_shards.
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_missing(err: ApiError) -> bool:
    """Whether a shard's refusal means it could not be asked (unreachable, no leader, too slow,
    not serving the call, or not to be sent this caller's call): it is then named in
    unavailable_shards."""
    return err.code in _UNAVAILABLE or err.reason in ("NOT_FORWARDED", "SHARD_UNAVAILABLE")


def trailer(trailers: Iterable[tuple[str, Any]], name: str) -> str | None:
    for key, value in trailers:
        if key == name:
            return value if isinstance(value, str) else value.decode()
    return None


def shard_refusal(shard: ShardConfig, why: str, reason: str) -> ApiError:
    return ApiError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"served by shard {shard.name!r} at {shard.endpoint}: {why}; call that shard there",
        {"cronoq-shard": shard.name, "cronoq-shard-endpoint": shard.endpoint},
        reason=reason,
    )


def peer_trailers(err: grpc.aio.AioRpcError) -> tuple[tuple[str, Any], ...]:
    raw: Any = err.trailing_metadata() or ()  # grpc-stubs type it as one entry
    return tuple((str(k), v) for k, v in raw)


def unreachable(shard: ShardConfig, endpoint: str, why: str) -> ApiError:
    """UNAVAILABLE naming a shard that gave no answer (cronoq-unavailable-shards)."""
    return ApiError(
        grpc.StatusCode.UNAVAILABLE,
        f"shard {shard.name!r} cannot be reached at {endpoint}: {why}",
        {UNAVAILABLE_HEADER: shard.name},
        reason="SHARD_UNAVAILABLE",
        retry_delay=1.0,
    )


def forward_metadata(caller: Principal) -> list[tuple[str, str]]:
    """What a call forwarded for `caller` carries: the mark, the caller's own token, and the
    context of this server's span of the call (when tracing)."""
    metadata = [(FORWARDED_HEADER, "1")]
    if caller.token is not None:
        metadata.append(("authorization", f"Bearer {caller.token}"))
    return metadata + trace_metadata()


def peer_error(shard: ShardConfig, endpoint: str, err: grpc.aio.AioRpcError, allowed: float | None = None) -> ApiError:
    """The peer's refusal as this server's answer; a call that got no answer names the shard
    (`allowed`: the seconds it was given)."""
    code = err.code()
    trailers = peer_trailers(err)
    details = decode_details(trailers)
    if details is None:  # the peer did not answer: gRPC's own status
        if code == grpc.StatusCode.UNAVAILABLE:
            return unreachable(shard, endpoint, err.details() or "")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            within = "in time" if allowed is None else f"within {allowed:g}s"
            return ApiError(
                code,
                f"shard {shard.name!r} at {endpoint} did not answer {within} (server.forward_timeout); "
                "a call that changes something may or may not have been done there",
                {UNAVAILABLE_HEADER: shard.name},
                reason="SHARD_UNAVAILABLE",
            )
    if details is None or code == grpc.StatusCode.UNIMPLEMENTED:
        # No cronoq answer (gRPC's own status), or a call the peer's build does not serve (an
        # older or a foreign server): the shard cannot answer it, and is named like one down.
        return ApiError(
            code,
            f"shard {shard.name!r} at {endpoint} cannot answer this call: {code.name}: {err.details()}",
            {UNAVAILABLE_HEADER: shard.name},
            reason="SHARD_UNAVAILABLE",
        )
    metadata = {
        key: value
        for key, value in trailers
        if key.startswith("cronoq-") and key != "cronoq-leader" and isinstance(value, str)
    }
    return ApiError(code, err.details() or "", metadata, reason=details.reason or None, retry_delay=details.retry_delay)


class PeerChannels:
    """This server's gRPC channels to other shards' endpoints: one pooled channel an endpoint,
    [server.peer_tls] for https://, and the rules for when not to send a call at all."""

    def __init__(self, config: Config):
        self._config = config
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._leaders: dict[str, str] = {}  # a shard's endpoint -> the leader it last named
        self._credentials: grpc.ChannelCredentials | None = None

    def refusal(self, endpoint: str, caller: Principal, previous: str | None = None) -> str | None:
        """Why a call of `caller` must not be sent to `endpoint` (None: it may)."""
        if caller.via_certificate:
            return "the caller authenticated with a client certificate, which cannot be forwarded"
        url = urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.netloc:  # e.g. a server.advertise without a scheme
            return f"{endpoint!r} is not an http:// or https:// address"
        if previous is not None and urlsplit(previous).scheme == "https" and url.scheme != "https":
            return f"{endpoint} is plain http:// and the shard's endpoint is https://"
        insecure_ok = self._config.server.insecure_peer_http
        if url.scheme == "http" and not is_loopback_host(url.hostname or "") and not insecure_ok:
            return (
                "its endpoint is plain http:// on another host, and tokens are not sent unencrypted "
                "(server.insecure_peer_http = false)"
            )
        return None

    def leader_of(self, endpoint: str, caller: Principal) -> str:
        """Where to send a call for the shard at `endpoint`: the leader it last named, if any
        (and if these rules allow it for this caller), else the endpoint itself."""
        leader = self._leaders.get(endpoint)
        if leader is None or self.refusal(leader, caller, previous=endpoint):
            return endpoint
        return leader

    def learn_leader(self, endpoint: str, leader: str | None) -> None:
        """The leader the shard at `endpoint` named (None: forget it, it could not be reached)."""
        if leader is None:
            self._leaders.pop(endpoint, None)
        else:
            self._leaders[endpoint] = leader

    def leader_to_follow(self, err: grpc.aio.AioRpcError, endpoint: str, caller: Principal) -> str | None:
        """The leader to try once more after a peer's refusal, when `endpoint` is a standby
        naming one these rules allow (else None)."""
        leader = trailer(peer_trailers(err), "cronoq-leader")
        if (
            err.code() == grpc.StatusCode.UNAVAILABLE
            and leader
            and leader != endpoint
            and not self.refusal(leader, caller, previous=endpoint)
        ):
            return leader
        return None

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            url = urlsplit(endpoint)
            options = [
                # As this server's own receive limit: a peer's answer to a forwarded call fits it.
                ("grpc.max_receive_message_length", largest_request(self._config.limits)),
                ("grpc.max_reconnect_backoff_ms", PEER_RECONNECT_MAX_MS),
                ("grpc.keepalive_time_ms", 60_000),
            ]
            if url.scheme == "https":
                if self._credentials is None:
                    self._credentials = peer_channel_credentials(self._config)
                channel = grpc.aio.secure_channel(url.netloc, self._credentials, options)
            else:
                channel = grpc.aio.insecure_channel(url.netloc, options)
            self._channels[endpoint] = channel
        return channel

    def timeout(self, rpc: Rpc, request: Message, caller_timeout: float | None) -> float:
        """How long a call at a peer may take: server.forward_timeout (a WaitTask: plus the wait it
        asks for), or the caller's time left when that is shorter. A shard that hangs (stopped, or
        a peer that accepts and never answers) costs no caller more, whatever deadline it has."""
        allowed = self._config.server.forward_timeout
        if rpc.name == "WaitTask":
            allowed += wait_ms(request.timeout_ms) / 1000  # type: ignore[attr-defined]
        return allowed if caller_timeout is None else min(caller_timeout, allowed)

    async def unary(
        self, endpoint: str, rpc: Rpc, request: Message, metadata: list[tuple[str, str]], timeout: float | None
    ) -> Message:
        method = self.channel(endpoint).unary_unary(
            rpc.path, request_serializer=rpc.request.SerializeToString, response_deserializer=rpc.response.FromString
        )
        response: Message = await method(request, metadata=metadata, timeout=timeout)
        return response

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close(None) for c in channels), return_exceptions=True)

    def stream(
        self, endpoint: str, rpc: Rpc, request: Message, metadata: list[tuple[str, str]], timeout: float | None
    ) -> grpc.aio.UnaryStreamCall:  # type: ignore[type-arg]
        """A server-streaming call at `endpoint`, started; the caller reads it and cancels it."""
        method = self.channel(endpoint).unary_stream(
            rpc.path, request_serializer=rpc.request.SerializeToString, response_deserializer=rpc.response.FromString
        )
        return method(request, metadata=metadata, timeout=timeout)


def peer_channel_credentials(config: Config, source: str = "<config>") -> grpc.ChannelCredentials:
    """Credentials for this server's gRPC channels to other servers over https://: the roots of
    server.peer_tls.ca (the system's without it), and the client certificate of
    server.peer_tls.cert/key if given (needed when the peers set server.tls.client_ca).
    Raises ConfigError, one line naming the key, for a missing or unreadable file."""
    files = peer_files(config.server.peer_tls, source)
    return grpc.ssl_channel_credentials(root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert)
