"""Error details in the standard gRPC form: a google.rpc.Status carrying an ErrorInfo (reason,
and shard, shard_endpoint, leader in its metadata) and, where a retry makes sense, a RetryInfo,
sent in the `grpc-status-details-bin` trailer. The server writes it; every SDK reads it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

DOMAIN = "cronoq"
DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class ErrorDetails:
    """What a refusal says beyond its code and message."""

    reason: str  # UPPER_SNAKE_CASE, e.g. NOT_LEADER, KEY_IN_ANOTHER_POOL
    metadata: dict[str, str] = field(default_factory=dict)  # shard, shard_endpoint, leader
    retry_delay: float | None = None  # seconds to wait before retrying, when a retry makes sense


def encode_details(code: int, message: str, details: ErrorDetails) -> bytes:
    """The serialized google.rpc.Status for the trailer."""
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(
        error_details_pb2.ErrorInfo(reason=details.reason, domain=DOMAIN, metadata=details.metadata)
    )
    if details.retry_delay is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(details.retry_delay * 1e9))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status.SerializeToString()


def decode_details(
    trailers: Iterable[tuple[str, str | bytes]] | Mapping[str, str | bytes] | None,
) -> ErrorDetails | None:
    """The details of a refusal from its trailing metadata; None when it carries none."""
    items = trailers.items() if isinstance(trailers, Mapping) else (trailers or ())
    raw = next((value for key, value in items if key == DETAILS_KEY), None)
    if raw is None:
        return None
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw if isinstance(raw, bytes) else raw.encode("latin-1"))
    except Exception:
        return None
    reason, metadata, retry_delay = "", {}, None
    for any_detail in status.details:
        info = error_details_pb2.ErrorInfo()
        retry = error_details_pb2.RetryInfo()
        if any_detail.Unpack(info):
            reason, metadata = info.reason, dict(info.metadata)
        elif any_detail.Unpack(retry):
            retry_delay = retry.retry_delay.ToNanoseconds() / 1e9
    return ErrorDetails(reason, metadata, retry_delay)
