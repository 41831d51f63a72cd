// The conformance driver of the TypeScript SDK: one case's input as JSON on stdin, one result
// as JSON on stdout (the protocol: conformance/README.md in the cronoq repository). It uses
// the SDK's public API only, and OpenTelemetry's API with no tracer provider (no SDK).
import { context, defaultTextMapGetter, ROOT_CONTEXT, trace } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { W3CTraceContextPropagator } from "@opentelemetry/core";
import pg from "pg";
import {
  attemptOutcomeToJSON,
  Client,
  codeName,
  CronoqError,
  decodeDependencyResult,
  JSON_CONTENT_TYPE,
  keyModeFromJSON,
  NotFoundError,
  decodePayload,
  decodeResult,
  nonRetryable,
  RedirectRefusedError,
  roleToJSON,
  runWhenFromJSON,
  Snooze,
  TaskFailure,
  taskStateFromJSON,
  taskStateToJSON,
  TlsError,
  TooManyRedirectsError,
  Worker,
  type ConnectionOptions,
  type BulkResult,
  type DependencyResult,
  type Logger,
  type RunWhen,
  type Schedule,
  type Task,
  type TaskContext,
  type TaskFilter,
  type TaskRef,
} from "../src/index.js";
import { enqueue } from "../src/outbox.js";

interface Input {
  case: string;
  endpoints: string[];
  token: string | null;
  tls: { ca?: string; cert?: string; key?: string } | null;
  insecure_redirect_http?: boolean;
  retry?: { initial_backoff_ms?: number; max_backoff_ms?: number; max_elapsed_ms?: number | null };
  timeout_ms?: number;
  keepalive?: { time_ms: number; timeout_ms: number } | null;
  steps: Step[];
  /** The outbox deployment: the application's PostgreSQL and the schema its outbox is in. */
  database_url?: string;
  outbox_schema?: string;
}

interface Step {
  op: string;
  pool?: string;
  payload?: unknown;
  id?: string;
  key?: string;
  group_key?: string;
  include_attempts?: boolean;
  filter?: Record<string, unknown>;
  dry_run?: boolean;
  timeout_ms?: number;
  pools?: string[];
  concurrency?: number;
  prefetch?: number;
  until_handled?: number;
  stop_after_started?: number;
  shutdown_grace_ms?: number;
  traceparent?: string;
  tracestate?: string;
  depends_on?: DependsOn[];
  run_when?: string;
  include_children?: boolean;
  include_dependency_results?: boolean;
  include_descendants?: boolean;
  commit?: boolean;
  relay_within_ms?: number;
  /** A KeyMode's name ("KEY_MODE_DEBOUNCE"). */
  key_mode?: string;
  debounce_ms?: number;
  max_debounce_ms?: number;
  key_ttl_ms?: number;
  /** start_by: now plus this many ms. */
  start_by_in_ms?: number;
  /** How long a sleep step sleeps. */
  ms?: number;
  /** A schedule's (put_schedule, delete_schedule). */
  name?: string;
  cron?: string;
  timezone?: string;
  paused?: boolean;
}

/** A task named by a step's or a spawn's depends_on: its key, its id (decimal), or the spawning task. */
type DependsOn = { key: string } | { id: string } | { parent: true };

/** What a worker's handler spawns, from its task's payload. */
interface SpawnSpec {
  pool: string;
  payload?: unknown;
  key?: string;
  depends_on?: DependsOn[];
  run_when?: string;
}

type Result = Record<string, unknown>;

// Node's context manager, without which the API has no current context across awaits (a tracing
// setup registers it); no tracer provider is installed.
context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());

const logger: Logger = {
  debug: (m, f) => process.stderr.write(`DEBUG ${m} ${JSON.stringify(f ?? {})}\n`),
  info: (m, f) => process.stderr.write(`INFO ${m} ${JSON.stringify(f ?? {})}\n`),
  warn: (m, f) => process.stderr.write(`WARN ${m} ${JSON.stringify(f ?? {})}\n`),
  error: (m, f) => process.stderr.write(`ERROR ${m} ${JSON.stringify(f ?? {})}\n`),
};

