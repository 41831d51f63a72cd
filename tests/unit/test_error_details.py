"""Refusals carry a google.rpc.Status (ErrorInfo, RetryInfo) in grpc-status-details-bin."""

from __future__ import annotations

import grpc

from cronoq.status import DETAILS_KEY, decode_details
from cronoq_server.errors import ApiError


def test_a_refusal_round_trips_its_reason_metadata_and_retry_delay() -> None:
    err = ApiError(
        grpc.StatusCode.UNAVAILABLE,
        "this server is a standby",
        {"cronoq-leader": "http://127.0.0.1:7070"},
        reason="NOT_LEADER",
        retry_delay=0.1,
    )
    trailers = err.trailers()
    assert ("cronoq-leader", "http://127.0.0.1:7070") in trailers
    assert any(key == DETAILS_KEY for key, _ in trailers)
    details = decode_details(trailers)
    assert details is not None
    assert details.reason == "NOT_LEADER"
    assert details.metadata == {"leader": "http://127.0.0.1:7070"}
    assert details.retry_delay == 0.1


def test_reason_defaults_to_the_code_and_no_retry_info_unless_a_retry_helps() -> None:
    details = decode_details(ApiError(grpc.StatusCode.NOT_FOUND, "task 7 not found").trailers())
    assert details is not None and details.reason == "NOT_FOUND" and details.retry_delay is None
    assert decode_details([("other", "x")]) is None
    assert decode_details([(DETAILS_KEY, b"\xff\xfe not a status")]) is None
