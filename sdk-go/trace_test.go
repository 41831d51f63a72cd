package cronoq

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// recordSpans installs a tracer provider (the OpenTelemetry SDK) whose spans are kept in
// memory, for the test; the API's no-op provider afterwards.
func recordSpans(t *testing.T) *tracetest.InMemoryExporter {
	t.Helper()
	exporter := tracetest.NewInMemoryExporter()
	provider := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	otel.SetTracerProvider(provider)
	t.Cleanup(func() {
		otel.SetTracerProvider(noop.NewTracerProvider())
		_ = provider.Shutdown(context.Background())
	})
	return exporter
}

// taskSpans are the worker's spans recorded: "process default", in the order they ended.
func taskSpans(exporter *tracetest.InMemoryExporter) []tracetest.SpanStub {
	var spans []tracetest.SpanStub
	for _, s := range exporter.GetSpans() {
		if s.Name == "process default" {
			spans = append(spans, s)
		}
	}
	return spans
}

func attrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

func traceparent(sc trace.SpanContext) string {
	return fmt.Sprintf("00-%s-%s-%s", sc.TraceID(), sc.SpanID(), sc.TraceFlags())
}

// contextRecorder records the span context current in each handler, by attempt.
type contextRecorder struct {
	mu    sync.Mutex
	seen  map[uint64]trace.SpanContext // task id -> the last attempt's
	byRun []trace.SpanContext
}

func (r *contextRecorder) record(ctx context.Context, task *Task) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.seen == nil {
		r.seen = map[uint64]trace.SpanContext{}
	}
	sc := trace.SpanContextFromContext(ctx)
	r.seen[task.GetId()] = sc
	r.byRun = append(r.byRun, sc)
}

func (r *contextRecorder) get(id uint64) trace.SpanContext {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.seen[id]
}

