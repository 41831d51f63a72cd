"""Bad input, over HTTP and gRPC, against real cronoq-server processes.

Every refusal must carry the right gRPC code and the matching HTTP status, a
message that names the field and the offending value, no traceback text, and must
admit nothing: the full task listing is compared before and after each bad call.

Each test starts one server and runs a table of cases against it (a server start
costs about a second), collecting every mismatch so that one run reports them all.
"""

from __future__ import annotations

import base64
import functools
import json
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from cronoq.v1 import (
    schedule_service_pb2 as spb,
)
from cronoq.v1 import (
    schedule_service_pb2_grpc,
    task_pb2,
    task_service_pb2_grpc,
    worker_service_pb2_grpc,
)
from cronoq.v1 import (
    task_service_pb2 as tpb,
)
from cronoq.v1 import (
    worker_service_pb2 as wpb,
)

# gRPC code -> HTTP status, as the server maps them (server/cronoq_server/errors.py).
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "FAILED_PRECONDITION": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
MAX_PAYLOAD = 4096  # the `server` fixture's limits.max_payload_bytes
MAX_BATCH = 50  # the `server` fixture's limits.max_batch_size
MAX_ID = (1 << 64) - 1
MISSING_ID = 987654321  # shard 0, a sequence no test reaches


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def has_traceback(text: str) -> bool:
    return "Traceback" in text or 'File "/' in text


# -- a client for one server ------------------------------------------------------


class Client:
    def __init__(self, server: Any):
        self.server = server
        self.channel = grpc.insecure_channel(server.grpc_target)
        self.tasks = task_service_pb2_grpc.TaskServiceStub(self.channel)
        self.workers = worker_service_pb2_grpc.WorkerServiceStub(self.channel)
        self.problems: list[str] = []

    def close(self) -> None:
        self.channel.close()

    # listings: what is admitted ------------------------------------------------

    def http_listing(self) -> list[tuple[str, str, str, int]]:
        out: list[tuple[str, str, str, int]] = []
        token = ""
        while True:
            path = "/v1/tasks?page_size=1000" + (f"&page_token={token}" if token else "")
            status, body = self.server.http("GET", path)
            assert status == 200, (status, body)
            out += [(t["id"], t["state"], t.get("result", ""), t.get("attempt", 0)) for t in body["tasks"]]
            token = body.get("next_page_token", "")
            if not token:
                return out

    def grpc_listing(self) -> list[tuple[str, str, str, int]]:
        out: list[tuple[str, str, str, int]] = []
        token = ""
        while True:
            resp = self.tasks.ListTasks(tpb.ListTasksRequest(page_size=1000, page_token=token), timeout=10)
            out += [
                (str(t.id), task_pb2.TaskState.Name(t.state), b64(t.result) if t.result else "", t.attempt)
                for t in resp.tasks
            ]
            token = resp.next_page_token
            if not token:
                return out

    def listing(self) -> list[tuple[str, str, str, int]]:
        via_http = self.http_listing()
        via_grpc = self.grpc_listing()
        assert via_http == via_grpc, (via_http, via_grpc)
        return via_http

    # checks -------------------------------------------------------------------

    def fail(self, case: str, what: str) -> None:
        self.problems.append(f"{case}: {what}")

    def check_http(
        self, case: str, status: int, body: Any, code: str, fragments: tuple[str, ...], want_status: int | None = None
    ) -> None:
        want_status = want_status or HTTP_STATUS[code]
        if status != want_status:
            self.fail(case, f"HTTP status {status}, want {want_status} ({code}); body {body!r}")
        if not isinstance(body, dict) or not isinstance(body.get("message"), str) or "code" not in body:
            self.fail(case, f"HTTP error body lacks code/message: {body!r}")
            return
        if body["code"] != code:
            self.fail(case, f"HTTP body code {body['code']!r}, want {code!r} ({body['message']!r})")
        for frag in fragments:
            if frag not in body["message"]:
                self.fail(case, f"HTTP message {body['message']!r} does not name {frag!r}")
        if has_traceback(json.dumps(body)):
            self.fail(case, f"HTTP body carries a traceback: {body!r}")

    def check_grpc(self, case: str, err: grpc.RpcError | None, code: str, fragments: tuple[str, ...]) -> None:
        if err is None:
            self.fail(case, f"gRPC call succeeded, want {code}")
            return
        if err.code() != grpc.StatusCode[code]:
            self.fail(case, f"gRPC code {err.code().name}, want {code} ({err.details()!r})")
        details = err.details() or ""
        for frag in fragments:
            if frag not in details:
                self.fail(case, f"gRPC details {details!r} do not name {frag!r}")
        if has_traceback(details):
            self.fail(case, f"gRPC details carry a traceback: {details!r}")

    def http_case(
        self,
        case: str,
        method: str,
        path: str,
        code: str,
        *fragments: str,
        body: Any = None,
        raw: bytes | None = None,
        status: int | None = None,
    ) -> None:
        """`status` overrides the code's usual HTTP status (413 for a body over the transport limit)."""
        before = self.http_listing()
        try:
            got, resp = self.server.http(method, path, body=body, raw=raw)
        except json.JSONDecodeError as err:
            self.fail(case, f"HTTP error body is not JSON ({err})")
            return
        self.check_http(case, got, resp, code, fragments, status)
        if self.http_listing() != before:
            self.fail(case, "tasks were admitted or changed by a refused HTTP call")

    def grpc_case(self, case: str, call: Callable[[], Any], code: str, *fragments: str) -> None:
        before = self.grpc_listing()
        err: grpc.RpcError | None = None
        try:
            call()
        except grpc.RpcError as e:
            err = e
        self.check_grpc(case, err, code, fragments)
        if self.grpc_listing() != before:
            self.fail(case, "tasks were admitted or changed by a refused gRPC call")

    def submit_both(self, case: str, spec: dict[str, Any], code: str, *fragments: str) -> None:
        """One SubmitTask, in its proto3 JSON form, sent over HTTP and (parsed locally) over gRPC."""
        self.http_case(f"HTTP {case}", "POST", "/v1/tasks", code, *fragments, body=spec)
        req = json_format.ParseDict(spec, tpb.SubmitTaskRequest())
        self.grpc_case(f"gRPC {case}", lambda: self.tasks.SubmitTask(req, timeout=10), code, *fragments)

    def batch_both(self, case: str, specs: list[dict[str, Any]], code: str, *fragments: str) -> None:
        self.http_case(f"HTTP {case}", "POST", "/v1/batches", code, *fragments, body={"tasks": specs})
        req = tpb.SubmitBatchRequest(tasks=[json_format.ParseDict(s, tpb.SubmitTaskRequest()) for s in specs])
        self.grpc_case(f"gRPC {case}", lambda: self.tasks.SubmitBatch(req, timeout=10), code, *fragments)

    def finish(self) -> None:
        log = self.server.log()
        if has_traceback(log):
            self.problems.append("the server logged a traceback:\n" + log[-3000:])
        assert not self.problems, "\n".join(self.problems)


