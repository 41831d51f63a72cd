"""OpenTelemetry trace context in the Python SDK, against the fake servers of the client and
worker tests, with opentelemetry-sdk's in-memory exporter as the tracer provider: the client
sends the caller's span context with what it submits (and starts no span); the worker runs each
handler in a CONSUMER span `process {pool}` that is the submitting span's child, attempt after
attempt; a schedule's fire is a new trace linked to it; without a tracer provider the handler
still runs in the submitter's span context; without the API installed nothing is traced."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import cronoq
from cronoq import _tracing
from cronoq.v1 import task_pb2

from .test_sdk_client import FakeTaskStub, client_with
from .test_sdk_worker import FakeWorkerService, make_worker, stop, task, until

REMOTE_TRACE = "0af7651916cd43dd8448eb211c80319c"
REMOTE_SPAN = "b7ad6b7169203331"
PARENT = f"00-{REMOTE_TRACE}-{REMOTE_SPAN}-01"


def set_global_provider(monkeypatch: pytest.MonkeyPatch, provider: trace.TracerProvider) -> None:
    """The global tracer provider for one test. The API sets it once per process
    (set_tracer_provider), so tests swap it as OpenTelemetry's own test utilities do."""
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """A recording tracer provider (the global one) whose finished spans are kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    set_global_provider(monkeypatch, provider)
    yield exporter
    provider.shutdown()


class InvalidSpanTracer(trace.NoOpTracer):
    """The no-op tracer of older API versions: an invalid span, whatever the parent."""

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return trace.INVALID_SPAN


class InvalidSpanTracerProvider(trace.NoOpTracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return InvalidSpanTracer()


@pytest.fixture(params=["unset", "no-op", "invalid-span"])
def no_provider(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracer provider installed: none set (the API's proxy), or the API's no-op, as this
    version or an older one has it."""
    monkeypatch.delenv("OTEL_PYTHON_TRACER_PROVIDER", raising=False)
    providers = {"unset": None, "no-op": trace.NoOpTracerProvider(), "invalid-span": InvalidSpanTracerProvider()}
    set_global_provider(monkeypatch, providers[request.param])  # type: ignore[arg-type]


def handler_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith("process ")]


def traceparent_of(context: trace.SpanContext) -> str:
    """As the W3C propagator writes it."""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def remote_context(traceparent: str = PARENT, tracestate: str = "") -> otel_context.Context:
    carrier = {"traceparent": traceparent, **({"tracestate": tracestate} if tracestate else {})}
    return TraceContextTextMapPropagator().extract(carrier)


class Seen:
    """A handler that records the span context current in it, per (task id, attempt); it fails
    attempts whose payload says so (retryable) and snoozes those that ask."""

    def __init__(self) -> None:
        self.contexts: dict[tuple[int, int], trace.SpanContext] = {}

    async def __call__(self, ctx: cronoq.TaskContext) -> Any:
        self.contexts[ctx.id, ctx.attempt] = trace.get_current_span().get_span_context()
        payload = ctx.payload or {}
        if ctx.attempt in payload.get("fail_attempts", []):
            raise cronoq.TaskError(f"attempt {ctx.attempt} failed")
        if payload.get("snooze"):
            raise cronoq.Snooze(1, reason="later")
        return "ok"


async def run_until(fake: FakeWorkerService, handler: Any, outcomes: int, **options: Any) -> cronoq.Worker:
    worker = make_worker(fake, handler, **options)
    running = asyncio.create_task(worker.run())
    reported = lambda: sum(len(kinds) for _, kinds in fake.reports)  # noqa: E731
    await until(lambda: reported() >= outcomes, what=f"{outcomes} outcomes reported", running=running)
    await stop(worker, running)
    return worker


# -- the client ------------------------------------------------------------------------


async def test_submit_sends_the_current_span_context_and_starts_no_span(spans: InMemorySpanExporter) -> None:
    stub = FakeTaskStub(failures=1)  # a transport retry sends the same context
    client = client_with(stub)
    tracer = trace.get_tracer("app")
    with tracer.start_as_current_span("checkout") as parent:
        await client.submit("default", {"n": 1})
    want = traceparent_of(parent.get_span_context())
    assert [(r.trace.traceparent, r.trace.tracestate, r.trace.link) for r in stub.requests] == [(want, "", False)] * 2
    assert [s.name for s in spans.get_finished_spans()] == ["checkout"]  # the client's call made none

    await client.submit("default", {"n": 2})  # outside any span: no trace
    assert not stub.requests[-1].HasField("trace")


