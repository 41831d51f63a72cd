"""OpenTelemetry trace context, with the OpenTelemetry API (`pip install 'cronoq-sdk[otel]'`) only.

The client sends the caller's current span context with what it submits (SubmitTaskRequest.trace,
Schedule.trace), as the W3C TraceContext propagator writes it; it starts no span of its own. The
worker runs each handler in a CONSUMER span `process {pool}` of the tracer "cronoq" (from the
global tracer provider): the child of the submitting span (a schedule's fire: a new trace with a
link to the span that put the schedule). Without the API installed nothing is traced and nothing
fails; with the API but no tracer provider, the handler still runs in the submitter's span context.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from . import __version__
from .v1 import task_pb2
from .v1 import worker_service_pb2 as wpb

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed: nothing is traced
    ENABLED = False
else:
    ENABLED = True
    _PROPAGATOR = TraceContextTextMapPropagator()
    # The global provider before one is set (the proxy), or the API's no-op: their spans record nothing.
    _RECORDS_NOTHING = (otel_trace.ProxyTracerProvider, otel_trace.NoOpTracerProvider)

TRACER_NAME = "cronoq"
_NOTHING = nullcontext()
# TaskOutcome's oneof cases, each the span's cronoq.task.outcome as it is.
OUTCOMES = frozenset({"success", "failure", "snoozed", "cancelled", "released"})


def current_trace() -> task_pb2.TraceContext | None:
    """The caller's current span context as a TraceContext (traceparent, tracestate as the W3C
    propagator writes them), or None: no API, or no valid span context."""
    if not ENABLED:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)  # nothing for an invalid span context
    if not carrier.get("traceparent"):
        return None
    return task_pb2.TraceContext(traceparent=carrier["traceparent"], tracestate=carrier.get("tracestate", ""))


def set_current_trace(*messages: Any) -> None:
    """Sets the trace of each message (a SubmitTaskRequest, a Schedule) that has none to the
    current span context (none valid: left unset). One the caller set wins."""
    current = current_trace()
    if current is None:
        return
    for msg in messages:
        if not msg.HasField("trace"):
            msg.trace.CopyFrom(current)


def _remote(trace: task_pb2.TraceContext) -> otel_trace.SpanContext | None:
    """The remote span context a task's trace names (W3C propagator), or None: none, or not valid."""
    if not trace.traceparent:
        return None
    carrier = {"traceparent": trace.traceparent}
    if trace.tracestate:
        carrier["tracestate"] = trace.tracestate
    remote = otel_trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return remote if remote.is_valid else None


def start_task_span(task: task_pb2.Task) -> Any:
    """The span a task's handler runs in (None without the API): `process {pool}`, CONSUMER,
    the child of the task's trace context; a new root linked to it when the context is a
    schedule's (link); a new root when the task has none. When the tracer records nothing (no
    tracer provider), a non-recording span that carries the parent's context, if any."""
    if not ENABLED:
        return None
    remote = _remote(task.trace) if task.HasField("trace") else None
    if isinstance(otel_trace.get_tracer_provider(), _RECORDS_NOTHING):  # no span object to make
        if remote is not None and not task.trace.link:
            return otel_trace.NonRecordingSpan(remote)
        # A new root: the worker's own span context, if it has one, is not the handler's.
        return otel_trace.INVALID_SPAN if otel_trace.get_current_span().get_span_context().is_valid else None
    links = None
    if remote is not None and not task.trace.link:  # the submitting span is the parent
        parent_span = otel_trace.NonRecordingSpan(remote)
        parent = otel_trace.set_span_in_context(parent_span)
    else:  # a new root (never the worker's own current span), linked to a schedule's context
        parent_span, parent = otel_trace.INVALID_SPAN, otel_context.Context()
        if remote is not None:
            links = [otel_trace.Link(remote)]
    attributes: dict[str, Any] = {
        "cronoq.task.id": str(task.id),
        "cronoq.task.pool": task.pool,
        "cronoq.task.attempt": task.attempt,
    }
    if task.key:
        attributes["cronoq.task.key"] = task.key
    tracer = otel_trace.get_tracer(TRACER_NAME, __version__)
    span = tracer.start_span(
        f"process {task.pool}",
        context=parent,
        kind=otel_trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
    )
    if not span.get_span_context().is_valid:  # a no-op tracer that drops the parent
        span = parent_span
    return span


def active(span: Any) -> AbstractContextManager[Any]:
    """A context manager that runs its block with span as the current span (nothing without
    the API, or without a span: no generator to enter for each task)."""
    if span is None:
        return _NOTHING
    return otel_trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def end_task_span(span: Any, outcome: wpb.TaskOutcome | None) -> None:
    """Ends a task's span with its outcome (None: none reported, the lease was lost): the
    attribute cronoq.task.outcome ("lost" for None), and status ERROR with the error for a failure."""
    if span is None:
        return
    kind = outcome.WhichOneof("outcome") if outcome is not None else "lost"
    if kind in OUTCOMES or kind == "lost":
        span.set_attribute("cronoq.task.outcome", kind)
        if outcome is not None and kind == "failure":
            span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, outcome.failure.error))
    span.end()