@pytest.fixture
def client(server: Any) -> Iterator[Client]:
    c = Client(server)
    yield c
    c.close()


def seed(client: Client) -> dict[str, Any]:
    """A few admitted tasks, so that 'nothing admitted' is checked against a non-empty listing."""
    status, a = client.server.http("POST", "/v1/tasks", {"pool": "default", "key": "seed-a", "payload_json": {"n": 1}})
    assert status == 200, a
    b = client.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="other", key="seed-b", payload=b"x"), timeout=10)
    return {"a": a["task"], "b": b.task}


# -- SubmitTask -----------------------------------------------------------------


def test_submit_task_bad_fields(client: Client) -> None:
    seed(client)
    other_shard_id = (5 << 56) | 1
    cases: list[tuple[str, dict[str, Any], str, tuple[str, ...]]] = [
        ("unknown pool", {"pool": "nope"}, "INVALID_ARGUMENT", ("pool", "'nope'")),
        ("missing pool", {"payload": b64(b"x")}, "INVALID_ARGUMENT", ("pool", "required")),
        (
            "oversized payload",
            {"pool": "default", "payload": b64(b"x" * (MAX_PAYLOAD + 1))},
            "INVALID_ARGUMENT",
            ("payload", str(MAX_PAYLOAD + 1), str(MAX_PAYLOAD), "max_payload_bytes"),
        ),
        (
            "far oversized payload",
            {"pool": "other", "payload": b64(b"y" * (3 * MAX_PAYLOAD))},
            "INVALID_ARGUMENT",
            ("payload", str(3 * MAX_PAYLOAD), "max_payload_bytes"),
        ),
        ("max_attempts negative", {"pool": "default", "max_attempts": -1}, "INVALID_ARGUMENT", ("max_attempts", "-1")),
        (
            "max_attempts too big",
            {"pool": "default", "max_attempts": 1001},
            "INVALID_ARGUMENT",
            ("max_attempts", "1001"),
        ),
        ("unknown resource", {"pool": "default", "resources": {"gpu": 1}}, "INVALID_ARGUMENT", ("resources", "'gpu'")),
        (
            "unknown dependency by id",
            {"pool": "default", "depends_on": [{"id": str(MISSING_ID)}]},
            "NOT_FOUND",
            ("depends_on", str(MISSING_ID)),
        ),
        (
            "unknown dependency by key",
            {"pool": "default", "depends_on": [{"key": "ghost-key"}]},
            "NOT_FOUND",
            ("depends_on", "'ghost-key'"),
        ),
        (
            "unknown dependency after a known one",
            {"pool": "default", "depends_on": [{"key": "seed-a"}, {"key": "ghost-key"}]},
            "NOT_FOUND",
            ("depends_on", "'ghost-key'"),
        ),
        (
            "dependency on another shard's task",
            {"pool": "default", "depends_on": [{"id": str(other_shard_id)}]},
            "INVALID_ARGUMENT",
            ("depends_on[0]", str(other_shard_id)),
        ),
        ("empty dependency ref", {"pool": "default", "depends_on": [{}]}, "INVALID_ARGUMENT", ("depends_on[0]",)),
        (
            "dependency on its own key",
            {"pool": "default", "key": "selfish", "depends_on": [{"key": "selfish"}]},
            "INVALID_ARGUMENT",
            ("depends_on", "'selfish'"),
        ),
        ("key too long", {"pool": "default", "key": "k" * 257}, "INVALID_ARGUMENT", ("key", "257")),
        ("negative timeout", {"pool": "default", "timeout_ms": "-5"}, "INVALID_ARGUMENT", ("timeout_ms", "-5")),
        (
            "timeout near int64's maximum",  # once accepted: then every lease of its pool failed on PostgreSQL
            {"pool": "default", "timeout_ms": str(2**63 - 1)},
            "INVALID_ARGUMENT",
            ("timeout_ms", str(2**63 - 1), "604800000"),
        ),
        (
            "a schedule slot's key",  # else a submitter could take a future slot and suppress its fire
            {"pool": "default", "key": "schedule:default:nightly:1900000000"},
            "INVALID_ARGUMENT",
            ("key", "'schedule:default:nightly:1900000000'", "reserved"),
        ),
    ]
    for name, spec, code, fragments in cases:
        client.submit_both(name, spec, code, *fragments)
    # The payload limit is inclusive: exactly max_payload_bytes is admitted.
    before = len(client.listing())
    status, body = client.server.http("POST", "/v1/tasks", {"pool": "default", "payload": b64(b"z" * MAX_PAYLOAD)})
    assert status == 200, body
    client.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="default", payload=b"z" * MAX_PAYLOAD), timeout=10)
    assert len(client.listing()) == before + 2
    client.finish()