func TestTraceGoesFromTheSubmitToTheHandlerOfEveryAttempt(t *testing.T) {
	exporter := recordSpans(t)
	srv := &opsServer{}
	client := opsClient(t, srv)
	ctx, submit := otel.Tracer("test").Start(context.Background(), "submit")
	if _, err := client.Submit(ctx, TaskSpec{Pool: "default", Key: "k-1"}); err != nil {
		t.Fatal(err)
	}
	sent := srv.last().(*cronoqv1.SubmitTaskRequest).GetTrace()
	if want := traceparent(submit.SpanContext()); sent.GetTraceparent() != want || sent.GetTracestate() != "" || sent.GetLink() {
		t.Fatalf("SubmitTask trace %v, want traceparent %s", sent, want)
	}
	if _, err := client.SubmitBatch(ctx, []TaskSpec{{Pool: "default"}, {Pool: "default"}}); err != nil {
		t.Fatal(err)
	}
	for i, task := range srv.last().(*cronoqv1.SubmitBatchRequest).GetTasks() {
		if task.GetTrace().GetTraceparent() != sent.GetTraceparent() {
			t.Errorf("batch task %d: trace %v, want %v", i, task.GetTrace(), sent)
		}
	}
	submit.End()
	if _, err := client.Submit(context.Background(), TaskSpec{Pool: "default"}); err != nil {
		t.Fatal(err)
	}
	if tc := srv.last().(*cronoqv1.SubmitTaskRequest).GetTrace(); tc != nil {
		t.Errorf("an untraced submit sent trace %v", tc)
	}

	// The server gives the task back with the trace it stored: attempt 1 fails, attempt 2
	// (the retry) succeeds.
	attempt := func(n int32) *cronoqv1.Task {
		task := jsonTask(7, `{}`)
		task.Attempt, task.Key, task.Trace = n, "k-1", sent
		return task
	}
	srvW := newWorkServer(attempt(1), attempt(2))
	seen := &contextRecorder{}
	// No prefetch: the fake would send attempt 2 before attempt 1's outcome, as no server does.
	w, done := startWorker(t, srvW, WorkerOptions{Concurrency: 1, Prefetch: NoPrefetch}, func(ctx context.Context, task *Task) (any, error) {
		seen.record(ctx, task)
		if task.GetAttempt() == 1 {
			return nil, errors.New("boom")
		}
		return "ok", nil
	})
	waitFor(t, "both attempts' outcomes", func() bool { return w.Processed() == 2 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	spans := taskSpans(exporter)
	if len(spans) != 2 {
		t.Fatalf("%d task spans, want 2: %v", len(spans), spans)
	}
	for i, s := range spans {
		n := int64(i + 1)
		if s.SpanContext.TraceID() != submit.SpanContext().TraceID() || s.Parent.SpanID() != submit.SpanContext().SpanID() || !s.Parent.IsRemote() {
			t.Errorf("attempt %d: trace %s parent %s, want the submit's %s %s", n, s.SpanContext.TraceID(), s.Parent.SpanID(),
				submit.SpanContext().TraceID(), submit.SpanContext().SpanID())
		}
		if s.SpanKind != trace.SpanKindConsumer || s.InstrumentationScope.Name != "cronoq" || s.InstrumentationScope.Version != Version {
			t.Errorf("attempt %d: kind %v, scope %v", n, s.SpanKind, s.InstrumentationScope)
		}
		a := attrs(s)
		if a["cronoq.task.id"].AsString() != "7" || a["cronoq.task.pool"].AsString() != "default" ||
			a["cronoq.task.attempt"].AsInt64() != n || a["cronoq.task.key"].AsString() != "k-1" {
			t.Errorf("attempt %d: attributes %v", n, s.Attributes)
		}
		if len(s.Links) != 0 {
			t.Errorf("attempt %d: links %v", n, s.Links)
		}
	}
	if a := attrs(spans[0]); a["cronoq.task.outcome"].AsString() != "failure" || spans[0].Status.Code != otelcodes.Error ||
		spans[0].Status.Description != "boom" {
		t.Errorf("attempt 1: outcome %v, status %v; want failure, ERROR boom", a["cronoq.task.outcome"], spans[0].Status)
	}
	if a := attrs(spans[1]); a["cronoq.task.outcome"].AsString() != "success" || spans[1].Status.Code == otelcodes.Error {
		t.Errorf("attempt 2: outcome %v, status %v; want success", a["cronoq.task.outcome"], spans[1].Status)
	}
	// Each handler ran with its span as the current one.
	for i, sc := range seen.byRun {
		if !sc.Equal(spans[i].SpanContext) {
			t.Errorf("attempt %d: the handler's span context %v, want its span's %v", i+1, sc, spans[i].SpanContext)
		}
	}
}

func TestTraceOfAScheduleFireIsALinkAndATaskWithoutOneIsANewTrace(t *testing.T) {
	exporter := recordSpans(t)
	remote := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	fired := jsonTask(1, `{}`)
	fired.Trace = &cronoqv1.TraceContext{Traceparent: remote, Tracestate: "vendor=abc", Link: true}
	plain := jsonTask(2, `{}`)
	plain.TimeoutMs = 60_000
	srv := newWorkServer(fired, plain)
	var hadContext sync.Map
	// The ctx Run gets has a span of its own: it is no task's parent.
	runCtx, run := otel.Tracer("test").Start(context.Background(), "run")
	defer run.End()
	w, done := startWorkerIn(t, runCtx, srv, WorkerOptions{Concurrency: 1}, func(ctx context.Context, task *Task) (any, error) {
		hadContext.Store(task.GetId(), TaskContextFrom(ctx) != nil)
		if task.GetId() == 1 {
			return nil, Snooze(time.Second, "later")
		}
		return nil, nil
	})
	waitFor(t, "both outcomes", func() bool { return w.Processed() == 2 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	spans := taskSpans(exporter)
	if len(spans) != 2 {
		t.Fatalf("%d task spans, want 2", len(spans))
	}
	link, root := spans[0], spans[1]
	if attrs(link)["cronoq.task.id"].AsString() != "1" {
		link, root = root, link
	}
	remoteTrace := "0af7651916cd43dd8448eb211c80319c"
	if link.Parent.IsValid() || link.SpanContext.TraceID().String() == remoteTrace || link.SpanContext.TraceID() == run.SpanContext().TraceID() {
		t.Errorf("the fired task's span: parent %v, trace %s; want a new root", link.Parent, link.SpanContext.TraceID())
	}
	if len(link.Links) != 1 || link.Links[0].SpanContext.TraceID().String() != remoteTrace ||
		link.Links[0].SpanContext.SpanID().String() != "b7ad6b7169203331" || link.Links[0].SpanContext.TraceState().String() != "vendor=abc" {
		t.Errorf("the fired task's links %v, want one to the schedule's context", link.Links)
	}
	if got := attrs(link)["cronoq.task.outcome"].AsString(); got != "snoozed" || link.Status.Code == otelcodes.Error {
		t.Errorf("the snoozed task's outcome %q, status %v", got, link.Status)
	}
	if root.Parent.IsValid() || len(root.Links) != 0 || root.SpanContext.TraceID() == run.SpanContext().TraceID() {
		t.Errorf("the task without a trace: parent %v, links %v; want a new root", root.Parent, root.Links)
	}
	if _, ok := attrs(root)["cronoq.task.key"]; ok {
		t.Error("a task without a key has the attribute cronoq.task.key")
	}
	for _, id := range []uint64{1, 2} {
		if had, _ := hadContext.Load(id); had != true {
			t.Errorf("task %d: no TaskContext in the handler's ctx", id)
		}
	}
}

func TestTraceWithoutATracerProviderIsTheRemoteParents(t *testing.T) {
	otel.SetTracerProvider(noop.NewTracerProvider()) // the API's no-op, as with none installed
	remote := &cronoqv1.TraceContext{Traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	child, fired, plain := jsonTask(1, `{}`), jsonTask(2, `{}`), jsonTask(3, `{}`)
	child.Trace = remote
	fired.Trace = &cronoqv1.TraceContext{Traceparent: remote.Traceparent, Link: true}
	srv := newWorkServer(child, fired, plain)
	seen := &contextRecorder{}
	// The ctx Run gets is in a trace of its own: no task's handler runs in it.
	tid, _ := trace.TraceIDFromHex("11111111111111111111111111111111")
	sid, _ := trace.SpanIDFromHex("2222222222222222")
	runCtx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid}))
	w, done := startWorkerIn(t, runCtx, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		seen.record(ctx, task)
		return nil, nil
	})
	waitFor(t, "3 outcomes", func() bool { return w.Processed() == 3 })
	w.Stop()
	<-done
	want := remoteSpanContext(remote)
	if sc := seen.get(1); !sc.Equal(want) || !sc.IsRemote() {
		t.Errorf("the handler's span context %v, want the remote parent's %v", sc, want)
	}
	if sc := seen.get(2); sc.IsValid() {
		t.Errorf("a fired task (link) ran in %v, want no span context", sc)
	}
	if sc := seen.get(3); sc.IsValid() {
		t.Errorf("a task without a trace ran in %v, want no span context", sc)
	}
}

func TestTraceContextSentIsTheW3COne(t *testing.T) {
	tid, _ := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	sid, _ := trace.SpanIDFromHex("b7ad6b7169203331")
	state, _ := trace.ParseTraceState("vendor=abc,other=x")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceState: state, Remote: true})
	got := traceContext(trace.ContextWithRemoteSpanContext(context.Background(), sc))
	if got.GetTraceparent() != "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00" || got.GetTracestate() != "vendor=abc,other=x" {
		t.Errorf("an unsampled context: %v", got)
	}
	if back := remoteSpanContext(got); !back.Equal(sc) {
		t.Errorf("extracted back: %v, want %v", back, sc)
	}
	// A tracestate over the 512 bytes the server accepts is left out, not the trace.
	var long trace.TraceState
	for i := range 20 {
		long, _ = long.Insert(fmt.Sprintf("k%d", i), fmt.Sprintf("%040d", i))
	}
	got = traceContext(trace.ContextWithRemoteSpanContext(context.Background(), sc.WithTraceState(long)))
	if got.GetTraceparent() == "" || got.GetTracestate() != "" {
		t.Errorf("a tracestate of %d bytes: %v", len(long.String()), got)
	}
	if got := traceContext(context.Background()); got != nil {
		t.Errorf("no span context: %v", got)
	}
}
