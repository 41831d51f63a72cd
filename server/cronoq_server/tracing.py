"""The server's own spans, sent over OTLP/HTTP when `[server] otlp_endpoint` is set (off by
default; the `otel` extra: `pip install 'cronoq-server[otel]'`).

One SERVER span per unary API call (gRPC or HTTP), named as gRPC names the method
(`cronoq.v1.TaskService/SubmitTask`), with the shard and the outcome's gRPC code. Its parent is
the caller's W3C `traceparent` (gRPC metadata or HTTP header) or, for a submission without one,
the trace context the task is submitted in; a call forwarded to another shard carries this
span's context, so the other shard's span is its child. Without the setting nothing is
imported and a span costs one attribute read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import ApiError

log = logging.getLogger("cronoq.tracing")

# The span processor's delay between exports (ms): short, so a span shows within a second.
EXPORT_DELAY_MS = 500
# One export gives up after this (the SDK's default is 10 s), so a collector that accepts and
# never answers holds no export, and no shutdown, longer.
EXPORT_TIMEOUT_S = 2.0
# Spans waiting to be sent: while the collector is slow or away the oldest are dropped, so
# memory stays bounded (the SDK's default holds 2048).
MAX_QUEUED_SPANS = 512
MAX_EXPORT_BATCH = 256
# At shutdown the spans still held are sent within this, or dropped: a stop must end well
# within the systemd unit's TimeoutStopSec (30 s).
FINAL_FLUSH_S = 2.0


class _Tracing:
    """The tracer and what it needs, built only when tracing is configured."""

    def __init__(self, endpoint: str, shard: str):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context, use_span
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": "cronoq-server", "cronoq.shard": shard})
        # No exit hook of the SDK's own: shutdown_tracing bounds the final flush.
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces", timeout=EXPORT_TIMEOUT_S)
        processor = BatchSpanProcessor(
            exporter,
            max_queue_size=MAX_QUEUED_SPANS,
            schedule_delay_millis=EXPORT_DELAY_MS,
            max_export_batch_size=MAX_EXPORT_BATCH,
        )
        self.provider.add_span_processor(processor)
        self.endpoint = endpoint
        self.tracer = self.provider.get_tracer("cronoq-server")
        self.propagator = TraceContextTextMapPropagator()
        self.shard = shard
        self.server_kind = SpanKind.SERVER
        self.error = lambda text: Status(StatusCode.ERROR, text)
        self.use_span = use_span
        self.set_span_in_context = set_span_in_context


_tracing: _Tracing | None = None


def setup_tracing(endpoint: str | None, shard: str) -> None:
    """Sends this server's spans to endpoint (None: no spans). Raises RuntimeError naming the
    extra when the OpenTelemetry SDK is not installed."""
    global _tracing
    if not endpoint:
        _tracing = None
        return
    try:
        _tracing = _Tracing(endpoint, shard)
    except ImportError as err:
        raise RuntimeError(
            f"server.otlp_endpoint is set but the OpenTelemetry SDK is not installed ({err.name}): "
            "pip install 'cronoq-server[otel]'"
        ) from None
    log.info("tracing: spans of each API call go to %s/v1/traces", endpoint.rstrip("/"))


def shutdown_tracing() -> None:
    """Sends the spans still held (on shutdown), within FINAL_FLUSH_S: the SDK's own shutdown
    waits up to 30 s for a collector that does not answer, so it runs on a daemon thread that
    the exit does not wait for beyond that."""
    if _tracing is None:
        return
    flush = threading.Thread(target=_tracing.provider.shutdown, name="cronoq-tracing-flush", daemon=True)
    flush.start()
    flush.join(FINAL_FLUSH_S)
    if flush.is_alive():
        log.warning(
            "tracing: spans not sent within %gs of stopping are dropped (%s/v1/traces did not answer)",
            FINAL_FLUSH_S,
            _tracing.endpoint.rstrip("/"),
        )


@contextmanager
def rpc_span(service: str, method: str, traceparent: str, tracestate: str = "") -> Iterator[None]:
    """A SERVER span around one API call, the caller's context its parent (see the module)."""
    if _tracing is None:
        yield
        return
    t = _tracing
    carrier = {"traceparent": traceparent, "tracestate": tracestate} if traceparent else {}
    parent = t.propagator.extract(carrier)
    attributes: dict[str, Any] = {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": method,
        "cronoq.shard": t.shard,
    }
    span = t.tracer.start_span(f"{service}/{method}", context=parent, kind=t.server_kind, attributes=attributes)
    code = 0
    try:
        with t.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield
    except ApiError as err:
        code = err.code.value[0]
        span.set_status(t.error(f"{err.code.name}: {err.message}"))
        raise
    except BaseException as err:
        code = 1 if type(err).__name__ == "CancelledError" else 13  # CANCELLED, INTERNAL
        span.set_status(t.error(type(err).__name__))
        raise
    finally:
        span.set_attribute("rpc.grpc.status_code", code)
        span.end()


def trace_metadata() -> list[tuple[str, str]]:
    """The current span's context, for a call forwarded to a peer: its span is this one's child."""
    if _tracing is None:
        return []
    carrier: dict[str, str] = {}
    _tracing.propagator.inject(carrier)
    return list(carrier.items())
