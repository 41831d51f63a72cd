//! OpenTelemetry, with the `otel` feature: the W3C trace context a submit sends with each
//! task (the caller's current span context), and the span a worker runs each task in. Only
//! the API crate (`opentelemetry`) is used: the spans go to the global tracer provider the
//! application installs (none: the API's no-op, which still carries the submitter's span
//! context into the handler). Without the feature, nothing is traced and nothing here costs.

use std::future::Future;

use crate::client::Task;
use crate::proto;

/// The name of the tracer, from the global tracer provider, whose span the worker starts for
/// each task it runs (with the `otel` feature).
pub const TRACER_NAME: &str = "cronoq";

/// The most bytes of a tracestate the server accepts: a longer one is not sent (the
/// traceparent still is).
#[cfg_attr(not(feature = "otel"), allow(dead_code))]
const MAX_TRACESTATE_BYTES: usize = 512;

/// The trace context a submit sends when the caller sets none: the caller's current span
/// context (`opentelemetry::Context::current()`), as the W3C propagator injects it; None
/// when it is not valid (no trace: nothing is sent), or without the `otel` feature.
pub(crate) fn current_trace() -> Option<proto::TraceContext> {
    #[cfg(feature = "otel")]
    {
        imp::current_trace()
    }
    #[cfg(not(feature = "otel"))]
    {
        None
    }
}

/// How an attempt ended, as the span's `cronoq.task.outcome` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended<'a> {
    Success,
    /// Its message is the span's status (ERROR).
    Failure(&'a str),
    Snoozed,
    Cancelled,
    Released,
    /// The task's lease was lost: nothing was reported.
    Lost,
}

impl Ended<'_> {
    #[cfg_attr(not(feature = "otel"), allow(dead_code))]
    fn name(self) -> &'static str {
        match self {
            Ended::Success => "success",
            Ended::Failure(_) => "failure",
            Ended::Snoozed => "snoozed",
            Ended::Cancelled => "cancelled",
            Ended::Released => "released",
            Ended::Lost => "lost",
        }
    }
}

/// The span of one attempt: `process {pool}`, kind CONSUMER, from the tracer "cronoq" of the
/// global tracer provider, with the task's id, pool, attempt and key. A task submitted in a
/// trace (`Task.trace`, not a link) is its parent, in the same trace; a schedule's fire (a
/// link) starts a new trace linked to the schedule's context; a task without one starts a new
/// trace. Nothing without the `otel` feature.
pub(crate) struct TaskSpan {
    #[cfg(feature = "otel")]
    cx: opentelemetry::Context,
}

impl TaskSpan {
    pub(crate) fn start(task: &Task) -> TaskSpan {
        #[cfg(feature = "otel")]
        {
            TaskSpan {
                cx: imp::start(task),
            }
        }
        #[cfg(not(feature = "otel"))]
        {
            let _ = task;
            TaskSpan {}
        }
    }

    /// Runs `f` with the span current (the handler's synchronous part).
    pub(crate) fn in_scope<R>(&self, f: impl FnOnce() -> R) -> R {
        #[cfg(feature = "otel")]
        let _current = self.cx.clone().attach();
        f()
    }

    /// The handler's future, run with the span current at every poll.
    #[cfg(feature = "otel")]
    pub(crate) fn instrument<F: Future>(&self, fut: F) -> opentelemetry::context::WithContext<F> {
        use opentelemetry::context::FutureExt as _;
        fut.with_context(self.cx.clone())
    }

    /// The handler's future, as it is.
    #[cfg(not(feature = "otel"))]
    pub(crate) fn instrument<F: Future>(&self, fut: F) -> F {
        fut
    }

    /// Ends the span with the attempt's outcome (a failure's status is ERROR, with its message).
    pub(crate) fn end(self, ended: Ended<'_>) {
        #[cfg(feature = "otel")]
        imp::end(&self.cx, ended);
        #[cfg(not(feature = "otel"))]
        let _ = ended;
    }
}

#[cfg(feature = "otel")]
mod imp {
    use std::str::FromStr;

