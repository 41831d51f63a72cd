// OpenTelemetry, when the application has it: the W3C trace context a submit sends (its
// caller's current span's), and the span a worker runs each task in. @opentelemetry/api is an
// optional peer dependency, loaded here when it is installed: without it nothing is traced and
// nothing fails. Only the API is used (the application's tracer provider, the global one,
// makes the spans; none installed: the API's no-op); the traceparent is formatted and parsed
// here as the W3C propagator does, so the SDK needs nothing else.
import { createRequire } from "node:module";
import type * as OtelApi from "@opentelemetry/api";
import type { Task, TraceContext } from "./gen/cronoq/v1/task.js";
import { VERSION } from "./version.js";

type Api = typeof OtelApi;

/** The tracer's name: every task's span comes from it. */
export const TRACER_NAME = "cronoq";
/** The most bytes of tracestate the server takes (more: INVALID_ARGUMENT). */
const MAX_TRACESTATE_BYTES = 512;
// As the W3C propagator reads a traceparent: version (not ff), trace id, parent id (neither all
// zeros), flags; more parts only for a version after 00.
const TRACEPARENT = /^\s?((?!ff)[\da-f]{2})-((?![0]{32})[\da-f]{32})-((?![0]{16})[\da-f]{16})-([\da-f]{2})(-.*)?\s?$/;

/** @opentelemetry/api, loaded with require; undefined when it cannot be loaded (not installed). */
export function loadApi(load: (id: string) => unknown = createRequire(import.meta.url)): Api | undefined {
  try {
    return load("@opentelemetry/api") as Api;
  } catch {
    return undefined;
  }
}

const api = loadApi();

/** A W3C trace context as a submit sends it. */
export interface W3CTrace {
  traceparent: string;
  tracestate: string;
}

/**
 * The caller's current span context (the active context's span) as the W3C propagator would
 * inject it; undefined when it is not valid (no span, outside any trace) or the API is not
 * installed. A tracestate longer than the server takes is left out.
 */
export function currentTrace(): W3CTrace | undefined {
  if (!api) return undefined;
  try {
    const sc = api.trace.getSpanContext(api.context.active());
    if (!sc || !api.isSpanContextValid(sc)) return undefined;
    const flags = (Number(sc.traceFlags) & 0xff).toString(16).padStart(2, "0");
    const traceparent = `00-${sc.traceId.toLowerCase()}-${sc.spanId.toLowerCase()}-${flags}`;
    const tracestate = sc.traceState?.serialize() ?? "";
    return { traceparent, tracestate: Buffer.byteLength(tracestate, "utf8") > MAX_TRACESTATE_BYTES ? "" : tracestate };
  } catch {
    return undefined; // tracing never fails a submit
  }
}

/** The remote span context a traceparent and tracestate give (the W3C propagator's extract); undefined when the traceparent is not one. */
function remoteSpanContext(a: Api, trace: TraceContext): OtelApi.SpanContext | undefined {
  const match = TRACEPARENT.exec(trace.traceparent);
  if (!match || (match[1] === "00" && match[5])) return undefined;
  return {
    traceId: match[2]!,
    spanId: match[3]!,
    traceFlags: parseInt(match[4]!, 16),
    isRemote: true,
    traceState: trace.tracestate ? a.createTraceState(trace.tracestate) : undefined,
  };
}

/** What a task's attempt came to, as its span's cronoq.task.outcome says. */
export type SpanOutcome = "success" | "failure" | "snoozed" | "cancelled" | "released" | "lost";

/**
 * The span a worker runs one task in: `process {pool}`, kind CONSUMER, from the "cronoq"
 * tracer of the global tracer provider. Its parent is the task's trace context (so the handler
 * runs in the submitter's trace); a new root linked to it when the context is a schedule's
 * (link); a new root when the task has none.
 */
export class TaskSpan {
  private ended = false;

  private constructor(private readonly a: Api, private readonly span: OtelApi.Span, private readonly ctx: OtelApi.Context) {}

  /** Starts the task's span; undefined when the API is not installed (or the tracer fails). */
  static start(task: Task): TaskSpan | undefined {
    const a = api;
    if (!a) return undefined;
    try {
      const attributes: OtelApi.Attributes = {
        "cronoq.task.id": task.id.toString(),
        "cronoq.task.pool": task.pool,
        "cronoq.task.attempt": task.attempt,
      };
      if (task.key) attributes["cronoq.task.key"] = task.key;
      const options: OtelApi.SpanOptions = { kind: a.SpanKind.CONSUMER, attributes };
      const remote = task.trace?.traceparent ? remoteSpanContext(a, task.trace) : undefined;
      // The context the worker runs in (its values kept), with the remote span as the parent.
      let parent = a.context.active();
      if (remote && !task.trace!.link) {
        parent = a.trace.setSpanContext(parent, remote);
      } else {
        options.root = true;
        if (remote) options.links = [{ context: remote }];
      }
      const span = a.trace.getTracer(TRACER_NAME, VERSION).startSpan(`process ${task.pool}`, options, parent);
      return new TaskSpan(a, span, a.trace.setSpan(parent, span));
    } catch {
      return undefined; // tracing never fails a task
    }
  }

  /** Runs fn with the span as the current one (the active context's span). */
  run<T>(fn: () => T): T {
    return this.a.context.with(this.ctx, fn);
  }

  /** Ends the span (once) with the attempt's outcome; a failure's status is ERROR with its message. */
  end(outcome: SpanOutcome, error = ""): void {
    if (this.ended) return;
    this.ended = true;
    try {
      this.span.setAttribute("cronoq.task.outcome", outcome);
      if (outcome === "failure") this.span.setStatus({ code: this.a.SpanStatusCode.ERROR, message: error });
      this.span.end();
    } catch {
      // tracing never fails a task
    }
  }
}
