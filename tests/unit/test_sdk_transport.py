"""Python SDK helpers: endpoints, redirect rules, the error tree, JSON form."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from cronoq import errors
from cronoq._transport import Endpoint, check_redirect, parse_target
from cronoq.jsonform import to_dict
from cronoq.v1 import task_pb2, task_service_pb2

TOP_BIT_ID = 2**63 + 5


# -- Endpoint.parse ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "scheme", "host", "port", "target"),
    [
        ("http://127.0.0.1:7070", "http", "127.0.0.1", 7070, "127.0.0.1:7070"),
        ("https://queue.example.com:443", "https", "queue.example.com", 443, "queue.example.com:443"),
        ("https://queue.example.com", "https", "queue.example.com", 443, "queue.example.com:443"),
        ("http://queue.example.com", "http", "queue.example.com", 80, "queue.example.com:80"),
        ("http://[::1]:7070", "http", "::1", 7070, "[::1]:7070"),
        ("https://[2001:db8::1]:9000/", "https", "2001:db8::1", 9000, "[2001:db8::1]:9000"),
        ("localhost:7070", "http", "localhost", 7070, "localhost:7070"),
        ("HTTP://Example.COM:1", "http", "example.com", 1, "example.com:1"),
        ("http://LOCALHOST:7070", "http", "localhost", 7070, "localhost:7070"),
        (" \thttp://127.0.0.1:7070 ", "http", "127.0.0.1", 7070, "127.0.0.1:7070"),
        ("http://my_service:8", "http", "my_service", 8, "my_service:8"),
        ("http://[::FFFF:127.0.0.1]:1", "http", "::ffff:127.0.0.1", 1, "[::ffff:127.0.0.1]:1"),
        ("http://0.0.0.0:65535", "http", "0.0.0.0", 65535, "0.0.0.0:65535"),
    ],
)
def test_endpoint_parse(text: str, scheme: str, host: str, port: int, target: str) -> None:
    endpoint = Endpoint.parse(text)
    assert (endpoint.scheme, endpoint.host, endpoint.port, endpoint.target) == (scheme, host, port, target)
    assert endpoint.secure == (scheme == "https")
    assert str(endpoint) == f"{scheme}://{target}"
    assert Endpoint.parse(str(endpoint)) == endpoint


@pytest.mark.parametrize(
    "text",
    [
        "",
        "ftp://host:21",
        "grpc://host:1",
        "http://",
        "http://host:99999",
        "http://host:port",
        "http://host:1/path",
        "https://:7070",
        # Forms a URL parser repairs or reads as another host: the grammar refuses them all.
        "http://2130706433:1",
        "http://0177.0.0.1:1",
        "http://0x7f.0.0.1:1",
        "http://0x7f000001:1",
        "http://a.0X1F:1",
        "http://127.1:1",
        "http://1.2.3.4.5:1",
        "http://256.0.0.1:1",
        "http://127.0.0.1:1?x=y",
        "http://127.0.0.1:1#top",
        "http://user@127.0.0.1:1",
        "http://127.0.0.1@evil.example:1",
        "http://127.0.0.%31:1",
        "http://127.0.0.1:01",
        "http://127.0.0.1:0",
        "http://127.0.0.1:",
        "http://localhost.:1",
        "http://a b:1",
        "http:\\\\127.0.0.1:1",
        "http://[fe80::1%25eth0]:1",
        "http://[::1:1",
    ],
)
def test_endpoint_parse_rejects(text: str) -> None:
    with pytest.raises(errors.InvalidArgument) as err:
        Endpoint.parse(text)
    assert repr(text) in err.value.message


@pytest.mark.parametrize(
    ("text", "loopback"),
    [
        ("http://localhost:1", True),
        ("http://127.0.0.1:1", True),
        ("http://127.9.9.9:1", True),
        ("http://[::1]:1", True),
        ("http://10.0.0.1:1", False),
        ("http://example.com:1", False),
        ("http://[2001:db8::1]:1", False),
        ("http://LocalHost:1", True),
        ("http://127.255.255.254:1", True),
        ("http://[::ffff:127.0.0.1]:1", False),
        ("http://localhost.example:1", False),
        ("http://127.0.0.1.nip.io:1", False),
    ],
)
def test_loopback(text: str, loopback: bool) -> None:
    assert Endpoint.parse(text).is_loopback is loopback


def test_a_target_that_is_not_an_endpoint_is_a_refused_redirect() -> None:
    with pytest.raises(errors.RedirectRefused) as err:
        parse_target("http://2130706433:1")
    assert "'http://2130706433:1'" in err.value.message and "not an endpoint" in err.value.message
    assert parse_target("http://LOCALHOST:1") == Endpoint("http", "localhost", 1)


# -- check_redirect ---------------------------------------------------------------


def redirect(current: str, target: str, token: str | None = None, insecure: bool = False) -> None:
    check_redirect(Endpoint.parse(current), Endpoint.parse(target), token, insecure)


def test_https_to_http_is_never_followed() -> None:
    for token, insecure in ((None, False), ("t", True), (None, True)):
        with pytest.raises(errors.RedirectRefused, match="https:// to http://"):
            redirect("https://a:1", "http://127.0.0.1:2", token, insecure)


def test_token_over_plain_http_only_to_loopback() -> None:
    with pytest.raises(errors.RedirectRefused, match="insecure_redirect_http") as err:
        redirect("http://127.0.0.1:1", "http://10.0.0.2:7070", token="t")
    assert isinstance(err.value, errors.FailedPrecondition)
    redirect("http://127.0.0.1:1", "http://10.0.0.2:7070", token="t", insecure=True)
    redirect("http://10.0.0.1:1", "http://localhost:7070", token="t")
    redirect("http://10.0.0.1:1", "http://[::1]:7070", token="t")
    redirect("http://10.0.0.1:1", "http://10.0.0.2:7070")  # no token to leak
    redirect("http://10.0.0.1:1", "https://10.0.0.2:7070", token="t")
    redirect("https://a:1", "https://b:2", token="t")


# -- errors.from_grpc_error -------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: Any = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists),
        (grpc.StatusCode.UNIMPLEMENTED, errors.Unimplemented),
        (grpc.StatusCode.INTERNAL, errors.Internal),
    ],
)
def test_from_grpc_error_maps_codes_to_classes(code: grpc.StatusCode, cls: type[errors.CronoqError]) -> None:
    err = errors.from_grpc_error(FakeRpcError(code, "pool: unknown pool 'x'"))
    assert type(err) is cls and isinstance(err, errors.CronoqError)
    assert err.code == code and err.message == "pool: unknown pool 'x'"
    assert str(err) == f"{code.name}: pool: unknown pool 'x'"


def test_from_grpc_error_keeps_redirect_metadata() -> None:
    trailing = (("cronoq-shard", "west"), ("cronoq-shard-endpoint", b"https://west:7070"), ("cronoq-leader", "w2:7070"))
    err = errors.from_grpc_error(
        FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "pool 'c' is served by shard 'west'", trailing)
    )
    assert isinstance(err, errors.FailedPrecondition)
    assert (err.shard, err.shard_endpoint, err.leader) == ("west", "https://west:7070", "w2:7070")
    assert err.metadata["cronoq-shard-endpoint"] == "https://west:7070"


def test_from_grpc_error_without_details_or_metadata() -> None:
    err = errors.from_grpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "", None))
    assert isinstance(err, errors.Unavailable) and err.message == "UNAVAILABLE" and err.metadata == {}
    assert err.shard is None and err.shard_endpoint is None
    unknown = errors.from_grpc_error(FakeRpcError(grpc.StatusCode.OK, "odd"))
    assert type(unknown) is errors.CronoqError


# -- jsonform.to_dict -------------------------------------------------------------


def json_task(
    task_id: int = TOP_BIT_ID, payload: bytes = b'{"n": 1}', content_type: str = "application/json"
) -> task_pb2.Task:
    return task_pb2.Task(
        id=task_id,
        pool="default",
        payload=payload,
        content_type=content_type,
        state=task_pb2.TASK_STATE_PENDING,
        depends_on=[TOP_BIT_ID - 1],
        resources={"gpu": 2},
    )


def test_json_payload_is_shown_as_payload_json_and_ids_as_strings() -> None:
    out = to_dict(task_service_pb2.SubmitTaskResponse(task=json_task(), deduplicated=False))
    task = out["task"]
    assert task["id"] == "9223372036854775813"
    assert task["depends_on"] == ["9223372036854775812"]
    assert task["payload_json"] == {"n": 1} and "payload" not in task
    assert task["state"] == "TASK_STATE_PENDING" and task["resources"] == {"gpu": "2"}
    assert out["deduplicated"] is False
    assert json.loads(json.dumps(out)) == out


def test_other_payloads_stay_base64() -> None:
    out = to_dict(task_service_pb2.SubmitTaskResponse(task=json_task(payload=b"\x00\x01", content_type="")))
    assert out["task"]["payload"] == "AAE=" and "payload_json" not in out["task"]
    broken = to_dict(task_service_pb2.SubmitTaskResponse(task=json_task(payload=b"{not json")))
    assert "payload_json" not in broken["task"] and broken["task"]["payload"]


def test_lists_and_events_use_the_json_form_too() -> None:
    listed = to_dict(task_service_pb2.ListTasksResponse(tasks=[json_task(), json_task(7, b"[1, 2]")]))
    assert [t["id"] for t in listed["tasks"]] == [str(TOP_BIT_ID), "7"]
    assert [t["payload_json"] for t in listed["tasks"]] == [{"n": 1}, [1, 2]]
    event = to_dict(task_service_pb2.WatchResponse(event=task_pb2.TaskEvent(task=json_task(), shard="s1")))
    assert event["event"]["task"]["payload_json"] == {"n": 1}