async def test_batch_and_schedule_carry_the_context_and_a_given_one_wins(no_provider: None) -> None:
    stub = FakeTaskStub(failures=0)
    client = client_with(stub)
    own = task_pb2.TraceContext(traceparent="00-11111111111111111111111111111111-2222222222222222-00")
    token = otel_context.attach(remote_context(tracestate="vendor=abc"))  # a remote span, no tracer provider
    try:
        await client.submit("default", key="given", trace=own)
        await client.submit_batch([cronoq.task_spec("default"), cronoq.task_spec("default", trace=own)])
        await client.put_schedule("default", "nightly", "0 2 * * *")
        await client.put_schedule("default", "hourly", "0 * * * *", trace=own)
    finally:
        otel_context.detach(token)
    current = task_pb2.TraceContext(traceparent=PARENT, tracestate="vendor=abc")
    one, batch, nightly, hourly = stub.requests
    assert one.trace == own
    assert [t.trace for t in batch.tasks] == [current, own]
    assert (nightly.schedule.trace, hourly.schedule.trace) == (current, own)


def test_the_sync_client_sends_the_callers_span_context(spans: InMemorySpanExporter) -> None:
    stub = FakeTaskStub(failures=0)
    with cronoq.SyncClient("http://127.0.0.1:1") as client:
        client._client._conn._stub = stub
        with trace.get_tracer("app").start_as_current_span("sync") as parent:
            client.submit("default")
    assert stub.requests[0].trace.traceparent == traceparent_of(parent.get_span_context())


# -- the worker --------------------------------------------------------------------------


async def test_the_handler_span_is_the_submitting_spans_child_attempt_after_attempt(
    spans: InMemorySpanExporter,
) -> None:
    stub = FakeTaskStub(failures=0)
    with trace.get_tracer("app").start_as_current_span("checkout") as parent:
        await client_with(stub).submit("default", {"fail_attempts": [1]}, key="order-1")
    recorded = stub.requests[0].trace  # what the server stores and gives back with every lease
    fake = FakeWorkerService()
    fake.script = [
        [task(1, {"fail_attempts": [1]}, attempt=1, key="order-1", trace=recorded)],
        [task(1, {"fail_attempts": [1]}, attempt=2, key="order-1", trace=recorded)],  # the retry
    ]
    seen = Seen()
    await run_until(fake, seen, outcomes=2, concurrency=1)

    first, second = sorted(handler_spans(spans), key=lambda s: s.attributes["cronoq.task.attempt"])  # type: ignore[index]
    submitting = parent.get_span_context()
    for span, attempt in ((first, 1), (second, 2)):
        assert span.name == "process default" and span.kind == SpanKind.CONSUMER
        assert span.instrumentation_scope is not None and span.instrumentation_scope.name == "cronoq"
        assert span.context is not None and span.context.trace_id == submitting.trace_id
        assert span.parent is not None and span.parent.span_id == submitting.span_id
        assert span.links == ()
        assert seen.contexts[1, attempt] == span.context  # the handler ran with it current
    assert dict(first.attributes or {}) == {
        "cronoq.task.id": "1",
        "cronoq.task.pool": "default",
        "cronoq.task.attempt": 1,
        "cronoq.task.key": "order-1",
        "cronoq.task.outcome": "failure",
    }
    assert (first.status.status_code, first.status.description) == (StatusCode.ERROR, "attempt 1 failed")
    assert dict(second.attributes or {})["cronoq.task.outcome"] == "success"
    assert second.attributes is not None and second.attributes["cronoq.task.attempt"] == 2
    assert second.status.status_code == StatusCode.UNSET


