"""One error tree: CronoqError, and one class per gRPC status code.

Build them from a gRPC error with `from_grpc_error`. Refusals that send the caller to
another shard carry `shard` and `shard_endpoint`.
"""

from __future__ import annotations

from typing import Any

import grpc


class CronoqError(Exception):
    """Root of every error the SDK raises for a refused or failed call."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, metadata: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.metadata = dict(metadata or {})

    @property
    def shard(self) -> str | None:
        return self.metadata.get("cronoq-shard")

    @property
    def shard_endpoint(self) -> str | None:
        return self.metadata.get("cronoq-shard-endpoint")

    @property
    def leader(self) -> str | None:
        return self.metadata.get("cronoq-leader")

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
    out: dict[str, str] = {}
    for key, value in pairs or ():
        out[key] = value.decode() if isinstance(value, bytes) else value
    return out


def from_grpc_error(err: grpc.RpcError) -> CronoqError:
    """The SDK error for a gRPC error, with its trailing metadata."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = err.details() if hasattr(err, "details") else str(err)  # type: ignore[attr-defined]
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None  # type: ignore[attr-defined]
    cls = _BY_CODE.get(code, CronoqError)
    return cls(details or code.name, _metadata(trailing))