def test_http_malformed_and_unknown_json(client: Client) -> None:
    seed(client)
    raw_cases: list[tuple[str, str, bytes, tuple[str, ...]]] = [
        ("truncated JSON", "/v1/tasks", b'{"pool": ', ("body", "JSON")),
        ("not JSON at all", "/v1/tasks", b"pool=default", ("body", "JSON")),
        ("invalid UTF-8", "/v1/tasks", b'{"pool": "\xff\xfe"}', ("body",)),
        ("JSON array body", "/v1/tasks", b'[{"pool": "default"}]', ("body", "object")),
        ("JSON string body", "/v1/tasks", b'"default"', ("body", "object")),
        ("truncated batch JSON", "/v1/batches", b'{"tasks": [', ("body", "JSON")),
        ("batch of a string", "/v1/batches", b'{"tasks": "many"}', ("tasks",)),
        ("batch body an array", "/v1/batches", b'[{"pool": "default"}]', ("tasks",)),
        ("batch task not an object", "/v1/batches", b'{"tasks": [{"pool": "default"}, 7]}', ("tasks[1]", "object")),
    ]
    for name, path, raw, fragments in raw_cases:
        client.http_case(name, "POST", path, "INVALID_ARGUMENT", *fragments, raw=raw)
    body_cases: list[tuple[str, str, Any, tuple[str, ...]]] = [
        ("unknown field", "/v1/tasks", {"pool": "default", "colour": "red"}, ("colour",)),
        ("unknown nested field", "/v1/tasks", {"pool": "default", "depends_on": [{"idx": "1"}]}, ("depends_on", "idx")),
        ("unknown batch field", "/v1/batches", {"tasks": [{"pool": "default"}], "atomic": True}, ("'atomic'",)),
        (
            "unknown field in a batch task",
            "/v1/batches",
            {"tasks": [{"pool": "default"}, {"pool": "default", "colour": "red"}]},
            ("tasks[1]", "colour"),
        ),
        ("priority not a number", "/v1/tasks", {"pool": "default", "priority": "high"}, ("priority", "'high'")),
        ("priority out of int32", "/v1/tasks", {"pool": "default", "priority": 1 << 40}, ("priority", str(1 << 40))),
        ("max_attempts out of int32", "/v1/tasks", {"pool": "default", "max_attempts": 1 << 40}, ("max_attempts",)),
        (
            "dependency id not a number",
            "/v1/tasks",
            {"pool": "default", "depends_on": [{"id": "abc"}]},
            ("depends_on", "abc"),
        ),
        (
            "payload and payload_json",
            "/v1/tasks",
            {"pool": "default", "payload": "eA==", "payload_json": 1},
            ("payload_json",),
        ),
        (
            "oversized payload_json",
            "/v1/tasks",
            {"pool": "default", "payload_json": {"blob": "q" * MAX_PAYLOAD}},
            ("payload", "max_payload_bytes"),
        ),
        ("run_at not a timestamp", "/v1/tasks", {"pool": "default", "run_at": "tomorrow"}, ("run_at",)),
        (
            "resources amount not a number",
            "/v1/tasks",
            {"pool": "default", "resources": {"gpu": "lots"}},
            ("resources",),
        ),
    ]
    for name, path, body, fragments in body_cases:
        client.http_case(name, "POST", path, "INVALID_ARGUMENT", *fragments, body=body)
    client.finish()