function options(input: Input): ConnectionOptions {
  const retry = input.retry ?? {};
  return {
    endpoint: input.endpoints,
    token: input.token ?? undefined,
    tls: input.tls ? { caFile: input.tls.ca, certFile: input.tls.cert, keyFile: input.tls.key } : undefined,
    insecureRedirectHttp: input.insecure_redirect_http ?? false,
    retry: {
      initialBackoffMs: retry.initial_backoff_ms,
      maxBackoffMs: retry.max_backoff_ms,
      maxElapsedMs: retry.max_elapsed_ms ?? -1, // null: no bound
    },
    timeoutMs: input.timeout_ms,
    keepalive: input.keepalive ? { timeMs: input.keepalive.time_ms, timeoutMs: input.keepalive.timeout_ms } : undefined,
    logger,
  };
}

/** The protocol's form of an error. */
function errorOf(err: unknown): Result {
  if (!(err instanceof CronoqError)) {
    return { code: "", kind: "other", message: err instanceof Error ? `${err.name}: ${err.message}` : String(err) };
  }
  const kind = err instanceof TooManyRedirectsError ? "too_many_redirects"
    : err instanceof RedirectRefusedError ? "redirect_refused"
    : err instanceof TlsError ? "tls" : "";
  return {
    code: codeName(err.code),
    kind,
    message: err.message,
    shard: err.shard,
    shard_endpoint: err.shardEndpoint,
    leader: err.leader,
    reason: err.reason,
  };
}

/** A step's task: its "key", else its "id" (a decimal string). */
function refOf(step: Step): TaskRef {
  if (step.key !== undefined) return { key: step.key };
  try {
    return BigInt(step.id ?? "");
  } catch {
    throw new Error(`id "${step.id}" is not an integer`);
  }
}

/** A TaskFilter in proto JSON form (field names as in the proto, or lowerCamelCase; times RFC 3339; ids decimal strings). */
function filterOf(json: Record<string, unknown> = {}): TaskFilter {
  const field = (name: string): unknown => json[name] ?? json[name.replace(/_([a-z])/g, (_m, c: string) => c.toUpperCase())];
  const time = (name: string): Date | undefined => (field(name) === undefined ? undefined : new Date(String(field(name))));
  return {
    pool: field("pool") as string | undefined,
    states: (field("states") as unknown[] | undefined)?.map(taskStateFromJSON),
    createdAfter: time("created_after"),
    createdBefore: time("created_before"),
    finishedAfter: time("finished_after"),
    finishedBefore: time("finished_before"),
    keyPrefix: field("key_prefix") as string | undefined,
    errorContains: field("error_contains") as string | undefined,
    ids: (field("ids") as unknown[] | undefined)?.map((id) => BigInt(String(id))),
    parentId: field("parent_id") === undefined ? undefined : BigInt(String(field("parent_id"))),
  };
}

/** depends_on as the SDK takes it: keys as strings, ids (and the spawning task, parent) as bigints. */
function refsOf(items: DependsOn[] = [], parent = 0n): Array<string | bigint> {
  return items.map((item) => ("key" in item ? item.key : "parent" in item ? parent : BigInt(item.id)));
}

function runWhenOf(spec: { run_when?: string }): RunWhen | undefined {
  return spec.run_when ? runWhenFromJSON(spec.run_when) : undefined;
}

/** A decoded result as the protocol gives it: a JSON value, {"bytes_b64"} for bytes. */
function valueJson(value: unknown): unknown {
  return value instanceof Uint8Array ? { bytes_b64: Buffer.from(value).toString("base64") } : value;
}

function dependencyJson(dependency: DependencyResult): Result {
  return { id: dependency.id.toString(), key: dependency.key, state: taskStateToJSON(dependency.state), value: valueJson(dependency.value), error: dependency.error };
}

