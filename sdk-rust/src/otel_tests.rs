//! The `otel` feature: the trace context a submit sends, and the span each task runs in, with
//! an in-memory exporter (or none: the API's no-op), against the fakes of the client's and
//! the worker's tests.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId,
    TraceState, Tracer as _, noop::NoopTracerProvider,
};
use opentelemetry::{Context, KeyValue, Value, global};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};

use crate::client_tests::{self, Call};
use crate::otel::{extract, inject};
use crate::proto;
use crate::worker_tests::{FakeShard, options, outcomes, run_until, serve, task};
use crate::{
    CancellationToken, Client, ScheduleSpec, Task, TaskContext, TaskError, TaskResult, TaskSpec,
    Worker, WorkerOptions,
};

/// The global tracer provider is the process's: the tests that set it take turns.
static GLOBAL_PROVIDER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Installs a global tracer provider that keeps the spans ended in memory.
fn install_provider() -> InMemorySpanExporter {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    global::set_tracer_provider(provider);
    exporter
}

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn remote() -> SpanContext {
    SpanContext::new(
        TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
        SpanId::from_hex("b7ad6b7169203331").unwrap(),
        TraceFlags::SAMPLED,
        true,
        "vendor=abc".parse().unwrap(),
    )
}

fn traced(id: u64, link: bool) -> Task {
    Task {
        trace: Some(proto::TraceContext {
            traceparent: TRACEPARENT.into(),
            tracestate: "vendor=abc".into(),
            link,
        }),
        ..task(id, 0)
    }
}

/// The span contexts current in the handler, per task id and attempt: in its synchronous part
/// (the call) and in its future.
type Seen = Arc<Mutex<Vec<(u64, i32, SpanContext, SpanContext)>>>;

/// Runs the tasks with one handler at a time until `n` outcomes are reported: a task whose
/// payload is "fail" fails at attempt 1, "snooze" snoozes, anything else returns. What the
/// handlers saw.
async fn run(tasks: Vec<Task>, n: usize) -> Seen {
    let seen = Seen::default();
    let shard = FakeShard::with_tasks(tasks);
    let recorded = shard.recorded.clone();
    let endpoint = serve(shard).await;
    let handler = {
        let seen = seen.clone();
        move |ctx: TaskContext, _: CancellationToken| {
            let called_in = Context::current().span().span_context().clone();
            let seen = seen.clone();
            async move {
                let current = Context::current().span().span_context().clone();
                seen.lock()
                    .unwrap()
                    .push((ctx.id, ctx.attempt, called_in, current));
                match ctx.payload.as_slice() {
                    b"\"fail\"" if ctx.attempt == 1 => Err(TaskError::retryable("boom")),
                    b"\"snooze\"" => Err(TaskError::snooze(Duration::from_secs(1), "later")),
                    _ => TaskResult::json("ok"),
                }
            }
        }
    };
    let opts = WorkerOptions::new(options(&endpoint), ["default"]).concurrency(1);
    let worker = Worker::new(opts, handler).unwrap();
    run_until(worker, recorded, move |r| outcomes(r).len() >= n).await;
    seen
}

fn with_payload(task: Task, payload: &str) -> Task {
    Task {
        payload: serde_json::to_vec(payload).unwrap(),
        ..task
    }
}

/// The spans of the task with this id, in the order they ended.
fn task_spans(exporter: &InMemorySpanExporter, id: u64) -> Vec<SpanData> {
    let id = Value::from(id.to_string());
    exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| attribute(s, "cronoq.task.id") == Some(id.clone()))
        .collect()
}