def test_http_body_over_transport_limit(client: Client) -> None:
    """A body larger than the HTTP server reads at all is a 413 with the JSON error body, not a 500."""
    seed(client)
    huge = b'{"pool": "default", "payload": "' + b"A" * (5 << 20) + b'"}'
    client.http_case("5 MiB body", "POST", "/v1/tasks", "INVALID_ARGUMENT", "body", "4194304", raw=huge, status=413)
    client.finish()


# -- SubmitBatch ----------------------------------------------------------------


def test_submit_batch_all_or_nothing(client: Client) -> None:
    seeded = seed(client)
    many = [{"pool": "default", "key": f"m{i}", "payload": b64(b"%d" % i)} for i in range(10)]
    chained = [{"pool": "default", "key": "c0"}] + [
        {"pool": "default", "key": f"c{i}", "depends_on": [{"key": f"c{i - 1}"}]} for i in range(1, 10)
    ]

    def with_bad(tasks: list[dict[str, Any]], index: int, **change: Any) -> list[dict[str, Any]]:
        out = [dict(t) for t in tasks]
        out[index] = {**out[index], **change}
        return out

    cases: list[tuple[str, list[dict[str, Any]], str, tuple[str, ...]]] = [
        (
            "cycle a->b->a",
            [
                {"pool": "default", "key": "a", "depends_on": [{"key": "b"}]},
                {"pool": "default", "key": "b", "depends_on": [{"key": "a"}]},
            ],
            "INVALID_ARGUMENT",
            ("depends_on", "cycle", "'a'", "'b'"),
        ),
        (
            "cycle of three after good tasks",
            [
                *many[:3],
                {"pool": "default", "key": "x", "depends_on": [{"key": "z"}]},
                {"pool": "default", "key": "y", "depends_on": [{"key": "x"}]},
                {"pool": "default", "key": "z", "depends_on": [{"key": "y"}]},
            ],
            "INVALID_ARGUMENT",
            ("cycle", "'x'", "'y'", "'z'"),
        ),
        (
            "task depends on itself in a batch",
            [{"pool": "default", "key": "self", "depends_on": [{"key": "self"}]}],
            "INVALID_ARGUMENT",
            ("depends_on", "'self'"),
        ),
        (
            f"batch of {MAX_BATCH + 1}",
            [{"pool": "default"} for _ in range(MAX_BATCH + 1)],
            "INVALID_ARGUMENT",
            ("tasks", str(MAX_BATCH + 1), str(MAX_BATCH), "max_batch_size"),
        ),
        ("empty batch", [], "INVALID_ARGUMENT", ("tasks",)),
        (
            "unknown pool in task 7 of 10",
            with_bad(many, 7, pool="nope"),
            "INVALID_ARGUMENT",
            ("tasks[7].pool", "'nope'"),
        ),
        (
            "oversized payload in task 3 of 10",
            with_bad(many, 3, payload=b64(b"p" * (MAX_PAYLOAD + 1))),
            "INVALID_ARGUMENT",
            ("tasks[3].payload", str(MAX_PAYLOAD + 1)),
        ),
        (
            "max_attempts 0..1000 in task 9",
            with_bad(many, 9, max_attempts=5000),
            "INVALID_ARGUMENT",
            ("tasks[9].max_attempts", "5000"),
        ),
        (
            "unknown resource in task 0",
            with_bad(many, 0, resources={"gpu": 1}),
            "INVALID_ARGUMENT",
            ("tasks[0].resources", "'gpu'"),
        ),
        (
            "unknown dependency key in the last of a chain",
            with_bad(chained, 9, depends_on=[{"key": "c8"}, {"key": "ghost-key"}]),
            "NOT_FOUND",
            ("depends_on", "'ghost-key'"),
        ),
        (
            "unknown dependency id in task 5",
            with_bad(many, 5, depends_on=[{"id": str(MISSING_ID)}]),
            "NOT_FOUND",
            ("depends_on", str(MISSING_ID)),
        ),
        (
            "duplicate key in one batch",
            [{"pool": "default", "key": "dup"}, {"pool": "other"}, {"pool": "other", "key": "dup"}],
            "INVALID_ARGUMENT",
            ("tasks[2].key", "'dup'", "tasks[0]"),
        ),
        (
            "deduplicated task plus a bad one",
            [{"pool": "default", "key": "seed-a"}, {"pool": "default", "key": "fresh"}, {"pool": "nope"}],
            "INVALID_ARGUMENT",
            ("tasks[2].pool", "'nope'"),
        ),
    ]
    for name, specs, code, fragments in cases:
        client.batch_both(name, specs, code, *fragments)
    # Sanity: the good parts of those batches are admissible on their own.
    status, body = client.server.http("POST", "/v1/batches", {"tasks": chained})
    assert status == 200, body
    assert [t["state"] for t in body["tasks"]] == ["TASK_STATE_PENDING"] + ["TASK_STATE_BLOCKED"] * 9
    resp = client.tasks.SubmitBatch(
        tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default")] * MAX_BATCH), timeout=10
    )
    assert len(resp.tasks) == MAX_BATCH
    assert seeded["a"]["key"] == "seed-a"
    client.finish()


