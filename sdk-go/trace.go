package cronoq

import (
	"context"
	"strconv"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// TracerName is the name of the tracer, from the global TracerProvider (otel.SetTracerProvider),
// whose span the worker starts for each task it runs.
const TracerName = "cronoq"

// The attributes of a worker's span.
const (
	attrTaskID      = attribute.Key("cronoq.task.id")      // decimal string
	attrTaskPool    = attribute.Key("cronoq.task.pool")    // string
	attrTaskAttempt = attribute.Key("cronoq.task.attempt") // int
	attrTaskKey     = attribute.Key("cronoq.task.key")     // string, when the task has a key
	// Set as the span ends: "success", "failure", "snoozed", "cancelled", "released", or
	// "lost" (the task's lease was lost: nothing was reported).
	attrTaskOutcome = attribute.Key("cronoq.task.outcome")
)

// maxTracestate is the most bytes of a tracestate the server accepts: a longer one is not
// sent (the traceparent still is).
const maxTracestate = 512

// w3c is the W3C Trace Context propagator: traceparent and tracestate.
var w3c propagation.TraceContext

// traceContext is the W3C trace context of ctx's current span, as the propagator injects
// it; nil when ctx has no valid span context (no trace: nothing is sent).
func traceContext(ctx context.Context) *cronoqv1.TraceContext {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	carrier := propagation.MapCarrier{}
	w3c.Inject(ctx, carrier)
	tc := &cronoqv1.TraceContext{Traceparent: carrier.Get("traceparent"), Tracestate: carrier.Get("tracestate")}
	if tc.Traceparent == "" {
		return nil
	}
	if len(tc.Tracestate) > maxTracestate {
		tc.Tracestate = ""
	}
	return tc
}

// remoteSpanContext is the span context a task's trace context names (extracted by the
// W3C propagator); invalid when it has none, or one that does not parse.
func remoteSpanContext(tc *cronoqv1.TraceContext) trace.SpanContext {
	if tc.GetTraceparent() == "" {
		return trace.SpanContext{}
	}
	carrier := propagation.MapCarrier{"traceparent": tc.GetTraceparent()}
	if ts := tc.GetTracestate(); ts != "" {
		carrier["tracestate"] = ts
	}
	return trace.SpanContextFromContext(w3c.Extract(context.Background(), carrier))
}

// startTaskSpan starts the span of one attempt of a task, "process <pool>" (kind CONSUMER),
// from the tracer TracerName of the global TracerProvider, and returns ctx with it as the
// current span. A task submitted in a trace (Task.trace, not a link) has it as its parent,
// in the same trace; a schedule's fire (link) starts a new trace linked to the schedule's
// context; a task without one starts a new trace. The trace of the ctx the worker runs in
// is never a parent. With no TracerProvider installed (the API's no-op), the span is a
// non-recording one with the parent's span context, or none.
func startTaskSpan(ctx context.Context, task *Task) (context.Context, trace.Span) {
	ctx = trace.ContextWithSpanContext(ctx, trace.SpanContext{}) // not the caller of Run's
	attrs := []attribute.KeyValue{
		attrTaskID.String(strconv.FormatUint(task.GetId(), 10)),
		attrTaskPool.String(task.GetPool()),
		attrTaskAttempt.Int(int(task.GetAttempt())),
	}
	if key := task.GetKey(); key != "" {
		attrs = append(attrs, attrTaskKey.String(key))
	}
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...)}
	remote := remoteSpanContext(task.GetTrace())
	switch {
	case remote.IsValid() && !task.GetTrace().GetLink():
		ctx = trace.ContextWithRemoteSpanContext(ctx, remote)
	case remote.IsValid():
		opts = append(opts, trace.WithNewRoot(), trace.WithLinks(trace.Link{SpanContext: remote}))
	default:
		opts = append(opts, trace.WithNewRoot())
	}
	tracer := otel.GetTracerProvider().Tracer(TracerName, trace.WithInstrumentationVersion(Version))
	return tracer.Start(ctx, "process "+task.GetPool(), opts...)
}

// endTaskSpan ends a task's span with the outcome reported (nil: none, the lease was lost);
// a failure sets the span's status to ERROR with its message.
func endTaskSpan(span trace.Span, outcome *cronoqv1.TaskOutcome) {
	name := "lost"
	switch o := outcome.GetOutcome().(type) {
	case *cronoqv1.TaskOutcome_Success:
		name = "success"
	case *cronoqv1.TaskOutcome_Failure:
		name = "failure"
		span.SetStatus(otelcodes.Error, o.Failure.GetError())
	case *cronoqv1.TaskOutcome_Snoozed:
		name = "snoozed"
	case *cronoqv1.TaskOutcome_Cancelled:
		name = "cancelled"
	case *cronoqv1.TaskOutcome_Released:
		name = "released"
	}
	span.SetAttributes(attrTaskOutcome.String(name))
	span.End()
}