/** A task's result: JSON parsed, other bytes as {"bytes_b64"}, null when it has none. */
function resultJson(task: Task): unknown {
  if (task.result.length === 0) return null;
  return task.resultContentType === JSON_CONTENT_TYPE ? decodeResult(task) : valueJson(task.result);
}

function bulkResult(result: BulkResult): Result {
  return { matched: Number(result.matched), changed: Number(result.changed), unavailable_shards: result.unavailableShards, error: null };
}

function taskResult(task: Task): Result {
  return { id: task.id.toString(), state: taskStateToJSON(task.state), error: null };
}

/** A checkpoint as UTF-8 text, null when there is none. */
function checkpointText(checkpoint: Uint8Array | null): string | null {
  return checkpoint && checkpoint.length > 0 ? Buffer.from(checkpoint).toString("utf8") : null;
}

/** A get step's result: the task's state, snoozes, progress, checkpoint, parent, error and result. */
function gotResult(task: Task): Result {
  const progress = task.progress ? { value: task.progress.value, message: task.progress.message } : null;
  return {
    ...taskResult(task), snoozes: task.snoozes, progress, checkpoint: checkpointText(task.checkpoint),
    parent_id: task.parentId.toString(), task_error: task.error, result: resultJson(task),
  };
}

function scheduleJson(schedule: Schedule): Result {
  return {
    pool: schedule.pool, name: schedule.name, cron: schedule.cron, timezone: schedule.timezone, paused: schedule.paused,
    group_key: schedule.groupKey, next_fire_set: schedule.nextFireAt !== undefined,
  };
}

/** The schedule calls and the read calls (workers, the server's info, the snapshot); undefined for any other op. */
async function readStep(client: Client, step: Step): Promise<Result | undefined> {
  switch (step.op) {
    case "put_schedule": {
      const put = await client.putSchedule({
        pool: step.pool ?? "", name: step.name ?? "", cron: step.cron ?? "", payload: step.payload, timezone: step.timezone,
        groupKey: step.group_key, paused: step.paused,
      });
      return { ...scheduleJson(put), error: null };
    }
    case "delete_schedule":
      await client.deleteSchedule(step.pool ?? "", step.name ?? "");
      return { error: null };
    case "list_schedules": {
      const listed = await client.listSchedules({ pool: step.pool });
      const byPoolAndName = (a: Schedule, b: Schedule) => (a.pool !== b.pool ? (a.pool < b.pool ? -1 : 1) : a.name < b.name ? -1 : a.name > b.name ? 1 : 0);
      return { schedules: [...listed.schedules].sort(byPoolAndName).map(scheduleJson), unavailable_shards: listed.unavailableShards, error: null };
    }
    case "list_workers": {
      const workers = await client.listWorkers({ pool: step.pool });
      return { count: workers.workers.length, unavailable_shards: workers.unavailableShards, error: null };
    }
    case "server_info": {
      const info = await client.serverInfo();
      return { shard: info.shard, role: roleToJSON(info.role), version: info.version, error: null };
    }
    case "snapshot": {
      const snapshot = await client.snapshot();
      return { shards: snapshot.shards.map((s) => s.shard).sort(), unavailable_shards: snapshot.unavailableShards, error: null };
    }
    default:
      return undefined;
  }
}

/**
 * Enqueues one task with the outbox helper in a node-postgres transaction of the application's
 * database, commits or rolls it back; with relay_within_ms, looks the task up by key until it exists.
 */
