"""The Python SDK's trace context end to end with real servers: a task submitted inside a span
through the Client is run by a real cronoq.Worker (in this process) in a handler span that is
that span's child, at every attempt (a retry keeps it); a task of gpu's pool submitted through
cpu runs in the submitting span's trace. The test process's tracer provider is
opentelemetry-sdk's, with an in-memory exporter."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from test_sharding import TOKENS, TwoShards

import cronoq

SUCCEEDED = cronoq.TaskState.Value("TASK_STATE_SUCCEEDED")
FAST = cronoq.RetryConfig(initial_backoff=0.02, max_backoff=0.2, max_elapsed=None)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The global tracer provider for this test: opentelemetry-sdk's, its spans kept in memory.
    (The API sets the global once per process, so it is swapped as OpenTelemetry's own test
    utilities do.)"""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


@contextlib.asynccontextmanager
async def running(worker: cronoq.Worker) -> AsyncIterator[None]:
    run = asyncio.create_task(worker.run())
    try:
        yield
    finally:
        worker.stop()
        await asyncio.wait_for(run, 30)


def handler_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return sorted(
        (s for s in exporter.get_finished_spans() if s.name.startswith("process ")),
        key=lambda s: (s.attributes or {}).get("cronoq.task.attempt", 0),  # type: ignore[arg-type,return-value]
    )


class Handler:
    """Fails the first attempt (retryable), succeeds after; records the span context current in it."""

    def __init__(self) -> None:
        self.contexts: list[trace.SpanContext] = []

    async def __call__(self, ctx: cronoq.TaskContext) -> Any:
        self.contexts.append(trace.get_current_span().get_span_context())
        if ctx.attempt == 1 and ctx.payload.get("fail_first"):
            raise cronoq.TaskError("the first attempt fails", retryable=True)
        return {"attempt": ctx.attempt}


async def test_the_handler_runs_in_the_submitting_spans_trace_at_every_attempt(
    start_server: Any, spans: InMemorySpanExporter
) -> None:
    server = start_server({"pools": [{"name": "default", "retry_backoff": "10ms", "retry_backoff_max": "50ms"}]})
    handler = Handler()
    async with cronoq.Client(server.endpoint) as client:
        with trace.get_tracer("shop").start_as_current_span("checkout") as parent:
            sub = await client.submit("default", {"fail_first": True}, key="order-1", max_attempts=3)
        assert sub.task.trace.traceparent.startswith(f"00-{parent.get_span_context().trace_id:032x}-")
        async with running(cronoq.Worker(server.endpoint, "default", handler, retry=FAST)):
            done = await client.wait(sub.task.id, timeout=20)
        assert (done.done, done.task.state, done.task.attempt) == (True, SUCCEEDED, 2)

    submitting = parent.get_span_context()
    first, second = handler_spans(spans)
    for span, attempt, context in ((first, 1, handler.contexts[0]), (second, 2, handler.contexts[1])):
        assert span.name == "process default" and span.kind == SpanKind.CONSUMER
        assert span.context is not None and span.context.trace_id == submitting.trace_id  # one trace
        assert span.parent is not None and span.parent.span_id == submitting.span_id  # the same parent
        assert context == span.context  # the handler ran with its span current
        assert {k: v for k, v in (span.attributes or {}).items() if k != "cronoq.task.outcome"} == {
            "cronoq.task.id": str(sub.task.id),
            "cronoq.task.pool": "default",
            "cronoq.task.attempt": attempt,
            "cronoq.task.key": "order-1",
        }
    assert first.attributes is not None and first.attributes["cronoq.task.outcome"] == "failure"
    assert (first.status.status_code, first.status.description) == (StatusCode.ERROR, "the first attempt fails")
    assert second.attributes is not None and second.attributes["cronoq.task.outcome"] == "success"


async def test_a_task_submitted_through_another_shard_runs_in_the_submitting_spans_trace(
    tmp_path: Path, start_server: Any, spans: InMemorySpanExporter
) -> None:
    shards = TwoShards(tmp_path, start_server)
    token = TOKENS["full"]
    handler = Handler()
    async with cronoq.Client(shards.cpu.endpoint, token=token) as client:
        with trace.get_tracer("shop").start_as_current_span("render") as parent:
            sub = await client.submit("llm", {}, key="gpu-job")  # gpu's pool, through cpu
        assert sub.task.id >> 56 == 2  # stored by gpu
        # A worker given cpu's endpoint is sent to gpu, which serves llm.
        worker = cronoq.Worker(shards.cpu.endpoint, "llm", handler, token=token, retry=FAST)
        async with running(worker):
            done = await client.wait(sub.task.id, timeout=20)
        assert (done.done, done.task.state) == (True, SUCCEEDED)
        assert worker.endpoint.port == shards.gpu.grpc_port

    (span,) = handler_spans(spans)
    submitting = parent.get_span_context()
    assert span.name == "process llm" and span.kind == SpanKind.CONSUMER
    assert span.context is not None and span.context.trace_id == submitting.trace_id
    assert span.parent is not None and span.parent.span_id == submitting.span_id
    assert handler.contexts == [span.context]
    assert span.attributes is not None and span.attributes["cronoq.task.outcome"] == "success"
