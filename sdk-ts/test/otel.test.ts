// OpenTelemetry: the trace context a submit and a putSchedule send, the span each task runs in (recorded by the
// SDK's in-memory exporter), the handler's active span without a tracer provider; and the
// fields of the worker's log lines.
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  context,
  createTraceState,
  ROOT_CONTEXT,
  SpanKind,
  SpanStatusCode,
  trace,
  type SpanContext,
} from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor, type ReadableSpan } from "@opentelemetry/sdk-trace-base";
import { Task, type TraceContext } from "../src/gen/cronoq/v1/task.js";
import { Client, nonRetryable, Snooze, Worker, type Handler } from "../src/index.js";
import { loadApi } from "../src/otel.js";
import { FakeShard, jsonTask, tracked, until, type FakeOptions } from "./fake_shard.js";
import { silent } from "./helpers.js";

// In Node the API's context follows async calls only with a context manager (a tracing setup,
// e.g. NodeSDK, registers this one).
context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
const exporter = new InMemorySpanExporter();
const provider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] });

/** The global tracer provider: the in-memory one (exporter emptied), or none (the API's no-op). */
function useProvider(on: boolean): void {
  trace.disable();
  if (on) trace.setGlobalTracerProvider(provider);
  exporter.reset();
}

const TRACE_ID = "0af7651916cd43dd8448eb211c80319c";
const PARENT_ID = "b7ad6b7169203331";
const TRACEPARENT = `00-${TRACE_ID}-${PARENT_ID}-01`;

function traced(task: Task, trace: Partial<TraceContext>): Task {
  return Task.fromPartial({ ...task, trace: { traceparent: "", tracestate: "", link: false, ...trace } });
}

/** The worker's spans: those of the "cronoq" tracer. */
function taskSpans(): ReadableSpan[] {
  return exporter.getFinishedSpans().filter((s) => s.instrumentationScope.name === "cronoq");
}

/** Runs a worker (concurrency 1) on a fake shard with these tasks until it has an outcome for each; answers the shard. */
async function work(opts: FakeOptions, handler: Handler, logger = silent): Promise<FakeShard> {
  const shard = await new FakeShard(opts).start();
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], concurrency: 1, logger }, handler));
  const run = worker.run();
  await until(() => shard.outcomes.length === (opts.tasks?.length ?? 0));
  worker.stop();
  await run;
  shard.stop();
  return shard;
}

test("a submit in a span sends its trace context; the task's handler spans continue that trace, attempt after attempt", async () => {
  useProvider(true);
  const shard = await new FakeShard().start();
  const client = new Client({ endpoint: shard.url, logger: silent });
  let submitter!: SpanContext;
  await trace.getTracer("app").startActiveSpan("submit", async (span) => {
    submitter = span.spanContext();
    await client.submit({ pool: "default", key: "report-1", payload: { n: 1 } });
    await client.submitBatch([{ pool: "default" }, { pool: "default", trace: { traceparent: TRACEPARENT, tracestate: "k=v" } }]);
    span.end();
  });
  await client.submit({ pool: "default" }); // outside any span
  client.close();
  shard.stop();
  const sent = shard.submitted.map((req) => req.trace);
  const mine = { traceparent: `00-${submitter.traceId}-${submitter.spanId}-01`, tracestate: "", link: false };
  assert.deepEqual(sent, [mine, mine, { traceparent: TRACEPARENT, tracestate: "k=v", link: false }, undefined]);

  // The server gives the task back with its trace: attempt 1 fails, attempt 2 (the retry) succeeds.
  const leased = (attempt: number) => traced(Task.fromPartial({ ...jsonTask(1n, { n: 1 }), key: "report-1", attempt }), sent[0]!);
  const active: Array<SpanContext | undefined> = [];
  await work({ tasks: [leased(1), leased(2)] }, (task) => {
    active.push(trace.getActiveSpan()?.spanContext());
    if (task.attempt === 1) throw new Error("boom");
    return "ok";
  });
  const spans = taskSpans();
  assert.equal(spans.length, 2);
  spans.forEach((span, i) => {
    assert.equal(span.name, "process default");
    assert.equal(span.kind, SpanKind.CONSUMER);
    assert.equal(span.spanContext().traceId, submitter.traceId);
    assert.equal(span.parentSpanContext?.spanId, submitter.spanId);
    assert.equal(span.links.length, 0);
    assert.deepEqual(active[i], span.spanContext()); // the handler ran with it active
    assert.deepEqual(span.attributes, {
      "cronoq.task.id": "1", "cronoq.task.pool": "default", "cronoq.task.attempt": i + 1, "cronoq.task.key": "report-1",
      "cronoq.task.outcome": i === 0 ? "failure" : "success",
    });
  });
  assert.deepEqual(spans[0]!.status, { code: SpanStatusCode.ERROR, message: "boom" });
  assert.equal(spans[1]!.status.code, SpanStatusCode.UNSET);
});