async function outboxEnqueue(client: Client, input: Input, step: Step): Promise<Result> {
  const db = new pg.Client({ connectionString: input.database_url });
  await db.connect();
  let id: bigint;
  try {
    await db.query("BEGIN");
    try {
      id = await enqueue(db, step.pool ?? "", step.payload, { key: step.key, schema: input.outbox_schema });
    } catch (err) {
      await db.query("ROLLBACK");
      throw err;
    }
    await db.query(step.commit ? "COMMIT" : "ROLLBACK");
  } finally {
    await db.end();
  }
  const committed = performance.now();
  const within = step.relay_within_ms ?? 0;
  let relayed = false;
  while (within > 0 && !relayed && performance.now() - committed < within) {
    try {
      await client.get(refOf(step));
      relayed = true;
    } catch (err) {
      if (!(err instanceof NotFoundError)) throw err;
      await new Promise((resolve) => setTimeout(resolve, 5));
    }
  }
  return { id: id.toString(), relayed, relay_ms: within > 0 ? performance.now() - committed : 0, error: null };
}

async function clientStep(client: Client, input: Input, step: Step): Promise<Result> {
  switch (step.op) {
    case "outbox_enqueue":
      return outboxEnqueue(client, input, step);
    case "submit": {
      // In the remote span context the traceparent and tracestate give (as a server extracts them).
      const carrier: Record<string, string> = {};
      if (step.traceparent) carrier["traceparent"] = step.traceparent;
      if (step.tracestate) carrier["tracestate"] = step.tracestate;
      const ctx = new W3CTraceContextPropagator().extract(ROOT_CONTEXT, carrier, defaultTextMapGetter);
      const submitted = await context.with(ctx, () =>
        client.submit({
          pool: step.pool ?? "", payload: step.payload, key: step.key, groupKey: step.group_key,
          dependsOn: refsOf(step.depends_on).map((ref) => (typeof ref === "string" ? { key: ref } : ref)), runWhen: runWhenOf(step),
          keyMode: step.key_mode ? keyModeFromJSON(step.key_mode) : undefined, debounceMs: step.debounce_ms,
          maxDebounceMs: step.max_debounce_ms, keyTtlMs: step.key_ttl_ms,
          startBy: step.start_by_in_ms !== undefined ? Date.now() + step.start_by_in_ms : undefined,
        }));
      return {
        id: submitted.task.id.toString(), group_key: submitted.task.groupKey, deduplicated: submitted.deduplicated,
        replaced: submitted.replaced, error: null,
      };
    }
    case "get": {
      const includeDependencyResults = step.include_dependency_results ?? false;
      let task: Task;
      const extra: Result = {};
      if (step.include_attempts) {
        const got = await client.getWithAttempts(refOf(step));
        task = got.task;
        extra["attempts"] = got.attempts.map((a) => ({ attempt: a.attempt, outcome: attemptOutcomeToJSON(a.outcome), error: a.error }));
      }
      if (step.include_children) {
        const got = await client.get(refOf(step), { includeChildren: true, includeDependencyResults });
        task = got.task;
        extra["children"] = got.children.map((c) => ({ id: c.id.toString(), pool: c.pool, state: taskStateToJSON(c.state), parent_id: c.parentId.toString() }));
      } else if (!step.include_attempts || includeDependencyResults) {
        task = await client.get(refOf(step), { includeDependencyResults });
      }
      if (includeDependencyResults) {
        extra["dependency_results"] = task!.dependencyResults.map((d) => dependencyJson({ ...d, value: decodeDependencyResult(d) }));
      }
      return { ...gotResult(task!), ...extra };
    }
    case "cancel": {
      if (!step.include_descendants) return taskResult(await client.cancel(refOf(step)));
      const { task, descendantsCancelled } = await client.cancel(refOf(step), { includeDescendants: true });
      return { ...taskResult(task), descendants_cancelled: Number(descendantsCancelled) };
    }
    case "wait":
      return taskResult((await client.wait(refOf(step), step.timeout_ms && step.timeout_ms > 0 ? step.timeout_ms : 10_000)).task);
    case "retry":
      return taskResult(await client.retry(refOf(step)));
    case "delete":
      return { id: (await client.delete(refOf(step))).toString(), error: null };
    case "pause_pool":
    case "resume_pool": {
      const pause = step.op === "pause_pool" ? await client.pausePool(step.pool ?? "") : await client.resumePool(step.pool ?? "");
      return { pool: pause.pool, paused: pause.paused, error: null };
    }
    case "bulk_cancel":
      return bulkResult(await client.cancelTasks(filterOf(step.filter), { dryRun: step.dry_run }));
    case "bulk_retry":
      return bulkResult(await client.retryTasks(filterOf(step.filter), { dryRun: step.dry_run }));
    case "bulk_delete":
      return bulkResult(await client.deleteTasks(filterOf(step.filter), { dryRun: step.dry_run }));
    default:
      return (await readStep(client, step)) ?? { error: { code: "", kind: "unsupported", message: `unknown op "${step.op}"` } };
  }
}