def test_pending_limit_admits_nothing(start_server: Any) -> None:
    srv = start_server({"pools": [{"name": "default"}], "limits": {"max_pending_total": 3}})
    client = Client(srv)
    try:
        client.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="default", key="one"), timeout=10)
        specs = [{"pool": "default", "key": f"b{i}"} for i in range(3)]
        client.batch_both("batch over max_pending_total", specs, "RESOURCE_EXHAUSTED", "max_pending_total", "3")
        assert len(client.listing()) == 1
        client.tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default")] * 2), timeout=10)
        client.submit_both(
            "submit over max_pending_total", {"pool": "default"}, "RESOURCE_EXHAUSTED", "max_pending_total"
        )
        assert len(client.listing()) == 3
        client.finish()
    finally:
        client.close()


# -- lookups ----------------------------------------------------------------------


def test_lookups_of_missing_tasks(client: Client) -> None:
    seed(client)
    for verb, suffix, call in (
        ("GET", "", "GetTask"),
        ("GET", "/wait?timeout_ms=50", "WaitTask"),
        ("POST", "/cancel", "CancelTask"),
    ):
        base = suffix.split("?")[0]
        query = suffix[len(base) :]
        client.http_case(
            f"{call} missing id", verb, f"/v1/tasks/{MISSING_ID}{base}{query}", "NOT_FOUND", str(MISSING_ID)
        )
        client.http_case(f"{call} max uint64 id", verb, f"/v1/tasks/{MAX_ID}{base}{query}", "NOT_FOUND", str(MAX_ID))
        client.http_case(f"{call} missing key", verb, f"/v1/keys/ghost-key{base}{query}", "NOT_FOUND", "'ghost-key'")
        stub_call = getattr(client.tasks, call)
        req_type = getattr(tpb, f"{call}Request")
        extra = {"timeout_ms": 50} if call == "WaitTask" else {}
        for ref, frag in (
            (task_pb2.TaskRef(id=MISSING_ID), str(MISSING_ID)),
            (task_pb2.TaskRef(id=MAX_ID), str(MAX_ID)),
            (task_pb2.TaskRef(key="ghost-key"), "'ghost-key'"),
        ):
            req = req_type(task=ref, **extra)
            client.grpc_case(f"gRPC {call} {ref}", functools.partial(stub_call, req, timeout=10), "NOT_FOUND", frag)
        for ref, frag in ((task_pb2.TaskRef(id=0), "0"), (task_pb2.TaskRef(), "task")):
            req = req_type(task=ref, **extra)
            client.grpc_case(
                f"gRPC {call} bad ref {ref}", functools.partial(stub_call, req, timeout=10), "INVALID_ARGUMENT", frag
            )
    client.finish()


def test_unparsable_ids_in_the_url(client: Client) -> None:
    seed(client)
    bad_ids = ["abc", "-1", str(1 << 64), str(10**30), "0", "1.5", "0x10", "1e3", "+1", "%C2%B2", "%D9%A1", "%20"]
    for raw_id in bad_ids:
        shown = urllib.parse.unquote(raw_id)
        for verb, suffix, call in (("GET", "", "get"), ("GET", "/wait", "wait"), ("POST", "/cancel", "cancel")):
            client.http_case(
                f"{call} /v1/tasks/{raw_id}", verb, f"/v1/tasks/{raw_id}{suffix}", "INVALID_ARGUMENT", "id", repr(shown)
            )
    client.finish()