test("putSchedule in a span sends its trace context (the one given instead, when given); outside any span none", async () => {
  useProvider(true);
  const shard = await new FakeShard().start();
  const client = new Client({ endpoint: shard.url, logger: silent });
  let putter!: SpanContext;
  await trace.getTracer("app").startActiveSpan("put", async (span) => {
    putter = span.spanContext();
    const put = await client.putSchedule({ pool: "default", name: "nightly", cron: "0 3 * * *" });
    assert.deepEqual(put.nextFireAt, { seconds: 1_700_000_060n, nanos: 0 });
    await client.putSchedule({ pool: "default", name: "given", cron: "0 3 * * *", trace: { traceparent: TRACEPARENT, tracestate: "k=v" } });
    span.end();
  });
  await client.putSchedule({ pool: "default", name: "outside", cron: "0 3 * * *" });
  client.close();
  shard.stop();
  assert.deepEqual(shard.schedules.map((s) => s.trace), [
    { traceparent: `00-${putter.traceId}-${putter.spanId}-01`, tracestate: "", link: false },
    { traceparent: TRACEPARENT, tracestate: "k=v", link: false },
    undefined,
  ]);
});

test("a schedule's task (link) runs in a new trace linked to the schedule's; one without a trace in a new trace", async () => {
  useProvider(true);
  const active: Array<SpanContext | undefined> = [];
  await work({ tasks: [traced(jsonTask(1n, {}), { traceparent: TRACEPARENT, tracestate: "k=v", link: true }), jsonTask(2n, {})] }, () => {
    active.push(trace.getActiveSpan()?.spanContext());
    return null;
  });
  const [linked, plain] = taskSpans();
  for (const [i, span] of [linked!, plain!].entries()) {
    assert.equal(span.parentSpanContext, undefined);
    assert.notEqual(span.spanContext().traceId, TRACE_ID);
    assert.deepEqual(active[i], span.spanContext());
    assert.equal(span.attributes["cronoq.task.outcome"], "success");
    assert.equal(span.attributes["cronoq.task.key"], undefined); // none
  }
  assert.equal(linked!.links.length, 1);
  const link = linked!.links[0]!.context;
  assert.deepEqual([link.traceId, link.spanId, link.traceFlags, link.isRemote, link.traceState?.get("k")], [TRACE_ID, PARENT_ID, 1, true, "v"]);
  assert.equal(plain!.links.length, 0);
});

test("the span's outcome: a failure is ERROR with its message; snoozed and cancelled say so", async () => {
  useProvider(true);
  await work({ tasks: [jsonTask(1n, { fail: true }), jsonTask(2n, { snooze: true }), jsonTask(3n, { wait: true })], cancel: [3n] },
    (task, signal) => {
      const payload = JSON.parse(task.payload.toString()) as Record<string, boolean>;
      if (payload["fail"]) throw nonRetryable("bad input");
      if (payload["snooze"]) throw new Snooze(1000, "busy");
      return new Promise((_resolve, reject) => signal.addEventListener("abort", () => reject(signal.reason)));
    });
  const byId = new Map(taskSpans().map((s) => [s.attributes["cronoq.task.id"], s]));
  assert.equal(byId.get("1")!.attributes["cronoq.task.outcome"], "failure");
  assert.deepEqual(byId.get("1")!.status, { code: SpanStatusCode.ERROR, message: "bad input" });
  assert.equal(byId.get("2")!.attributes["cronoq.task.outcome"], "snoozed");
  assert.equal(byId.get("2")!.status.code, SpanStatusCode.UNSET);
  assert.equal(byId.get("3")!.attributes["cronoq.task.outcome"], "cancelled");
});