async def test_a_schedule_fire_is_a_new_trace_linked_to_its_context_and_an_untraced_task_a_root(
    spans: InMemorySpanExporter,
) -> None:
    fake = FakeWorkerService()
    fired = task_pb2.TraceContext(traceparent=PARENT, tracestate="vendor=abc", link=True)
    fake.script = [[task(1, {}, trace=fired), task(2, {"snooze": True})]]
    seen = Seen()
    # The worker runs inside a span of its own: a task's span never takes it as its parent.
    with trace.get_tracer("app").start_as_current_span("the worker's process"):
        await run_until(fake, seen, outcomes=2, concurrency=2)

    by_id = {s.attributes["cronoq.task.id"]: s for s in handler_spans(spans)}  # type: ignore[index]
    linked, untraced = by_id["1"], by_id["2"]
    assert linked.parent is None and untraced.parent is None  # roots
    assert linked.context is not None and f"{linked.context.trace_id:032x}" != REMOTE_TRACE  # a new trace
    (link,) = linked.links
    assert (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") == (REMOTE_TRACE, REMOTE_SPAN)
    assert link.context.trace_state.to_header() == "vendor=abc"
    assert untraced.links == ()
    assert seen.contexts[1, 1] == linked.context and seen.contexts[2, 1] == untraced.context
    assert linked.attributes is not None and linked.attributes["cronoq.task.outcome"] == "success"
    assert untraced.attributes is not None and untraced.attributes["cronoq.task.outcome"] == "snoozed"
    assert "cronoq.task.key" not in untraced.attributes  # no key: no attribute
    assert untraced.status.status_code == StatusCode.UNSET


async def test_a_cancelled_task_and_a_lost_lease_end_their_spans(spans: InMemorySpanExporter) -> None:
    fake = FakeWorkerService(
        cronoq.v1.worker_service_pb2.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_ms=50)
    )
    fake.script = [[task(1, trace=task_pb2.TraceContext(traceparent=PARENT)), task(2)]]

    async def sleep(ctx: cronoq.TaskContext) -> Any:
        await asyncio.sleep(3600)

    worker = make_worker(fake, sleep, concurrency=2)
    running = asyncio.create_task(worker.run())
    await until(lambda: fake.heartbeats, what="a heartbeat", running=running)
    fake.heartbeat_cancels, fake.heartbeat_losts = [1], [2]
    await until(lambda: len(handler_spans(spans)) == 2, what="both spans ended", running=running)
    await stop(worker, running)
    by_id = {s.attributes["cronoq.task.id"]: s for s in handler_spans(spans)}  # type: ignore[index]
    assert by_id["1"].attributes is not None and by_id["1"].attributes["cronoq.task.outcome"] == "cancelled"
    assert by_id["2"].attributes is not None and by_id["2"].attributes["cronoq.task.outcome"] == "lost"  # none reported


async def test_without_a_tracer_provider_the_handler_runs_in_the_submitters_span_context(no_provider: None) -> None:
    fake = FakeWorkerService()
    fake.script = [
        [
            task(1, {}, trace=task_pb2.TraceContext(traceparent=PARENT, tracestate="vendor=abc")),
            task(2, {}, trace=task_pb2.TraceContext(traceparent=PARENT, link=True)),
            task(3, {}),
        ]
    ]
    seen = Seen()
    token = otel_context.attach(remote_context("00-99999999999999999999999999999999-8888888888888888-01"))
    try:  # the worker's own context, which no task's handler sees
        await run_until(fake, seen, outcomes=3, concurrency=3)
    finally:
        otel_context.detach(token)
    child = seen.contexts[1, 1]
    assert child.is_valid and child.is_remote
    assert (f"{child.trace_id:032x}", f"{child.span_id:016x}") == (REMOTE_TRACE, REMOTE_SPAN)
    assert child.trace_state.to_header() == "vendor=abc"
    assert not seen.contexts[2, 1].is_valid  # a schedule's fire: outside the trace
    assert not seen.contexts[3, 1].is_valid  # no trace


# -- without the API ---------------------------------------------------------------------


async def test_with_tracing_off_nothing_is_traced_and_nothing_fails(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_tracing, "ENABLED", False)  # as when opentelemetry-api is not installed
    stub = FakeTaskStub(failures=0)
    with trace.get_tracer("app").start_as_current_span("checkout"):
        await client_with(stub).submit("default")
    assert not stub.requests[0].HasField("trace")
    fake = FakeWorkerService()
    fake.script = [[task(1, {}, trace=task_pb2.TraceContext(traceparent=PARENT))]]
    seen = Seen()
    await run_until(fake, seen, outcomes=1)
    assert fake.outcomes[1].WhichOneof("outcome") == "success"
    assert handler_spans(spans) == [] and not seen.contexts[1, 1].is_valid


def test_the_sdk_imports_and_works_without_the_opentelemetry_api() -> None:
    code = """
import sys
sys.modules["opentelemetry"] = None  # as if not installed: importing it raises ImportError
import asyncio
import cronoq
from cronoq import _tracing
from cronoq.v1 import task_pb2
assert cronoq.Worker and cronoq.Client and _tracing.ENABLED is False
spec = cronoq.task_spec("default", {"n": 1})
_tracing.set_current_trace(spec)
assert not spec.HasField("trace")
span = _tracing.start_task_span(task_pb2.Task(id=1, pool="default", trace=task_pb2.TraceContext(traceparent="x")))
assert span is None
with _tracing.active(span):
    pass
_tracing.end_task_span(span, None)
assert not any(m == "opentelemetry" or m.startswith("opentelemetry.") for m in sys.modules if sys.modules[m])
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