/** Runs a worker until it has handled until_handled tasks (or started stop_after_started), then stops it gracefully; or until it fails. */
async function runWorker(opts: ConnectionOptions, step: Step): Promise<Result> {
  const started: string[] = [];
  const handled: Result[] = [];
  let running = 0;
  let most = 0;
  let signalEnough: () => void = () => {};
  const enough = new Promise<"enough">((resolve) => {
    signalEnough = () => resolve("enough");
  });
  const handler = async (task: Task, signal: AbortSignal, ctx: TaskContext): Promise<unknown> => {
    const id = task.id.toString();
    let raw: unknown = null;
    try {
      raw = decodePayload(task);
    } catch {
      raw = null;
    }
    const payload = (raw && typeof raw === "object" ? raw : {}) as Record<string, unknown>;
    started.push(id);
    running++;
    most = Math.max(most, running);
    if (started.length === step.stop_after_started) signalEnough();
    const leased = checkpointText(ctx.checkpoint);
    const current = trace.getSpanContext(context.active()); // the handler's span
    const traceId = current && trace.isSpanContextValid(current) ? current.traceId : null;
    let end: string | undefined; // set when it returns, snoozes or fails as the payload says
    const workflow: Result = {};
    try {
      workflow["dependencies"] = ctx.dependencies.map(dependencyJson);
      if (typeof payload["checkpoint"] === "string") ctx.saveCheckpoint(payload["checkpoint"]);
      const progress = Array.isArray(payload["progress"]) ? payload["progress"] as Array<{ value: number; message?: string }> : [];
      for (const p of progress) ctx.reportProgress(p.value, p.message ?? "");
      const sleepMs = payload["sleep_ms"];
      if (typeof sleepMs === "number" && sleepMs > 0) {
        await new Promise<void>((resolve, reject) => {
          const timer = setTimeout(() => {
            signal.removeEventListener("abort", onAbort);
            resolve();
          }, sleepMs);
          const onAbort = () => {
            clearTimeout(timer);
            reject(signal.reason);
          };
          if (signal.aborted) onAbort();
          else signal.addEventListener("abort", onAbort, { once: true });
        });
      }
      const snoozeMs = payload["snooze_ms"];
      const snoozeTimes = typeof payload["snooze_times"] === "number" ? payload["snooze_times"] : 1;
      if (typeof snoozeMs === "number" && ctx.snoozes < snoozeTimes) {
        end = "snoozed";
        throw new Snooze(snoozeMs, "driver");
      }
      if (Array.isArray(payload["lookup_keys"])) {
        const lookedUp: Result = {};
        for (const key of payload["lookup_keys"] as string[]) lookedUp[key] = valueJson(ctx.dependency(key));
        workflow["looked_up"] = lookedUp;
      }
      for (const spawn of (Array.isArray(payload["spawn"]) ? payload["spawn"] : []) as SpawnSpec[]) {
        ctx.spawn(spawn.pool, spawn.payload, { key: spawn.key, dependsOn: refsOf(spawn.depends_on, task.id), runWhen: runWhenOf(spawn) });
      }
      if ("fail" in payload) {
        end = "raised";
        const message = String(payload["fail"]);
        if (payload["retryable"] === false) throw nonRetryable(message);
        throw new TaskFailure(message);
      }
      end = "returned";
      if (payload["sum_dependencies"]) {
        return [...ctx.dependencyResults.values()].reduce((sum: number, v) => sum + (typeof v === "number" ? v : 0), 0);
      }
      if (typeof payload["result_bytes_b64"] === "string") return Buffer.from(payload["result_bytes_b64"], "base64");
      return payload["result"];
    } finally {
      running--;
      end ??= signal.aborted ? "cancelled" : "raised"; // the SDK cancelled it, or an error (the SDK's too)
      handled.push({ id, attempt: task.attempt, snoozes: ctx.snoozes, checkpoint: leased, payload: raw, end, trace_id: traceId, ...workflow });
      if (handled.length === step.until_handled) signalEnough();
    }
  };
  let worker: Worker;
  try {
    worker = new Worker({
      ...opts,
      pools: step.pools ?? [],
      concurrency: step.concurrency && step.concurrency > 0 ? step.concurrency : 4,
      prefetch: step.prefetch ?? undefined, // no "prefetch": the SDK's default; 0: none
      shutdownGraceMs: step.shutdown_grace_ms ?? 5000,
    }, handler);
  } catch (err) {
    return { started, handled, max_running: 0, endpoint: "", error: errorOf(err) };
  }
  const timeoutMs = step.timeout_ms && step.timeout_ms > 0 ? step.timeout_ms : 15_000;
  let failure: Result | null = null;
  let finished = false;
  const run = worker.run().then(() => null, (err: unknown) => err ?? new Error("run failed"));
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<"timeout">((resolve) => {
    timer = setTimeout(() => resolve("timeout"), timeoutMs);
  });
  const first = await Promise.race([enough, run.then((err) => ({ err })), timeout]);
  clearTimeout(timer);
  if (first === "timeout") {
    failure = { code: "", kind: "timeout", message: `the worker did not finish in ${timeoutMs} ms` };
  } else if (first !== "enough") {
    finished = true;
    if (first.err) failure = errorOf(first.err);
  }
  worker.stop();
  if (!finished) {
    let stopTimer: NodeJS.Timeout | undefined;
    const stopped = await Promise.race([
      run.then((err) => ({ err })),
      new Promise<"timeout">((resolve) => {
        stopTimer = setTimeout(() => resolve("timeout"), 30_000);
      }),
    ]);
    clearTimeout(stopTimer);
    if (stopped === "timeout") {
      failure ??= { code: "", kind: "timeout", message: "the worker did not stop in 30 s" };
    } else if (stopped.err && failure === null) {
      failure = errorOf(stopped.err);
    }
  }
  return { started: [...started], handled: [...handled], max_running: most, endpoint: worker.endpoint.toString(), error: failure };
}