def test_bad_query_parameters(client: Client) -> None:
    seeded = seed(client)
    task_id = seeded["a"]["id"]
    cases: list[tuple[str, str, tuple[str, ...]]] = [
        ("timeout_ms not a number", f"/v1/tasks/{task_id}/wait?timeout_ms=soon", ("timeout_ms", "'soon'")),
        ("timeout_ms negative", f"/v1/tasks/{task_id}/wait?timeout_ms=-5", ("timeout_ms", "'-5'")),
        ("timeout_ms over uint32", f"/v1/tasks/{task_id}/wait?timeout_ms={1 << 40}", ("timeout_ms", str(1 << 40))),
        ("timeout_ms odd digits", f"/v1/tasks/{task_id}/wait?timeout_ms=%C2%B2", ("timeout_ms", "'²'")),
        ("unknown pool", "/v1/tasks?pool=nope", ("pool", "'nope'")),
        ("unknown state", "/v1/tasks?state=DONE", ("state", "'DONE'")),
        ("page_size not a number", "/v1/tasks?page_size=many", ("page_size", "'many'")),
        ("page_size negative", "/v1/tasks?page_size=-1", ("page_size", "'-1'")),
        ("page_size over int32", f"/v1/tasks?page_size={1 << 40}", ("page_size", str(1 << 40))),
        ("page_token foreign", "/v1/tasks?page_token=xyz", ("page_token", "'xyz'")),
        ("page_token odd digits", "/v1/tasks?page_token=%C2%B2", ("page_token", "'²'")),
        ("watch of an unknown pool", "/v1/watch?pool=nope", ("pool", "'nope'")),
    ]
    for name, path, fragments in cases:
        client.http_case(name, "GET", path, "INVALID_ARGUMENT", *fragments)
    grpc_cases: list[tuple[str, tpb.ListTasksRequest, tuple[str, ...]]] = [
        ("unknown pool", tpb.ListTasksRequest(pool="nope"), ("pool", "'nope'")),
        ("negative page_size", tpb.ListTasksRequest(page_size=-1), ("page_size", "-1")),
        ("foreign page_token", tpb.ListTasksRequest(page_token="xyz"), ("page_token", "'xyz'")),
        ("odd-digit page_token", tpb.ListTasksRequest(page_token="²"), ("page_token", "'²'")),
        ("unknown state number", tpb.ListTasksRequest(state=99), ("state", "99")),  # type: ignore[arg-type]
    ]
    for name, req, fragments in grpc_cases:
        client.grpc_case(
            f"gRPC ListTasks {name}",
            functools.partial(client.tasks.ListTasks, req, timeout=10),
            "INVALID_ARGUMENT",
            *fragments,
        )

    def watch_unknown_pool() -> None:
        for _ in client.tasks.Watch(tpb.WatchRequest(pool="nope"), timeout=5):
            pass

    client.grpc_case("gRPC Watch unknown pool", watch_unknown_pool, "INVALID_ARGUMENT", "pool", "'nope'")
    client.finish()


# -- schedules --------------------------------------------------------------------


def test_put_schedule_hostile_cron_and_zone(client: Client) -> None:
    """What an attacker would try in a cron or a zone: each a 400 INVALID_ARGUMENT naming the
    field, never a 500 (a superscript step once raised from int(), a directory zone from open())."""
    schedules = schedule_service_pb2_grpc.ScheduleServiceStub(client.channel)
    crons = [
        "*/\u00b2 * * * *",  # superscript two
        "*/\u0661 * * * *",  # Arabic-Indic one: was accepted as 1
        "*/\uff15 * * * *",  # fullwidth five
        "* * * * \u017fun",  # long s: upper() makes it SUN
        "*\x1c*\x1c*\x1c*\x1c*",
        "* * * * *\x00",
        "*/99999999999999999999999 * * * *",
        "0-99999999999999999999 * * * *",
        "1" + ",1" * 300,
    ]
    zones = ["Europe", "America/Argentina", "x" * 300, "../etc/passwd", "/dev/zero", "UTC\x00", "Europe/../UTC"]
    cases = [(f"cron {c[:40]!r}", {"cron": c}, "schedule.cron") for c in crons]
    cases += [(f"timezone {z[:40]!r}", {"cron": "* * * * *", "timezone": z}, "schedule.timezone") for z in zones]
    for case, fields, field in cases:
        spec = {"pool": "default", "name": "hostile", **fields}
        client.http_case(
            f"HTTP {case}", "PUT", "/v1/pools/default/schedules/hostile", "INVALID_ARGUMENT", field, body=fields
        )
        req = spb.PutScheduleRequest(schedule=spb.Schedule(**spec))
        client.grpc_case(f"gRPC {case}", lambda r=req: schedules.PutSchedule(r, timeout=10), "INVALID_ARGUMENT", field)
    for stored in schedules.ListSchedules(spb.ListSchedulesRequest(), timeout=10).schedules:
        client.fail("ListSchedules", f"a refused schedule was stored: {stored.cron!r} {stored.timezone!r}")
    client.finish()


# -- workers ----------------------------------------------------------------------


