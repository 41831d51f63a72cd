"""api.wire: a request that does not decode is INVALID_ARGUMENT naming the field it breaks at."""

from __future__ import annotations

import grpc
import pytest

from cronoq.v1 import worker_service_pb2 as wpb
from cronoq_server.api.wire import MALFORMED, broken_field, parse
from cronoq_server.errors import ApiError


def bad_utf8(message: wpb.WorkRequest | wpb.RegisterWorkerRequest) -> bytes:
    return message.SerializeToString().replace("éé".encode(), b"\xff\xfe\xff\xfe")


@pytest.mark.parametrize(
    ("message", "data", "field"),
    [
        (wpb.WorkRequest, b"\xff\xff\xff", "WorkRequest"),
        (wpb.WorkRequest, bad_utf8(wpb.WorkRequest(worker_id="éé")), "worker_id"),
        (wpb.WorkRequest, bad_utf8(wpb.WorkRequest(pools=["a", "éé"])), "pools[1]"),
        (
            wpb.WorkRequest,
            bad_utf8(
                wpb.WorkRequest(outcomes=[wpb.TaskOutcome(), wpb.TaskOutcome(failure=wpb.TaskFailure(error="éé"))])
            ),
            "outcomes[1].failure.error",
        ),
        (wpb.RegisterWorkerRequest, bad_utf8(wpb.RegisterWorkerRequest(labels={"k": "éé"})), "labels[0].value"),
        (
            wpb.WorkRequest,
            wpb.WorkRequest(worker_id="w", outcomes=[wpb.TaskOutcome(task_id=5)]).SerializeToString()[:-1],
            "outcomes[0]",
        ),
    ],
)
def test_a_malformed_request_names_the_field_it_breaks_at(message: type, data: bytes, field: str) -> None:
    with pytest.raises(ApiError) as err:
        parse(message, data)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.reason == MALFORMED
    assert err.value.message.startswith(f"{field}: "), err.value.message
    assert message.DESCRIPTOR.full_name in err.value.message


def test_a_well_formed_request_parses_and_has_no_broken_field() -> None:
    data = wpb.WorkRequest(worker_id="w", outcomes=[wpb.TaskOutcome(task_id=1)], credits=3).SerializeToString()
    assert parse(wpb.WorkRequest, data).credits == 3
    assert broken_field(wpb.WorkRequest.DESCRIPTOR, data) is None