    use opentelemetry::trace::{
        Link, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
        TraceState, Tracer,
    };
    use opentelemetry::{Context, InstrumentationScope, KeyValue, global};

    use super::{Ended, MAX_TRACESTATE_BYTES, TRACER_NAME};
    use crate::client::Task;
    use crate::proto;

    pub(super) fn current_trace() -> Option<proto::TraceContext> {
        let cx = Context::current();
        let span = cx.span();
        inject(span.span_context())
    }

    /// What the W3C TraceContext propagator injects for `sc` (traceparent version 00, only
    /// the sampled flag); None when `sc` is not valid. A tracestate over the server's limit
    /// is left out.
    pub(crate) fn inject(sc: &SpanContext) -> Option<proto::TraceContext> {
        if !sc.is_valid() {
            return None;
        }
        let traceparent = format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags() & TraceFlags::SAMPLED
        );
        let mut tracestate = sc.trace_state().header();
        if tracestate.len() > MAX_TRACESTATE_BYTES {
            tracestate.clear();
        }
        Some(proto::TraceContext {
            traceparent,
            tracestate,
            link: false,
        })
    }

    /// The remote span context the W3C TraceContext propagator extracts from `tc`; None when
    /// it names none, or one that does not parse (a tracestate that does not is dropped).
    pub(crate) fn extract(tc: &proto::TraceContext) -> Option<SpanContext> {
        let parts: Vec<&str> = tc.traceparent.trim().split_terminator('-').collect();
        if parts.len() < 4 {
            return None;
        }
        let lower_hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        if !parts[..4]
            .iter()
            .zip([2, 32, 16, 2])
            .all(|(part, len)| lower_hex(part, len))
        {
            return None;
        }
        // Version ff is invalid; a later version than 00 may add fields, 00 may not.
        if parts[0] == "ff" || (parts[0] == "00" && parts.len() != 4) {
            return None;
        }
        let trace_id = TraceId::from_hex(parts[1]).ok()?;
        let span_id = SpanId::from_hex(parts[2]).ok()?;
        let flags = TraceFlags::new(u8::from_str_radix(parts[3], 16).ok()?) & TraceFlags::SAMPLED;
        let state = if tc.tracestate.is_empty() {
            TraceState::default()
        } else {
            TraceState::from_str(&tc.tracestate).unwrap_or_default()
        };
        let sc = SpanContext::new(trace_id, span_id, flags, true, state);
        sc.is_valid().then_some(sc)
    }

    /// Starts the task's span; the context to run its handler in (the span current).
    pub(super) fn start(task: &Task) -> Context {
        let mut attributes = vec![
            KeyValue::new("cronoq.task.id", task.id.to_string()),
            KeyValue::new("cronoq.task.pool", task.pool.clone()),
            KeyValue::new("cronoq.task.attempt", i64::from(task.attempt)),
        ];
        if !task.key.is_empty() {
            attributes.push(KeyValue::new("cronoq.task.key", task.key.clone()));
        }
        let scope = InstrumentationScope::builder(TRACER_NAME)
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let tracer = global::tracer_with_scope(scope);
        let mut builder = tracer
            .span_builder(format!("process {}", task.pool))
            .with_kind(SpanKind::Consumer)
            .with_attributes(attributes);
        // Never the worker's own context: the task's trace, or a new one.
        let mut parent = Context::new();
        if let Some(tc) = &task.trace
            && let Some(remote) = extract(tc)
        {
            if tc.link {
                builder = builder.with_links(vec![Link::with_context(remote)]);
            } else {
                parent = parent.with_remote_span_context(remote);
            }
        }
        let span = builder.start_with_context(&tracer, &parent);
        parent.with_span(span)
    }

    pub(super) fn end(cx: &Context, ended: Ended<'_>) {
        let span = cx.span();
        span.set_attribute(KeyValue::new("cronoq.task.outcome", ended.name()));
        if let Ended::Failure(message) = ended {
            span.set_status(Status::error(message.to_string()));
        }
        span.end();
    }
}

#[cfg(all(test, feature = "otel"))]
pub(crate) use imp::{extract, inject};