def test_worker_calls_bad_input(client: Client) -> None:
    seed(client)
    w = client.workers
    client.grpc_case(
        "register for an unknown pool",
        lambda: w.RegisterWorker(wpb.RegisterWorkerRequest(name="w", pools=["default", "nope"]), timeout=10),
        "INVALID_ARGUMENT",
        "pools",
        "'nope'",
    )
    client.grpc_case(
        "register for no pool",
        lambda: w.RegisterWorker(wpb.RegisterWorkerRequest(name="w"), timeout=10),
        "INVALID_ARGUMENT",
        "pools",
    )
    client.grpc_case(
        "register with negative concurrency",
        lambda: w.RegisterWorker(wpb.RegisterWorkerRequest(name="w", pools=["other"], concurrency=-2), timeout=10),
        "INVALID_ARGUMENT",
        "concurrency",
        "-2",
    )
    client.grpc_case(
        "register with a concurrency past the credits a worker may hold",
        lambda: w.RegisterWorker(
            wpb.RegisterWorkerRequest(name="w", pools=["other"], concurrency=2**31 - 1), timeout=10
        ),
        "INVALID_ARGUMENT",
        "concurrency",
        "2147483647",
    )
    worker_id = w.RegisterWorker(wpb.RegisterWorkerRequest(name="w", pools=["other"]), timeout=10).worker_id
    client.grpc_case(
        "lease for an unknown worker",
        lambda: w.LeaseTasks(wpb.LeaseTasksRequest(worker_id="nobody", max_tasks=1), timeout=10),
        "NOT_FOUND",
        "worker_id",
        "'nobody'",
    )
    client.grpc_case(
        "lease zero tasks",
        lambda: w.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker_id, max_tasks=0), timeout=10),
        "INVALID_ARGUMENT",
        "max_tasks",
        "0",
    )
    client.grpc_case(
        "lease from a pool the worker did not register for",
        lambda: w.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker_id, max_tasks=1, pools=["default"]), timeout=10),
        "INVALID_ARGUMENT",
        "pools",
        "'default'",
    )
    client.grpc_case(
        "heartbeat of an unknown worker",
        lambda: w.Heartbeat(wpb.HeartbeatRequest(worker_id="nobody"), timeout=10),
        "NOT_FOUND",
        "worker_id",
        "'nobody'",
    )
    client.grpc_case(
        "finish for an unknown worker",
        lambda: w.FinishTasks(wpb.FinishTasksRequest(worker_id="nobody"), timeout=10),
        "NOT_FOUND",
        "worker_id",
        "'nobody'",
    )
    foreign = (7 << 56) | 1
    client.grpc_case(
        "finish a task of another shard",
        lambda: w.FinishTasks(
            wpb.FinishTasksRequest(
                worker_id=worker_id,
                outcomes=[wpb.TaskOutcome(task_id=foreign, attempt=1, success=wpb.TaskSuccess())],
            ),
            timeout=10,
        ),
        "INVALID_ARGUMENT",
        "outcomes[0].task_id",
        str(foreign),
    )
    client.grpc_case(
        "finish with no outcome kind",
        lambda: w.FinishTasks(
            wpb.FinishTasksRequest(worker_id=worker_id, outcomes=[wpb.TaskOutcome(task_id=1, attempt=1)]), timeout=10
        ),
        "INVALID_ARGUMENT",
        "outcomes[0]",
    )
    # An outcome for a task that does not exist is refused per item, as one not leased to this
    # worker is: the same code and message, so reports reveal nothing about other tasks.
    resp = w.FinishTasks(
        wpb.FinishTasksRequest(
            worker_id=worker_id,
            outcomes=[wpb.TaskOutcome(task_id=MISSING_ID, attempt=1, success=wpb.TaskSuccess())],
        ),
        timeout=10,
    )
    assert [(r.task_id, r.accepted, r.code) for r in resp.results] == [(MISSING_ID, False, "FAILED_PRECONDITION")]
    assert resp.results[0].message == f"task {MISSING_ID} is not leased to worker {worker_id} at attempt 1"
    client.finish()


# -- stale finish reports -----------------------------------------------------------


def _get(client: Client, task_id: int) -> task_pb2.Task:
    return client.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task_id)), timeout=10).task


def _finish(client: Client, worker_id: str, *outcomes: wpb.TaskOutcome) -> list[wpb.FinishTaskResult]:
    return list(
        client.workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker_id, outcomes=outcomes), timeout=10).results
    )


def _success(task_id: int, attempt: int, result: bytes) -> wpb.TaskOutcome:
    return wpb.TaskOutcome(task_id=task_id, attempt=attempt, success=wpb.TaskSuccess(result=result))


