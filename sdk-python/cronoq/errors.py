"""One error tree: CronoqError, and one class per gRPC status code.

Build them from a gRPC error with `from_grpc_error`. Refusals that send the caller to
another shard carry `shard` and `shard_endpoint`.
"""

from __future__ import annotations

from typing import Any

import grpc

from .status import ErrorDetails, decode_details


class CronoqError(Exception):
    """Root of every error the SDK raises for a refused or failed call."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, metadata: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.metadata = dict(metadata or {})
        # The server's google.rpc.Status details (ErrorInfo, RetryInfo), when it sent them.
        self.details: ErrorDetails | None = None

    def _detail(self, key: str) -> str | None:
        return self.details.metadata.get(key) if self.details else None

    @property
    def reason(self) -> str | None:
        """Why, as an UPPER_SNAKE_CASE constant (NOT_LEADER, KEY_IN_ANOTHER_POOL, ...)."""
        return self.details.reason if self.details else None

    @property
    def retry_delay(self) -> float | None:
        """Seconds the server suggests waiting before a retry, when a retry makes sense."""
        return self.details.retry_delay if self.details else None

    @property
    def shard(self) -> str | None:
        return self.metadata.get("cronoq-shard") or self._detail("shard")

    @property
    def shard_endpoint(self) -> str | None:
        return self.metadata.get("cronoq-shard-endpoint") or self._detail("shard_endpoint")

    @property
    def leader(self) -> str | None:
        return self.metadata.get("cronoq-leader") or self._detail("leader")

    def __str__(self) -> str:
        name = self.code.name if self.code else "ERROR"
        return f"{name}: {self.message}"


class Cancelled(CronoqError):
    code = grpc.StatusCode.CANCELLED


class Unknown(CronoqError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(CronoqError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(CronoqError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(CronoqError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(CronoqError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(CronoqError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(CronoqError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(CronoqError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(CronoqError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(CronoqError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(CronoqError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(CronoqError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(CronoqError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(CronoqError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(CronoqError):
    code = grpc.StatusCode.UNAUTHENTICATED


class TlsError(CronoqError):
    """A TLS handshake with the server failed: a server certificate that is not signed by a
    trusted CA, expired or issued for another host, a client certificate the server refused
    or requires, or a server that does (or does not) speak TLS on that port. The message is
    "https://host:port: TLS handshake failed: <reason>".

    Its code is UNAVAILABLE (that is what gRPC reports), but it is not an Unavailable: no
    retry can fix it, so it is raised at once, after the first attempt.
    """

    code = grpc.StatusCode.UNAVAILABLE

    def __str__(self) -> str:
        return self.message


# What gRPC's handshake errors say (after CERTIFICATE_VERIFY_FAILED), and what that means.
_VERIFY_REASONS = (
    ("certificate has expired", "certificate verify failed: the server's certificate has expired"),
    ("certificate is not yet valid", "certificate verify failed: the server's certificate is not yet valid"),
    ("unable to get local issuer certificate", "certificate verify failed: unknown CA (the server's certificate "
     "is not signed by a trusted CA: unable to get local issuer certificate)"),
    ("unable to get issuer certificate", "certificate verify failed: unknown CA (unable to get issuer certificate)"),
    ("self-signed certificate", "certificate verify failed: unknown CA (self-signed certificate)"),
    ("self signed certificate", "certificate verify failed: unknown CA (self-signed certificate)"),
    ("hostname mismatch", "hostname mismatch: the server's certificate is not valid for this host"),
)  # fmt: skip


def tls_verify_reason(message: str) -> str:
    """The reason for a certificate verification message (gRPC's or Python's ssl module's)."""
    lowered = message.lower()
    for marker, reason in _VERIFY_REASONS:
        if marker in lowered:
            return reason
    return f"certificate verify failed: {message.strip().rstrip('.')}"


def tls_failure_reason(details: str) -> str | None:
    """The TLS handshake failure a gRPC UNAVAILABLE's details describe, or None.

    gRPC reports them as e.g. "failed to connect to all addresses; last error: UNKNOWN:
    ipv4:127.0.0.1:7443: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL:
    error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: certificate has
    expired: OK". A server that refuses the client's certificate just closes the connection
    ("Socket closed"): that is told apart only by a probe (see cronoq._transport).
    """
    if "Hostname Verification Check failed" in details or (
        "Peer name" in details and "is not in peer certificate" in details
    ):
        return "hostname mismatch: the server's certificate is not valid for this host"
    if "missing selected ALPN property" in details or "NO_APPLICATION_PROTOCOL" in details:
        return "the server does not speak gRPC (HTTP/2) here: is this its HTTP port rather than its gRPC port?"
    if "WRONG_VERSION_NUMBER" in details:
        return "the server does not speak TLS on this port (wrong version number): is it an http:// endpoint?"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        rest = details.split("CERTIFICATE_VERIFY_FAILED", 1)[1].lstrip(": ")
        return tls_verify_reason(rest.removesuffix(": OK"))
    for marker in ("Tls handshake failed", "Handshake failed", "SSL_ERROR_"):
        if marker in details:
            rest = details.split(marker, 1)[1].lstrip(" :")
            return " ".join(rest.removesuffix(": OK").split())[:300] or "handshake failed"
    return None


class TooManyRedirects(FailedPrecondition):
    """A worker was sent to another shard more than three times in a row."""


class RedirectRefused(FailedPrecondition):
    """A redirect the connection rules forbid (https to http, or a token over plain http)."""


_BY_CODE: dict[grpc.StatusCode, type[CronoqError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
    if cls.code is not None
}


def _metadata(pairs: Any) -> dict[str, str]:
    """The text entries of trailing metadata (binary ones, "-bin", are read by decode_details)."""
    out: dict[str, str] = {}
    for key, value in pairs or ():
        if not key.endswith("-bin"):
            out[key] = value.decode() if isinstance(value, bytes) else value
    return out


def from_grpc_error(err: grpc.RpcError) -> CronoqError:
    """The SDK error for a gRPC error, with its trailing metadata."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = err.details() if hasattr(err, "details") else str(err)  # type: ignore[attr-defined]
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAVAILABLE and details and (reason := tls_failure_reason(details)):
        return TlsError(f"TLS handshake failed: {reason}", _metadata(trailing))
    cls = _BY_CODE.get(code, CronoqError)
    error = cls(details or code.name, _metadata(trailing))
    error.details = decode_details(trailing)  # type: ignore[arg-type]
    return error