fn attribute(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

#[tokio::test]
async fn one_trace_goes_from_the_submitting_span_to_every_attempt_s_handler_span() {
    let _turn = GLOBAL_PROVIDER.lock().await;
    let exporter = install_provider();
    // Submitted inside a recording span: the fake records the request's trace.
    let (endpoint, fake) = client_tests::serve(0).await;
    let client = Client::new(client_tests::options(&endpoint, Duration::from_secs(5))).unwrap();
    let submitting = global::tracer("test").start("submit");
    let submitted = submitting.span_context().clone();
    let cx = Context::current_with_span(submitting);
    client
        .submit(TaskSpec::new("default").key("order-1"))
        .with_context(cx.clone())
        .await
        .unwrap();
    cx.span().end();
    let calls = fake.calls();
    let [Call::Submit(req)] = calls.as_slice() else {
        panic!("calls {calls:?}");
    };
    let trace = req.trace.clone().expect("the submit's trace");
    assert_eq!(
        trace.traceparent,
        format!("00-{}-{}-01", submitted.trace_id(), submitted.span_id())
    );
    assert!(!trace.link);
    // The server gives it back with the task: attempt 1 fails, attempt 2 (the retry) succeeds.
    let first = Task {
        key: "order-1".into(),
        trace: Some(trace),
        ..with_payload(task(9001, 0), "fail")
    };
    let second = Task {
        attempt: 2,
        ..first.clone()
    };
    let seen = run(vec![first, second], 2).await;
    let spans = task_spans(&exporter, 9001);
    assert_eq!(spans.len(), 2, "{spans:#?}");
    for (span, (attempt, outcome)) in spans.iter().zip([(1, "failure"), (2, "success")]) {
        assert_eq!(span.name, "process default");
        assert_eq!(span.span_kind, SpanKind::Consumer);
        assert_eq!(
            span.span_context.trace_id(),
            submitted.trace_id(),
            "one trace"
        );
        assert_eq!(
            span.parent_span_id,
            submitted.span_id(),
            "a child of the submit"
        );
        assert!(span.parent_span_is_remote);
        assert_eq!(span.instrumentation_scope.name(), "cronoq");
        assert!(span.links.is_empty());
        let expected = [
            KeyValue::new("cronoq.task.id", "9001"),
            KeyValue::new("cronoq.task.pool", "default"),
            KeyValue::new("cronoq.task.attempt", attempt),
            KeyValue::new("cronoq.task.key", "order-1"),
            KeyValue::new("cronoq.task.outcome", outcome),
        ];
        assert_eq!(span.attributes, expected);
    }
    assert_eq!(spans[0].status, Status::error("boom"));
    assert_eq!(spans[1].status, Status::Unset);
    // The handler ran with its span current, in its call and in its future.
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    for ((_, attempt, called_in, current), span) in seen.iter().zip(&spans) {
        assert_eq!(current, &span.span_context, "attempt {attempt}");
        assert_eq!(called_in, &span.span_context, "attempt {attempt}");
    }
}

#[tokio::test]
async fn a_link_starts_a_new_trace_linked_to_it_and_no_trace_a_new_one() {
    let _turn = GLOBAL_PROVIDER.lock().await;
    let exporter = install_provider();
    let tasks = vec![
        traced(9101, true),
        with_payload(task(9102, 0), "snooze"),
        with_payload(traced(9103, true), "fail"),
    ];
    run(tasks, 3).await;
    let remote = remote();
    let [linked] = task_spans(&exporter, 9101).try_into().unwrap();
    assert_ne!(
        linked.span_context.trace_id(),
        remote.trace_id(),
        "a new trace"
    );
    assert_eq!(linked.parent_span_id, SpanId::INVALID, "a root span");
    assert_eq!(linked.links.len(), 1);
    assert_eq!(
        linked.links[0].span_context, remote,
        "linked to the schedule's context"
    );
    assert_eq!(
        attribute(&linked, "cronoq.task.outcome"),
        Some("success".into())
    );
    assert_eq!(attribute(&linked, "cronoq.task.key"), None, "no key: none");
    let [untraced] = task_spans(&exporter, 9102).try_into().unwrap();
    assert_eq!(untraced.parent_span_id, SpanId::INVALID);
    assert!(untraced.links.is_empty());
    assert_eq!(
        attribute(&untraced, "cronoq.task.outcome"),
        Some("snoozed".into())
    );
    assert_eq!(untraced.status, Status::Unset);
    let [failed] = task_spans(&exporter, 9103).try_into().unwrap();
    assert_eq!(
        attribute(&failed, "cronoq.task.outcome"),
        Some("failure".into())
    );
    assert_eq!(failed.status, Status::error("boom"));
    let traces = [&linked, &untraced, &failed].map(|s| s.span_context.trace_id());
    assert!(traces[0] != traces[1] && traces[1] != traces[2] && traces[0] != traces[2]);
}

#[tokio::test]
async fn without_a_tracer_provider_the_handler_runs_in_the_submitter_s_span_context() {
    let _turn = GLOBAL_PROVIDER.lock().await;
    global::set_tracer_provider(NoopTracerProvider::new());
    // A submit in a remote span context (no tracer provider) sends it.
    let (endpoint, fake) = client_tests::serve(0).await;
    let client = Client::new(client_tests::options(&endpoint, Duration::from_secs(5))).unwrap();
    let cx = Context::new().with_remote_span_context(remote());
    client
        .submit(TaskSpec::new("default"))
        .with_context(cx.clone())
        .await
        .unwrap();
    let mine = "00-11111111111111111111111111111111-2222222222222222-00";
    let specs = [
        TaskSpec::new("default"),
        TaskSpec::new("default").trace(mine, ""),
    ];
    client
        .submit_batch(&specs)
        .with_context(cx.clone())
        .await
        .unwrap();
    let calls = fake.calls();
    let [Call::Submit(one), Call::SubmitBatch(batch)] = calls.as_slice() else {
        panic!("calls {calls:?}");
    };
    let sent = |traceparent: &str, tracestate: &str| {
        Some(proto::TraceContext {
            traceparent: traceparent.into(),
            tracestate: tracestate.into(),
            link: false,
        })
    };
    assert_eq!(one.trace, sent(TRACEPARENT, "vendor=abc"));
    assert_eq!(batch.tasks[0].trace, sent(TRACEPARENT, "vendor=abc"));
    assert_eq!(batch.tasks[1].trace, sent(mine, ""), "the spec's wins");
    // The handler's current span context is the remote parent's; none for a link or no trace.
    let seen = run(
        vec![traced(9201, false), traced(9202, true), task(9203, 0)],
        3,
    )
    .await;
    let seen = seen.lock().unwrap();
    let current = |id: u64| {
        let (_, _, called_in, current) = seen.iter().find(|s| s.0 == id).unwrap().clone();
        assert_eq!(called_in, current, "task {id}");
        current
    };
    assert_eq!(current(9201), remote());
    assert!(!current(9202).is_valid(), "a link: outside the trace");
    assert!(!current(9203).is_valid(), "no trace");
}

#[tokio::test]
async fn a_put_schedule_keeps_the_caller_s_trace_context_unless_its_spec_sets_one() {
    let (endpoint, fake) = client_tests::serve(0).await;
    let client = Client::new(client_tests::options(&endpoint, Duration::from_secs(5))).unwrap();
    let cx = Context::new().with_remote_span_context(remote());
    let mine = "00-11111111111111111111111111111111-2222222222222222-00";
    for spec in [
        ScheduleSpec::new("llm", "nightly", "0 2 * * *"),
        ScheduleSpec::new("llm", "hourly", "0 * * * *").trace(mine, ""),
    ] {
        client
            .put_schedule(spec)
            .with_context(cx.clone())
            .await
            .unwrap();
    }
    let sent: Vec<_> = fake
        .calls()
        .into_iter()
        .map(|c| match c {
            Call::PutSchedule(r) => r.schedule.unwrap().trace.unwrap(),
            other => panic!("{other:?}"),
        })
        .map(|t| (t.traceparent, t.tracestate, t.link))
        .collect();
    assert_eq!(
        sent,
        vec![
            (TRACEPARENT.into(), "vendor=abc".into(), false),
            (mine.into(), String::new(), false),
        ],
        "the current span context; the spec's wins"
    );
}

#[test]
fn the_w3c_form_is_the_propagator_s() {
    let sc = remote();
    let tc = inject(&sc).unwrap();
    assert_eq!(tc.traceparent, TRACEPARENT);
    assert_eq!(tc.tracestate, "vendor=abc");
    assert_eq!(extract(&tc), Some(sc.clone()));
    // Only the sampled flag; an invalid span context is no trace.
    let unsampled = SpanContext::new(
        sc.trace_id(),
        sc.span_id(),
        TraceFlags::new(0xfe),
        false,
        TraceState::NONE,
    );
    let tc = inject(&unsampled).unwrap();
    assert_eq!(
        tc.traceparent,
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    );
    assert_eq!(tc.tracestate, "");
    assert_eq!(inject(&SpanContext::empty_context()), None);
    // A tracestate over the server's 512 bytes is left out; the traceparent still goes.
    let long: TraceState = (0..3)
        .map(|i| format!("k{i}={}", "v".repeat(200)))
        .collect::<Vec<_>>()
        .join(",")
        .parse()
        .unwrap();
    assert!(long.header().len() > 512);
    let big = SpanContext::new(sc.trace_id(), sc.span_id(), TraceFlags::SAMPLED, true, long);
    let tc = inject(&big).unwrap();
    assert_eq!(
        (tc.traceparent.as_str(), tc.tracestate.as_str()),
        (TRACEPARENT, "")
    );
}

#[test]
fn only_a_valid_traceparent_is_extracted() {
    let tc = |traceparent: &str, tracestate: &str| proto::TraceContext {
        traceparent: traceparent.into(),
        tracestate: tracestate.into(),
        link: false,
    };
    for bad in [
        "",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-",
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-B7AD6B7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0A",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "+0-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "0-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333g-01",
    ] {
        assert_eq!(extract(&tc(bad, "")), None, "{bad:?}");
    }
    // A later version may add fields; a tracestate that does not parse is dropped.
    let later = extract(&tc(
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03-more",
        "not a tracestate",
    ))
    .unwrap();
    assert_eq!(later.trace_id(), remote().trace_id());
    assert_eq!(later.trace_flags(), TraceFlags::SAMPLED);
    assert_eq!(later.trace_state(), &TraceState::NONE);
    assert!(later.is_remote());
}

#[tokio::test]
async fn a_spawned_task_carries_its_handler_s_trace_unless_it_has_its_own() {
    let _turn = GLOBAL_PROVIDER.lock().await;
    let exporter = install_provider();
    let shard = FakeShard::with_tasks(vec![traced(77, false)]);
    let recorded = shard.recorded.clone();
    let endpoint = serve(shard).await;
    let handler = |ctx: TaskContext, _: CancellationToken| async move {
        ctx.spawn(TaskSpec::new("default").key("child"))?;
        ctx.spawn(TaskSpec::new("default").trace(TRACEPARENT, ""))?;
        TaskResult::json("ok")
    };
    let worker = Worker::new(WorkerOptions::new(options(&endpoint), ["default"]), handler).unwrap();
    let rec = run_until(worker, recorded, |r| !outcomes(r).is_empty()).await;
    let outcome = outcomes(&rec.lock().unwrap())[0].clone();
    let Some(proto::task_outcome::Outcome::Success(success)) = outcome.outcome else {
        panic!("{outcome:?}");
    };
    let [span] = task_spans(&exporter, 77).try_into().unwrap();
    let traceparents: Vec<String> = success
        .spawn
        .iter()
        .map(|s| s.trace.clone().unwrap_or_default().traceparent)
        .collect();
    let handler_s = format!(
        "00-{}-{}-01",
        span.span_context.trace_id(),
        span.span_context.span_id()
    );
    assert_eq!(traceparents, vec![handler_s, TRACEPARENT.to_string()]);
}