async function readStdin(): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const chunk of process.stdin) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks).toString("utf8");
}

async function main(): Promise<number> {
  let input: Input;
  try {
    input = JSON.parse(await readStdin()) as Input;
  } catch (err) {
    process.stderr.write(`conformance-driver: reading the case: ${String(err)}\n`);
    return 2;
  }
  const opts = options(input);
  let client: Client | undefined;
  let clientError: unknown;
  try {
    client = new Client(opts);
  } catch (err) {
    clientError = err;
  }
  const results: Result[] = [];
  for (const step of input.steps) {
    let r: Result;
    try {
      if (step.op === "worker") r = await runWorker(opts, step);
      else if (step.op === "sleep") r = await new Promise<Result>((resolve) => setTimeout(() => resolve({ error: null }), step.ms ?? 0));
      else if (!client) r = { error: errorOf(clientError) };
      else r = await clientStep(client, input, step);
    } catch (err) {
      r = { error: errorOf(err) };
    }
    results.push({ ...r, op: step.op });
  }
  client?.close();
  process.stdout.write(JSON.stringify({ steps: results }) + "\n");
  return 0;
}

main().then((code) => process.exit(code), (err: unknown) => {
  process.stderr.write(`conformance-driver: ${String(err)}\n`);
  process.exit(1);
});
