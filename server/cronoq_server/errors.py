"""The one error type the core raises; the APIs map it to gRPC and HTTP."""

from __future__ import annotations

import grpc

from cronoq.status import DETAILS_KEY, ErrorDetails, encode_details

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


# Response metadata (cronoq-*) as the keys of an ErrorInfo's metadata.
_DETAIL_KEYS = {"cronoq-leader": "leader", "cronoq-shard": "shard", "cronoq-shard-endpoint": "shard_endpoint"}


class ApiError(Exception):
    """A refusal with a gRPC code, a message naming the field and value, and metadata.

    reason (UPPER_SNAKE_CASE; the code's name unless given) and retry_delay (seconds, when a
    retry makes sense) go out as a google.rpc.Status with ErrorInfo and RetryInfo.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        metadata: dict[str, str] | None = None,
        *,
        reason: str | None = None,
        retry_delay: float | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata or {}
        self.reason = reason or code.name
        self.retry_delay = retry_delay

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    @property
    def details(self) -> ErrorDetails:
        info = {_DETAIL_KEYS[k]: v for k, v in self.metadata.items() if k in _DETAIL_KEYS}
        return ErrorDetails(self.reason, info, self.retry_delay)

    def trailers(self) -> tuple[tuple[str, str | bytes], ...]:
        """The gRPC trailing metadata: the cronoq-* entries and the standard status details."""
        details = encode_details(self.code.value[0], self.message, self.details)
        return (*self.metadata.items(), (DETAILS_KEY, details))


def invalid(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.NOT_FOUND, message)


def failed_precondition(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.FAILED_PRECONDITION, message)