test("without a tracer provider: a submit in a remote context sends it; the handler runs in the task's remote context, outside one for a link or none", async () => {
  useProvider(false);
  const shard = await new FakeShard().start();
  const client = new Client({ endpoint: shard.url, logger: silent });
  const remote: SpanContext = { traceId: TRACE_ID, spanId: PARENT_ID, traceFlags: 1, isRemote: true, traceState: createTraceState("vendor=abc") };
  await context.with(trace.setSpanContext(ROOT_CONTEXT, remote), () => client.submit({ pool: "default" }));
  client.close();
  shard.stop();
  assert.deepEqual(shard.submitted[0]!.trace, { traceparent: TRACEPARENT, tracestate: "vendor=abc", link: false });

  const active = new Map<bigint, SpanContext | undefined>();
  await work({
    tasks: [
      traced(jsonTask(1n, {}), { traceparent: TRACEPARENT, tracestate: "vendor=abc" }),
      traced(jsonTask(2n, {}), { traceparent: TRACEPARENT, link: true }),
      jsonTask(3n, {}),
    ],
  }, (task) => {
    active.set(task.id, trace.getSpanContext(context.active()));
    return null;
  });
  const child = active.get(1n)!;
  assert.deepEqual([child.traceId, child.spanId, child.traceFlags, child.isRemote, child.traceState?.serialize()],
    [TRACE_ID, PARENT_ID, 1, true, "vendor=abc"]);
  for (const id of [2n, 3n]) {
    const sc = active.get(id);
    assert.ok(sc === undefined || !trace.isSpanContextValid(sc), `task ${id}: ${JSON.stringify(sc)}`);
  }
  assert.equal(exporter.getFinishedSpans().length, 0);
});

test("without @opentelemetry/api nothing is traced: loading it is allowed to fail", () => {
  assert.equal(loadApi(() => {
    throw Object.assign(new Error("Cannot find module '@opentelemetry/api'"), { code: "MODULE_NOT_FOUND" });
  }), undefined);
  assert.equal(typeof loadApi()?.trace.getTracer, "function");
});

test("the worker's log lines about a task carry worker_id, task_id, attempt and pool", async () => {
  useProvider(false);
  const records: Array<{ level: string; message: string; fields?: Record<string, unknown> }> = [];
  const capture = (level: string) => (message: string, fields?: Record<string, unknown>) => records.push({ level, message, fields });
  const logger = { debug: capture("debug"), info: capture("info"), warn: capture("warn"), error: capture("error") };
  const lost = Task.fromPartial({ ...jsonTask(8n, {}), attempt: 3, pool: "default" });
  let aborted = false;
  const shard = await new FakeShard({ tasks: [jsonTask(7n, {}), lost], refuse: [7n], lost: [8n] }).start();
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], concurrency: 1, logger }, (task, signal) => {
    if (task.id === 7n) return "done"; // its outcome is refused
    return new Promise((resolve) => signal.addEventListener("abort", () => { // its lease is lost
      aborted = true;
      resolve(null);
    }));
  }));
  const run = worker.run();
  await until(() => aborted && records.some((r) => r.message === "cronoq: outcome refused"));
  worker.stop();
  await run;
  shard.stop();
  const refused = records.find((r) => r.message === "cronoq: outcome refused");
  assert.equal(refused?.level, "warn");
  assert.deepEqual(refused?.fields, {
    worker_id: "w1", task_id: "7", attempt: 1, pool: "default", code: "LEASE_LOST", message: "the task is not leased to this worker",
  });
  const lease = records.find((r) => r.message === "cronoq: task lost its lease; its outcome will not be reported");
  assert.deepEqual(lease?.fields, { worker_id: "w1", task_id: "8", attempt: 3, pool: "default" });
  const registered = records.find((r) => r.message === "cronoq: worker registered");
  assert.equal(registered?.fields?.["worker_id"], "w1");
});
