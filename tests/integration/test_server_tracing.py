"""The server's own spans over OTLP/HTTP ([server] otlp_endpoint), received by a collector of
the test's own: a SERVER span per API call, named as gRPC names the method, parented by the
caller's traceparent (or by the trace context a task is submitted in), with the shard and the
gRPC code; a call forwarded to another shard is a child span there, in the same trace."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from test_sharding import TwoShards, bearer

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as tpb

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


class Collector:
    """An OTLP/HTTP endpoint on loopback that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Any]] = []  # (resource attributes, span)
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in request.resource_spans:
                    resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                    collector.spans += [(resource, s) for ss in rs.scope_spans for s in ss.spans]
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def named(self, name: str, count: int, shard: str = "", timeout: float = 10.0) -> list[tuple[dict[str, Any], Any]]:
        """At least count spans of that name (from that shard), waiting for them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [
                (r, s) for r, s in self.spans if s.name == name and r["cronoq.shard"] in (shard or r["cronoq.shard"])
            ]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{count} span(s) {name!r} not received: {[s.name for _, s in self.spans]}")


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.server.shutdown()


def attributes(span: Any) -> dict[str, Any]:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


def test_each_call_is_a_server_span_and_a_forward_is_its_child(
    tmp_path: Path, start_server: Any, collector: Collector
) -> None:
    shards = TwoShards(tmp_path, start_server, otlp_endpoint=collector.url)
    cpu = shards.stubs["cpu"].tasks
    # Through cpu for gpu's pool, in the context the task is submitted in (no traceparent header).
    request = tpb.SubmitTaskRequest(pool="llm", trace=task_pb2.TraceContext(traceparent=PARENT))
    task = cpu.SubmitTask(request, metadata=bearer("full"), timeout=10).task
    spans = collector.named("cronoq.v1.TaskService/SubmitTask", 2)
    by_shard = {r["cronoq.shard"]: s for r, s in spans}
    at_cpu, at_gpu = by_shard["cpu"], by_shard["gpu"]
    assert at_cpu.trace_id.hex() == at_gpu.trace_id.hex() == TRACE_ID
    assert at_cpu.parent_span_id.hex() == "b7ad6b7169203331"
    assert at_gpu.parent_span_id == at_cpu.span_id  # the forward: a child, in the same trace
    assert at_cpu.kind == at_gpu.kind == 2  # SPAN_KIND_SERVER
    assert attributes(at_cpu) | {"rpc.grpc.status_code": 0} == {
        "rpc.system": "grpc",
        "rpc.service": "cronoq.v1.TaskService",
        "rpc.method": "SubmitTask",
        "cronoq.shard": "cpu",
        "rpc.grpc.status_code": 0,
    }
    assert {r["service.name"] for r, _ in spans} == {"cronoq-server"}
    # A caller's traceparent header parents a call; a refusal is an error span with its code.
    md = [*bearer("full"), ("traceparent", PARENT)]
    with pytest.raises(grpc.RpcError):
        cpu.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(key="missing")), metadata=md, timeout=10)
    assert cpu.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task.id)), metadata=md, timeout=10).task.id
    gets = [s for _, s in collector.named("cronoq.v1.TaskService/GetTask", 2, shard="cpu")]
    assert all(s.trace_id.hex() == TRACE_ID for s in gets)
    codes = sorted(attributes(s)["rpc.grpc.status_code"] for s in gets)
    assert codes[0] == 0 and codes[-1] == grpc.StatusCode.NOT_FOUND.value[0]
    assert any(s.status.code == 2 and "NOT_FOUND" in s.status.message for s in gets)  # STATUS_CODE_ERROR


def test_a_server_without_the_setting_sends_nothing(start_server: Any, collector: Collector, tmp_path: Path) -> None:
    srv = start_server({"store": {"path": str(tmp_path / "c.db")}, "pools": [{"name": "default"}]})
    api = Api(srv.grpc_target)
    api.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="default"), metadata=[("traceparent", PARENT)], timeout=10)
    time.sleep(1.0)
    assert collector.spans == []


class SilentCollector:
    """A loopback listener that accepts connections and never answers (a hung collector)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.listener.accept()[0])
            except OSError:  # closed
                return

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


def _calls_then_stop_seconds(srv: Any, calls: int = 300) -> float:
    """Makes calls (each a span) for about as long as an export waits, then SIGTERM: the
    seconds to the server's exit (0 expected)."""
    api = Api(srv.grpc_target)
    for i in range(calls):
        api.tasks.SubmitTask(tpb.SubmitTaskRequest(pool="default", key=f"k{i}"), timeout=10)
    time.sleep(0.7)  # past the export delay: an export to the collector is in flight
    started = time.monotonic()
    assert srv.stop(timeout=60) == 0
    return time.monotonic() - started


def test_a_collector_that_never_answers_delays_no_shutdown(start_server: Any, tmp_path: Path) -> None:
    silent = SilentCollector()
    try:
        config: dict[str, Any] = {"pools": [{"name": "default"}]}
        plain = start_server({**config, "store": {"path": str(tmp_path / "plain.db")}}, name="plain")
        baseline = _calls_then_stop_seconds(plain)
        traced = start_server(
            {**config, "store": {"path": str(tmp_path / "traced.db")}, "server": {"otlp_endpoint": silent.url}},
            name="traced",
        )
        elapsed = _calls_then_stop_seconds(traced)
        assert silent.held, "the server never connected to the collector"
        # The final flush is bounded (2 s), far from the 30 s the SDK waits by default.
        assert elapsed < baseline + 5.0, (baseline, elapsed, traced.log()[-2000:])
    finally:
        silent.close()