def _failure(task_id: int, attempt: int, retryable: bool = True) -> wpb.TaskOutcome:
    return wpb.TaskOutcome(task_id=task_id, attempt=attempt, failure=wpb.TaskFailure(error="boom", retryable=retryable))


def _assert_refused(result: wpb.FinishTaskResult, task_id: int, attempt: int) -> None:
    assert result.task_id == task_id
    assert result.accepted is False
    assert result.code == "FAILED_PRECONDITION", result
    assert str(task_id) in result.message and f"attempt {attempt}" in result.message, result.message
    assert not has_traceback(result.message)


def _lease_one(client: Client, worker_id: str) -> task_pb2.Task:
    resp = client.workers.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker_id, max_tasks=1, wait_ms=2000), timeout=10)
    assert len(resp.tasks) == 1, resp
    return resp.tasks[0]


def test_stale_finish_reports_are_refused(client: Client) -> None:
    seed(client)  # seed-b sits in pool "other"; drain it first
    w = client.workers
    worker_id = w.RegisterWorker(wpb.RegisterWorkerRequest(name="stale", pools=["other"]), timeout=10).worker_id
    seeded = _lease_one(client, worker_id)
    assert _finish(client, worker_id, _success(seeded.id, seeded.attempt, b"ok"))[0].accepted

    task_id = client.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="other", payload=b"p"), timeout=10).task.id
    leased = _lease_one(client, worker_id)
    assert (leased.id, leased.attempt, leased.state) == (task_id, 1, task_pb2.TASK_STATE_RUNNING)
    running = _get(client, task_id)

    # A report for an attempt that has not started: refused, the task is untouched.
    for outcome in (_success(task_id, 2, b"future"), _failure(task_id, 2), _success(task_id, 0, b"zero")):
        (result,) = _finish(client, worker_id, outcome)
        _assert_refused(result, task_id, outcome.attempt)
        assert _get(client, task_id) == running

    # The current attempt finishes once...
    (ok,) = _finish(client, worker_id, _success(task_id, 1, b"first"))
    assert ok.accepted and ok.code == ""
    done = _get(client, task_id)
    assert done.state == task_pb2.TASK_STATE_SUCCEEDED and done.result == b"first"

    # ...and never again: not with the same attempt, not with another outcome.
    for outcome in (
        _success(task_id, 1, b"second"),
        _failure(task_id, 1, retryable=False),
        wpb.TaskOutcome(task_id=task_id, attempt=1, cancelled=wpb.TaskCancelled(reason="late")),
        _success(task_id, 2, b"third"),
    ):
        (result,) = _finish(client, worker_id, outcome)
        _assert_refused(result, task_id, outcome.attempt)
        assert _get(client, task_id) == done

    # Two reports of one attempt in one request: the first counts, the second is refused.
    twice = client.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="other"), timeout=10).task.id
    _lease_one(client, worker_id)
    first, second = _finish(client, worker_id, _success(twice, 1, b"a"), _success(twice, 1, b"b"))
    assert first.accepted and first.task_id == twice
    _assert_refused(second, twice, 1)
    assert _get(client, twice).result == b"a"
    client.finish()


def test_finish_after_lease_expiry_is_refused(client: Client) -> None:
    """Pool 'default' has lease_ttl 2s: the lease expires, and the late report must not complete the task."""
    w = client.workers
    worker_id = w.RegisterWorker(wpb.RegisterWorkerRequest(name="slow", pools=["default"]), timeout=10).worker_id
    task_id = client.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="default", max_attempts=3), timeout=10).task.id
    assert _lease_one(client, worker_id).attempt == 1
    deadline = time.monotonic() + 10
    while (task := _get(client, task_id)).state == task_pb2.TASK_STATE_RUNNING:
        assert time.monotonic() < deadline, "lease never expired"
        time.sleep(0.1)
    assert task.state == task_pb2.TASK_STATE_PENDING and task.attempt == 1 and "lease expired" in task.error

    (result,) = _finish(client, worker_id, _success(task_id, 1, b"late"))
    _assert_refused(result, task_id, 1)
    assert _get(client, task_id) == task
    hb = w.Heartbeat(
        wpb.HeartbeatRequest(worker_id=worker_id, tasks=[wpb.TaskAttempt(task_id=task_id, attempt=1)]), timeout=10
    )
    assert list(hb.lost_task_ids) == [task_id]

    # Leased again as attempt 2: the report of attempt 1 is still refused.
    again = _lease_one(client, worker_id)
    assert (again.id, again.attempt) == (task_id, 2)
    running = _get(client, task_id)
    (result,) = _finish(client, worker_id, _success(task_id, 1, b"late"))
    _assert_refused(result, task_id, 1)
    assert _get(client, task_id) == running
    (ok,) = _finish(client, worker_id, _success(task_id, 2, b"on time"))
    assert ok.accepted
    assert _get(client, task_id).result == b"on time"
    client.finish()
