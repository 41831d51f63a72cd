// The worker: registers with the shard of its pools (following redirects by the connection
// rules) and runs their tasks over one Work stream: credits for its free slots (and its
// prefetch: leased tasks held until a slot frees), outcomes batched, heartbeats naming the
// attempts it holds and carrying its handlers' reports (progress, checkpoints), the stream
// opened again after a failure with unanswered outcomes and reports sent again, and a graceful
// stop that gives unfinished tasks back. Each task runs in its span (OpenTelemetry, when
// installed), and the worker's log lines name the worker and the task.
import { hostname } from "node:os";
import { status as Status, type ClientDuplexStream } from "@grpc/grpc-js";
import type { Task, TaskProgress, TaskState } from "./gen/cronoq/v1/task.js";
import type { SubmitTaskRequest } from "./gen/cronoq/v1/task_service.js";
import { spawnRequest, type SpawnOptions } from "./client.js";
import {
  TaskOutcome,
  WorkRequest,
  type DeregisterWorkerResponse,
  type RegisterWorkerResponse,
  type TaskReport,
  type WorkResponse,
} from "./gen/cronoq/v1/worker_service.js";
import {
  CancelledError,
  CronoqError,
  DeadlineExceededError,
  FailedPreconditionError,
  fromGrpcError,
  InternalError,
  InvalidArgumentError,
  NotFoundError,
  PermissionDeniedError,
  RedirectRefusedError,
  TlsError,
  TooManyRedirectsError,
  UnauthenticatedError,
  UnavailableError,
  UnknownError,
} from "./errors.js";
import { TaskSpan, type SpanOutcome } from "./otel.js";
import { CONTROL_CHARACTER, shown } from "./limits.js";
import { decodeDependencyResult, encodePayload } from "./payload.js";
import {
  Connection,
  consoleLogger,
  FailureRow,
  HEALTHY_STREAM_MS,
  MAX_MESSAGE_BYTES,
  sleep,
  type ConnectionOptions,
  type Logger,
} from "./transport.js";
import type { Endpoint } from "./endpoint.js";

/**
 * Runs one attempt of a task. What it returns is the result (bytes as they are, anything else
 * as JSON). A thrown error fails the attempt, retried while attempts remain unless it is a
 * TaskFailure with retryable false; a thrown Snooze puts the task back, not counted. signal
 * aborts when the task's cancellation is requested (signal.reason: TaskCancelledError), its
 * timeout passes, its lease is lost, or the worker stops and the shutdown grace has passed
 * (WorkerStoppingError: the task is given back). ctx reports progress and checkpoints, gives
 * the results of the task's dependencies, and spawns tasks (submitted with its success). With
 * @opentelemetry/api installed, it runs with the task's span as the active span.
 */
export type Handler = (task: Task, signal: AbortSignal, ctx: TaskContext) => unknown;

/** The most a snooze lasts, in ms (TaskSnoozed.snooze_ms is a uint32). */
const MAX_SNOOZE_MS = 4_294_967_295;
/** The most bytes of UTF-8 a progress message has. */
const MAX_PROGRESS_MESSAGE_BYTES = 1024;
/**
 * Thrown by a handler: not now, run the task again in ms (rounded down to whole ms; 0: at once).
 * The task is PENDING again and the attempt is not counted. Throws RangeError when ms is not
 * from 0 to 4294967295.
 */
export class Snooze extends Error {
  /** How long the task waits, in whole ms. */
  readonly ms: number;
  readonly reason: string;

  constructor(ms: number, reason = "") {
    const whole = Math.floor(ms);
    if (!(whole >= 0 && whole <= MAX_SNOOZE_MS)) { // NaN too
      throw new RangeError(`cronoq: a snooze of ${ms} ms is not from 0 to ${MAX_SNOOZE_MS} ms`);
    }
    super(reason || `snoozed for ${whole} ms`);
    this.name = "Snooze";
    this.ms = whole;
    this.reason = reason;
  }
}

/** What a handler reported: the latest progress, the latest checkpoint. */
interface ReportUpdate {
  progress?: TaskProgress;
  checkpoint?: Buffer;
}

/** How one dependency of a task ended, as its handler sees it. */
export interface DependencyResult {
  id: bigint;
  /** Its key ("" when none). */
  key: string;
  state: TaskState;
  /** Its result: JSON parsed, other content types as bytes (a Uint8Array); null when it has none. */
  value: unknown;
  /** Why it failed or was cancelled ("" when it did not). */
  error: string;
}

/**
 * A running attempt's handle on its task beyond the Task message: how often it was snoozed,
 * its checkpoint, its reports, its dependencies' results and the tasks it spawns. Reports are
 * coalesced (the latest progress and the latest checkpoint) and carried by the worker's next
 * heartbeat, or with the attempt's outcome when it ends first; once the handler has returned,
 * reports are dropped.
 */
export class TaskContext {
  /** How many times a handler snoozed the task (Task.snoozes). */
  readonly snoozes: number;
  private current: Buffer;
  private decoded: DependencyResult[] | undefined; // decoded on first use: a handler that never reads them never fails on them

  /** Made by the worker for each attempt; spawned takes each task ctx.spawn makes. */
  constructor(private readonly task: Task, private readonly maxCheckpointBytes: number, private readonly record: (update: ReportUpdate) => void,
    private readonly spawned: (request: SubmitTaskRequest) => void) {
    this.snoozes = task.snoozes;
    this.current = task.checkpoint;
  }

  /**
   * How the task's dependencies ended, in the order it named them (a dependency deleted since
   * is left out). Throws InvalidArgumentError when a JSON result does not parse.
   */
  get dependencies(): DependencyResult[] {
    this.decoded ??= this.task.dependencyResults.map((dep) => ({
      id: dep.id, key: dep.key, state: dep.state, value: decodeDependencyResult(dep), error: dep.error,
    }));
    return this.decoded;
  }

  /** The dependencies' results by id (see dependencies). */
  get dependencyResults(): Map<bigint, unknown> {
    return new Map(this.dependencies.map((dep) => [dep.id, dep.value]));
  }

  /** The result of the dependency with that key (a string) or id (a bigint); throws RangeError naming it when the task has no such dependency. */
  dependency(keyOrId: string | bigint): unknown {
    const found = this.dependencies.find((dep) => (typeof keyOrId === "bigint" ? dep.id === keyOrId : keyOrId !== "" && dep.key === keyOrId));
    if (found) return found.value;
    const named = typeof keyOrId === "bigint" ? `id ${keyOrId}` : `key ${JSON.stringify(keyOrId)}`;
    const known = this.dependencies.map((dep) => (dep.key ? `${dep.id} (${JSON.stringify(dep.key)})` : String(dep.id)));
    throw new RangeError(`cronoq: task ${this.task.id} has no dependency with ${named}; its dependencies: ${known.join(", ") || "none"}`);
  }

  /**
   * Submits a task with this attempt's success, in the same transaction (the task never ends
   * SUCCEEDED without it): nothing is sent when the attempt fails, snoozes or is given back. The
   * task records parentId = this task's id, in a pool of its shard; the server fails the
   * attempt, not retryable, when it cannot submit one. Throws as submit does for a payload that
   * is not JSON-serializable, and FailedPreconditionError once the handler has returned.
   */
  spawn(pool: string, payload?: unknown, opts: SpawnOptions = {}): void {
    this.spawned(spawnRequest(pool, payload, opts));
  }

  /** The task's checkpoint: as leased (the last one saved by an earlier attempt), then the last one this attempt saved; null when none (empty). */
  get checkpoint(): Uint8Array | null {
    return this.current.length > 0 ? this.current : null;
  }

  /**
   * Reports the handler's progress: value any finite number (commonly 0 to 1), message at most
   * 1,024 bytes of UTF-8 without control characters, line separators (U+2028, U+2029) or bidi
   * controls (the server refuses those). Throws
   * RangeError otherwise, and records nothing.
   */
  reportProgress(value: number, message = ""): void {
    if (typeof value !== "number" || !Number.isFinite(value)) {
      throw new RangeError(`cronoq: progress ${value} is not a finite number`);
    }
    const bytes = Buffer.byteLength(message, "utf8");
    if (bytes > MAX_PROGRESS_MESSAGE_BYTES) {
      throw new RangeError(`cronoq: a progress message of ${bytes} bytes is longer than ${MAX_PROGRESS_MESSAGE_BYTES}`);
    }
    const control = CONTROL_CHARACTER.exec(message);
    if (control) {
      throw new RangeError(`cronoq: control character ${shown(control[0])} in the progress message`);
    }
    this.record({ progress: { value, message, updatedAt: undefined } });
  }

  /**
   * Saves the task's checkpoint (a string: its UTF-8), which the next attempt gets if this one
   * does not finish; empty clears it. At most max_checkpoint_bytes (RegisterWorker's; 256 KiB
   * from an older server): throws RangeError when larger, and records nothing.
   */
  saveCheckpoint(data: Uint8Array | string): void {
    const bytes = typeof data === "string" ? Buffer.from(data, "utf8") : Buffer.from(data);
    if (bytes.length > this.maxCheckpointBytes) {
      throw new RangeError(`cronoq: a checkpoint of ${bytes.length} bytes exceeds max_checkpoint_bytes ${this.maxCheckpointBytes}`);
    }
    this.current = bytes;
    this.record({ checkpoint: bytes });
  }
}

/** The task's cancellation was requested: it ends CANCELLED. */
export class TaskCancelledError extends Error {
  constructor() {
    super("cronoq: the task's cancellation was requested");
    this.name = "TaskCancelledError";
  }
}
/** The worker is stopping and its shutdown grace has passed: the task is given back. */
export class WorkerStoppingError extends Error {
  constructor() {
    super("cronoq: the worker is stopping and its shutdown grace has passed");
    this.name = "WorkerStoppingError";
  }
}
/** The task is no longer leased to this worker. */
export class LeaseLostError extends Error {
  constructor() {
    super("cronoq: the task is no longer leased to this worker");
    this.name = "LeaseLostError";
  }
}
/** The attempt's timeout passed. */
export class TaskTimeoutError extends Error {
  constructor(ms: bigint) {
    super(`cronoq: the attempt's timeout of ${ms} ms passed`);
    this.name = "TaskTimeoutError";
  }
}

/** A handler's error that says how the attempt fails. */
export class TaskFailure extends Error {
  /** False ends the task FAILED whatever attempts remain. */
  readonly retryable: boolean;
  /** Overrides the pool's backoff before the next attempt when > 0. */
  readonly retryAfterMs: number;

  constructor(message: string, opts: { retryable?: boolean; retryAfterMs?: number } = {}) {
    super(message);
    this.name = "TaskFailure";
    this.retryable = opts.retryable ?? true;
    this.retryAfterMs = opts.retryAfterMs ?? 0;
  }
}

/** Fails the attempt and the task, whatever attempts remain. */
export function nonRetryable(err: unknown): TaskFailure {
  return new TaskFailure(err instanceof Error ? err.message : String(err), { retryable: false });
}

/** Fails the attempt; the next starts no sooner than after ms. */
export function retryAfter(err: unknown, ms: number): TaskFailure {
  return new TaskFailure(err instanceof Error ? err.message : String(err), { retryable: true, retryAfterMs: ms });
}

export interface WorkerOptions extends ConnectionOptions {
  /** The pools the worker runs tasks of (required). */
  pools: string[];
  /** The most handlers running at once; 16 when absent. */
  concurrency?: number;
  /**
   * How many leased tasks the worker holds beyond those its handlers run, so a slot that frees
   * starts the next task at once instead of after a round trip to the server; 0: none. When
   * absent, 4 tasks a slot (`defaultPrefetch`): the server sends beyond the free slots only what
   * the worker starts within about a step, so a worker with slow handlers holds nothing another
   * worker could start. A held task's lease and timeout run while it waits.
   */
  prefetch?: number;
  /** Shown by ListWorkers; hostname-pid when absent. */
  name?: string;
  labels?: Record<string, string>;
  /** How long running tasks may go on once the worker stops; those still running then are aborted and given back. 30 s when absent. */
  shutdownGraceMs?: number;
  /** How long an outcome waits for others to join its report while handlers run; 2 ms when absent, none when 0. */
  finishLingerMs?: number;
}

const MAX_REDIRECTS = 3;
const MAX_FINISH_BATCH = 1000;
// The most tasks a worker holds (concurrency + prefetch): the credits a Work stream may carry.
const MAX_HELD = 100_000;
// A worker's default prefetch, in tasks a slot (at concurrency 64 on PostgreSQL, no-op tasks:
// prefetch 64 drains at 0.8x prefetch 256, and 1,024 no faster than 256).
const PREFETCH_PER_SLOT = 4;

/**
 * A worker's prefetch when none is given: PREFETCH_PER_SLOT tasks a slot (fewer when both would
 * pass MAX_HELD). The server sends beyond its free slots only what it starts within about a step
 * (WorkRequest.slots), so a worker with slow handlers holds nothing.
 */
export function defaultPrefetch(concurrency: number): number {
  return Math.min(PREFETCH_PER_SLOT * concurrency, MAX_HELD - concurrency);
}
const MIB = 1 << 20;
const DEFAULT_MAX_RESULT_BYTES = 4 * MIB;
const DEFAULT_MAX_LEASE_BYTES = 16 * MIB;
const DEFAULT_MAX_CHECKPOINT_BYTES = 256 * 1024;
// Room left under MAX_MESSAGE_BYTES for what a message carries besides tasks or outcomes.
const MAX_REQUEST_BYTES = MAX_MESSAGE_BYTES - MIB;
const MIN_LEASE_BYTES = MIB;
const RELEASE_REASON = "worker shut down";
// An outcome's or a report's tag and length prefix, and the message's.
const FRAMING = 16;
// After the shutdown grace: how long aborted handlers get to return, and the time left for the last reports.
const UNWIND_MS = 1000;
const STOP_EXTRA_MS = 3000;
const DEREGISTER_TIMEOUT_MS = 2000;

interface RunningTask {
  task: Task;
  attempt: number;
  spawned: SubmitTaskRequest[]; // sent with its success
  returned: boolean; // its handler returned or threw: it spawns nothing more
  span?: TaskSpan; // while its handler runs, when tracing
  abort: AbortController;
  done: Promise<void>;
  finished: boolean;
  cancelRequested: boolean; // the server asked: report it cancelled
  releasing: boolean; // aborted at shutdown: give it back
  lost: boolean; // no longer ours: report nothing
}

/** A running attempt's reports not yet answered: each the latest, with its version (what replaced it has a newer one). */
interface PendingReport {
  attempt: number;
  progress?: { value: TaskProgress; version: number };
  checkpoint?: { data: Buffer; version: number };
}

/** The versions of a task's report a heartbeat carried. */
interface SentReport {
  progress?: number;
  checkpoint?: number;
}

/** A prefetched task: leased to this worker, waiting for a slot. */
interface HeldTask {
  task: Task;
  received: number; // performance.now() when it came: its timeout counts from its lease
}

/** A wake-up flag with one waiter: notify() before wait() is not lost. */
class Wake {
  private pending = false;
  private waiter: (() => void) | undefined;

  notify(): void {
    const waiter = this.waiter;
    if (waiter) {
      this.waiter = undefined;
      waiter();
    } else {
      this.pending = true;
    }
  }

  wait(timeoutMs: number | undefined, signal: AbortSignal): Promise<"wake" | "timeout" | "abort"> {
    if (this.pending) {
      this.pending = false;
      return Promise.resolve("wake");
    }
    if (signal.aborted) return Promise.resolve("abort");
    return new Promise((resolve) => {
      let timer: NodeJS.Timeout | undefined;
      const finish = (why: "wake" | "timeout" | "abort") => {
        clearTimeout(timer);
        signal.removeEventListener("abort", onAbort);
        if (why !== "wake") this.waiter = undefined;
        resolve(why);
      };
      const onAbort = () => finish("abort");
      this.waiter = () => finish("wake");
      if (timeoutMs !== undefined) timer = setTimeout(() => finish("timeout"), Math.max(timeoutMs, 0));
      signal.addEventListener("abort", onAbort, { once: true });
    });
  }
}

/**
 * The worker's log lines: each with its worker_id once registered (first, unless the line gives
 * one), and without the fields that are undefined.
 */
function workerLogger(log: Logger, workerId: () => string): Logger {
  const fields = (given?: Record<string, unknown>): Record<string, unknown> | undefined => {
    const id = workerId();
    if (!id && given === undefined) return undefined;
    const all: Record<string, unknown> = id ? { worker_id: id } : {};
    for (const [k, v] of Object.entries(given ?? {})) if (v !== undefined) all[k] = v;
    return all;
  };
  return {
    debug: (message, given) => log.debug(message, fields(given)),
    info: (message, given) => log.info(message, fields(given)),
    warn: (message, given) => log.warn(message, fields(given)),
    error: (message, given) => log.error(message, fields(given)),
  };
}

/** A task's fields in a log line: task_id (decimal), attempt, pool. */
function taskFields(task: Task, more: Record<string, unknown> = {}): Record<string, unknown> {
  return { task_id: task.id.toString(), attempt: task.attempt, pool: task.pool, ...more };
}

/** What an outcome says, as the task's span's cronoq.task.outcome does. */
function spanOutcome(outcome: TaskOutcome): SpanOutcome {
  if (outcome.success) return "success";
  if (outcome.snoozed) return "snoozed";
  if (outcome.cancelled) return "cancelled";
  if (outcome.released) return "released";
  return "failure";
}

/** About how many bytes a success's spawned tasks take in a message. */
function spawnBytes(spawn: SubmitTaskRequest[]): number {
  let bytes = 0;
  for (const s of spawn) {
    bytes += s.payload.length + 3 * (s.pool.length + s.key.length + s.groupKey.length) + FRAMING + 64;
    for (const ref of s.dependsOn) bytes += 3 * (ref.key?.length ?? 0) + FRAMING;
  }
  return bytes;
}

/** About how many bytes a report takes in a message. */
function reportBytes(report: TaskReport): number {
  return (report.checkpoint?.length ?? 0) + 3 * (report.progress?.message.length ?? 0) + FRAMING + 32;
}

/** Waits for promise, at most ms (the timer does not outlive the wait). */
async function within(promise: Promise<unknown>, ms: number): Promise<void> {
  const timeout = new AbortController();
  try {
    await Promise.race([promise, sleep(ms, timeout.signal)]);
  } finally {
    timeout.abort();
  }
}

/** Waits up to ms for the tasks' handlers to return; returns those still running. */
async function waitAll(tasks: Array<[bigint, RunningTask]>, ms: number): Promise<Array<[bigint, RunningTask]>> {
  await within(Promise.all(tasks.map(([, rt]) => rt.done)), ms);
  return tasks.filter(([, rt]) => !rt.finished);
}

/**
 * Registers with the shard of its pools and runs their tasks. Create it, then `await
 * worker.run()`; `worker.stop()` stops it gracefully (run resolves once running tasks have
 * finished, within shutdownGraceMs, and every outcome is reported).
 */
export class Worker {
  private readonly conn: Connection;
  private readonly pools: string[];
  private readonly concurrency: number;
  private readonly prefetch: number;
  private readonly name: string;
  private readonly labels: Record<string, string>;
  private readonly shutdownGraceMs: number;
  private readonly finishLingerMs: number;
  private readonly wake = new Wake();
  private readonly stopCtl = new AbortController();
  private readonly calls = new AbortController(); // the worker's own calls, after the graceful stop's time
  private started = false;

  private workerId = "";
  private heartbeatMs = 10_000;
  private maxResultBytes = DEFAULT_MAX_RESULT_BYTES;
  private leaseBytes = DEFAULT_MAX_LEASE_BYTES;
  private maxLeaseBytes = DEFAULT_MAX_LEASE_BYTES;
  private maxCheckpointBytes = DEFAULT_MAX_CHECKPOINT_BYTES;
  private readonly running = new Map<bigint, RunningTask>();
  private readonly held = new Map<bigint, HeldTask>(); // prefetched, in arrival order
  private readonly unacked = new Map<bigint, TaskOutcome>(); // reported, not yet answered
  private readonly unackedPools = new Map<bigint, string>(); // their tasks' pools (for the log)
  private outcomes: TaskOutcome[] = []; // not yet sent on the current stream
  // Running attempts' reports not yet answered, in the order they became pending (so a report
  // a full heartbeat left out goes first in the next).
  private readonly reports = new Map<bigint, PendingReport>();
  private reportVersion = 0;
  private sentBeats: Array<Map<bigint, SentReport>> = []; // the current stream's heartbeats not yet answered, oldest first
  private freed = 0; // tasks that left the worker's hands, not yet given back as credits
  private beatDue = false;
  private stopping = false;
  private closed = false; // the current stream's side is closed: nothing more can be reported
  private streamAnswered = false; // the current stream delivered a message: it is healthy
  private processedCount = 0;

  constructor(opts: WorkerOptions, private readonly handler: Handler) {
    if (!opts.pools || opts.pools.length === 0) {
      throw new InvalidArgumentError(Status.INVALID_ARGUMENT, "pools: give at least one pool");
    }
    const concurrency = opts.concurrency ?? 16;
    if (!Number.isInteger(concurrency) || concurrency < 1) {
      throw new InvalidArgumentError(Status.INVALID_ARGUMENT, `concurrency: ${concurrency} must be an integer of at least 1`);
    }
    const prefetch = opts.prefetch ?? defaultPrefetch(concurrency);
    if (!Number.isInteger(prefetch) || prefetch < 0 || concurrency + prefetch > MAX_HELD) {
      throw new InvalidArgumentError(Status.INVALID_ARGUMENT,
        `prefetch: ${prefetch} must be an integer of at least 0, and concurrency + prefetch at most ${MAX_HELD}`);
    }
    if (typeof handler !== "function") {
      throw new InvalidArgumentError(Status.INVALID_ARGUMENT, "handler: give a function (task, signal) => result");
    }
    // Every line the worker logs names it (worker_id), once registered.
    this.conn = new Connection({ ...opts, logger: workerLogger(opts.logger ?? consoleLogger, () => this.workerId) });
    this.pools = [...opts.pools];
    this.concurrency = concurrency;
    this.prefetch = prefetch;
    this.name = opts.name || `${hostname()}-${process.pid}`;
    this.labels = { ...(opts.labels ?? {}) };
    this.shutdownGraceMs = opts.shutdownGraceMs && opts.shutdownGraceMs > 0 ? opts.shutdownGraceMs : 30_000;
    this.finishLingerMs = opts.finishLingerMs ?? 2;
  }

  /** The server the worker talks to now. */
  get endpoint(): Endpoint {
    return this.conn.endpoint;
  }

  /** The worker id the server gave at registration ("" before). */
  get id(): string {
    return this.workerId;
  }

  /** The number of outcomes the server has acknowledged. */
  get processed(): number {
    return this.processedCount;
  }

  /** Asks the worker to stop taking tasks; run() resolves once running tasks have finished (within the grace) and every outcome is reported. */
  stop(): void {
    this.stopCtl.abort();
  }

  /**
   * Registers and runs tasks until stop(), then stops gracefully. Rejects when the worker
   * cannot go on: its credentials refused, a TLS failure, a redirect refused or too many redirects.
   */
  async run(): Promise<void> {
    if (this.started) throw new FailedPreconditionError(Status.FAILED_PRECONDITION, "worker: run() was called already");
    this.started = true;
    try {
      await this.register();
      if (this.stopCtl.signal.aborted) {
        await this.deregister();
        return;
      }
      this.conn.log.info("cronoq: worker registered", { endpoint: this.endpoint.toString(), pools: this.pools });
      const heartbeats = setInterval(() => {
        this.beatDue = true;
        this.wake.notify();
      }, this.heartbeatMs);
      let workError: unknown;
      const workDone = this.workLoop().catch((err: unknown) => {
        workError = err;
      });
      const stopped = new Promise<void>((resolve) => {
        if (this.stopCtl.signal.aborted) resolve();
        this.stopCtl.signal.addEventListener("abort", () => resolve(), { once: true });
      });
      await Promise.race([workDone, stopped]);
      this.stopping = true; // also when the stream failed for good: unfinished tasks are released
      this.wake.notify();
      await this.finishRunning(workDone);
      clearInterval(heartbeats);
      await this.deregister();
      if (workError !== undefined) throw workError;
    } finally {
      this.calls.abort();
      this.conn.close();
    }
  }

  /** Registers, following up to 3 redirects in a row; UNAVAILABLE is retried until stop(). Returns without registering when stopped first. */
  private async register(): Promise<void> {
    const stopSignal = this.stopCtl.signal;
    const req = { name: this.name, pools: this.pools, concurrency: this.concurrency, labels: this.labels };
    let redirects = 0;
    const row = new FailureRow(this.conn.retry, this.conn.log, "worker registration");
    let chain = [this.conn.endpoint.toString()]; // where it went, and where each server sent it
    for (;;) {
      let resp: RegisterWorkerResponse;
      try {
        resp = await this.conn.once<RegisterWorkerResponse>((c, md, o, cb) => c.worker.registerWorker(req, md, o, cb), this.conn.timeoutMs, stopSignal);
      } catch (err) {
        if (stopSignal.aborted) return;
        if (err instanceof FailedPreconditionError && !(err instanceof TooManyRedirectsError) &&
            !(err instanceof RedirectRefusedError) && err.shardEndpoint) {
          redirects++;
          chain.push(`shard ${err.shard || "?"} at ${err.shardEndpoint}`);
          if (redirects > MAX_REDIRECTS) {
            throw new TooManyRedirectsError(Status.FAILED_PRECONDITION,
              `worker for [${this.pools.join(", ")}] was redirected more than ${MAX_REDIRECTS} times in a row: ` +
              `${chain.join(" -> ")}: check the [[shards]] endpoints`, { shard: err.shard, shardEndpoint: err.shardEndpoint });
          }
          this.conn.log.info("cronoq: reconnecting to the shard of the worker's pools", { shard: err.shard, endpoint: err.shardEndpoint });
          this.conn.follow(err.shardEndpoint, err.code);
          continue;
        }
        if (err instanceof UnavailableError) {
          // The leader a standby names, or else the next configured endpoint (so a redirect
          // target that is down sends the worker back to its configured one).
          this.conn.onUnavailable(err);
          if (this.conn.isConfigured(this.conn.endpoint)) {
            redirects = 0;
            chain = [this.conn.endpoint.toString()];
          }
          if (!(await sleep(row.failed(err, this.conn.endpoint), stopSignal))) return;
          continue;
        }
        throw err;
      }
      row.succeeded();
      this.workerId = resp.workerId;
      this.heartbeatMs = Math.max(resp.heartbeatIntervalMs, 100);
      this.maxResultBytes = Math.min(Number(resp.maxResultBytes) || DEFAULT_MAX_RESULT_BYTES, MAX_REQUEST_BYTES);
      this.maxLeaseBytes = Math.min(Number(resp.maxLeaseBytes) || DEFAULT_MAX_LEASE_BYTES, MAX_REQUEST_BYTES);
      this.leaseBytes = this.maxLeaseBytes;
      this.maxCheckpointBytes = Math.min(Number(resp.maxCheckpointBytes) || DEFAULT_MAX_CHECKPOINT_BYTES, MAX_REQUEST_BYTES);
      return;
    }
  }

  private async deregister(): Promise<void> {
    if (!this.workerId) return;
    const req = { workerId: this.workerId };
    try {
      await this.conn.once<DeregisterWorkerResponse>((c, md, o, cb) => c.worker.deregisterWorker(req, md, o, cb), DEREGISTER_TIMEOUT_MS);
    } catch (err) {
      this.conn.log.debug("cronoq: deregister failed", { error: String(err) });
    }
  }

  /** Stopping, and nothing left to run or to report. */
  private finished(): boolean {
    return this.stopping && this.running.size === 0 && this.held.size === 0 && this.unacked.size === 0;
  }

  /** The graceful stop: held tasks are released at once, running tasks finish within the grace, the others are aborted and released; then every outcome is reported, for at most STOP_EXTRA_MS more. */
  private async finishRunning(workDone: Promise<void>): Promise<void> {
    const deadline = Date.now() + this.shutdownGraceMs + STOP_EXTRA_MS;
    if (this.held.size > 0) {
      this.conn.log.info("cronoq: releasing prefetched tasks", { tasks: this.held.size });
      for (const [id, { task }] of this.held) {
        this.queue(TaskOutcome.fromPartial({ taskId: id, attempt: task.attempt, released: { reason: RELEASE_REASON } }), task.pool);
      }
      this.held.clear();
    }
    const running = [...this.running.entries()];
    if (running.length > 0) {
      this.conn.log.info("cronoq: waiting for running tasks", { running: running.length });
      const pending = await waitAll(running, this.shutdownGraceMs);
      if (pending.length > 0) {
        this.conn.log.warn("cronoq: releasing tasks still running after the shutdown grace", { tasks: pending.length });
        for (const [, rt] of pending) {
          rt.releasing = true;
          rt.abort.abort(new WorkerStoppingError());
        }
        const stuck = await waitAll(pending, UNWIND_MS);
        for (const [id, rt] of stuck) { // the handler ignores its signal: release the task anyway
          this.conn.log.warn("cronoq: handler ignores its abort signal; releasing the task", taskFields(rt.task));
          rt.lost = true; // whatever it returns or reports later is not reported
          this.running.delete(id);
          const report = this.takeReport(id, rt.attempt);
          this.queue(TaskOutcome.fromPartial({ taskId: id, attempt: rt.attempt, released: { reason: RELEASE_REASON }, report }), rt.task.pool);
          rt.span?.end("released");
        }
      }
    }
    this.wake.notify(); // the stream closes its side once every outcome is answered
    await within(workDone, Math.max(deadline - Date.now(), 0));
    this.calls.abort();
    await workDone;
    if (this.unacked.size > 0) {
      this.conn.log.warn("cronoq: outcomes not acknowledged at shutdown; their leases will expire", { outcomes: this.unacked.size });
    }
  }

  /**
   * Opens Work streams one after the other until the worker is finished: a stream that fails is
   * opened again (on the server an UNAVAILABLE names) after a backoff that grows with the
   * failures in a row and starts over after a healthy stream (one that delivered a message or
   * stayed open HEALTHY_STREAM_MS).
   */
  private async workLoop(): Promise<void> {
    const calls = this.calls.signal;
    const row = new FailureRow(this.conn.retry, this.conn.log, "work stream");
    while (!this.finished()) {
      const opened = Date.now();
      this.streamAnswered = false;
      let err = await this.workStream();
      if (calls.aborted) return; // the graceful stop's time is up
      if (this.streamAnswered || Date.now() - opened >= HEALTHY_STREAM_MS) row.succeeded();
      if (this.finished()) return;
      if (err === undefined) { // the server ended it cleanly: opened again, but not in a tight loop
        err = new UnavailableError(Status.UNAVAILABLE, "the server ended the stream");
      } else if (err instanceof PermissionDeniedError || err instanceof UnauthenticatedError || err instanceof TlsError) {
        throw err; // no retry can help: run() fails with the reason
      } else if (err instanceof FailedPreconditionError && err.shardEndpoint) {
        throw err; // the pools moved to another shard
      } else if (err instanceof UnavailableError) {
        this.conn.onUnavailable(err); // to the leader a standby names, or the next endpoint
      } else if (!(err instanceof NotFoundError || err instanceof CancelledError || err instanceof DeadlineExceededError ||
          err instanceof InternalError || err instanceof UnknownError || !(err instanceof CronoqError))) {
        // e.g. RESOURCE_EXHAUSTED, an answer over the receive limit: smaller answers
        this.leaseBytes = Math.max(Math.floor(this.leaseBytes / 2), MIN_LEASE_BYTES);
        this.conn.log.error("cronoq: work stream failed; opening it again with a smaller max_bytes", { error: String(err) });
      }
      await sleep(row.failed(err, this.endpoint), calls);
      if (err instanceof NotFoundError) {
        this.conn.log.warn("cronoq: worker unknown to the server; registering again");
        await this.register();
      }
    }
  }

  /** One Work stream: the first message gives the worker's slots and the room left (slots and prefetch); the sender sends outcomes, freed slots and heartbeats; answers are read until the server ends it. */
  private async workStream(): Promise<Error | undefined> {
    const { clients, endpoint } = this.conn.clients();
    const call = clients.worker.work(this.conn.metadata());
    const streamCtl = new AbortController();
    const onCallsAbort = () => call.cancel();
    this.calls.signal.addEventListener("abort", onCallsAbort, { once: true });
    this.outcomes = [...this.unacked.values()]; // what an earlier stream did not answer
    this.sentBeats = []; // their reports are still pending: the next heartbeat carries them
    this.freed = 0;
    this.closed = false;
    const free = this.stopping ? 0 : this.concurrency + this.prefetch - this.running.size - this.held.size;
    const first = WorkRequest.fromPartial({ workerId: this.workerId, credits: Math.max(free, 0), maxBytes: BigInt(this.leaseBytes),
      slots: this.concurrency });
    if (this.outcomes.length > 0) this.wake.notify(); // sent right after the first message

    const ended = new Promise<Error | undefined>((resolve) => {
      let readEnded = false;
      let cleanStatus = false;
      call.on("data", (answer: WorkResponse) => {
        this.streamAnswered = true;
        this.answered(answer);
      });
      call.on("error", (err: unknown) => resolve(fromGrpcError(err)));
      call.on("end", () => {
        readEnded = true;
        if (cleanStatus) resolve(undefined);
      });
      call.on("status", (s: { code: number }) => {
        if (s.code !== Status.OK) return; // the "error" event carries it
        cleanStatus = true;
        if (readEnded) resolve(undefined);
      });
    });
    const sender = this.sendLoop(call, first, streamCtl.signal);
    let err = await ended;
    streamCtl.abort();
    this.calls.signal.removeEventListener("abort", onCallsAbort);
    call.cancel();
    await sender;
    if (err !== undefined) err = await this.conn.diagnose(endpoint, err);
    return err;
  }

  /** Sends the stream's messages; closes its side once stopping and every outcome is answered. */
  private async sendLoop(call: ClientDuplexStream<WorkRequest, WorkResponse>, first: WorkRequest, signal: AbortSignal): Promise<void> {
    let message: WorkRequest | undefined = first;
    for (;;) {
      if (message !== undefined) {
        if (signal.aborted) return;
        try {
          call.write(message);
        } catch {
          return; // the stream ended: the reader sees why
        }
      }
      if (this.finished()) {
        // Closing: every outcome is answered; a task sent from now on is dropped, and the
        // server, told so, releases it as the stream ends.
        this.closed = true;
        call.write(WorkRequest.fromPartial({ closing: true }));
        call.end();
        return;
      }
      if ((await this.wake.wait(undefined, signal)) === "abort") return;
      const linger = this.finishLingerMs > 0 && this.outcomes.length > 0 && this.running.size > 0 &&
        this.outcomes.length < MAX_FINISH_BATCH && !this.stopping;
      if (linger && !(await this.linger(signal))) return;
      message = this.nextMessage();
    }
  }

  /** Waits for more outcomes to join the pending ones: until every handler has returned, the batch is full, or the linger passes. False when the stream ends first. */
  private async linger(signal: AbortSignal): Promise<boolean> {
    const deadline = Date.now() + this.finishLingerMs;
    for (;;) {
      const why = await this.wake.wait(deadline - Date.now(), signal);
      if (why === "abort") return false;
      if (why === "timeout") return true;
      if (!(this.running.size > 0 && this.outcomes.length < MAX_FINISH_BATCH)) {
        this.wake.notify(); // what woke it may need sending too
        return true;
      }
    }
  }

  /** The next message to send, or undefined when there is nothing to say. */
  private nextMessage(): WorkRequest | undefined {
    const [outcomes, size] = this.nextBatch();
    let credits = 0;
    if (!this.stopping) {
      credits = this.freed;
      this.freed = 0;
    }
    let heartbeat: WorkRequest["heartbeat"];
    if (this.beatDue) {
      this.beatDue = false;
      const tasks = [...this.running.entries()].map(([taskId, rt]) => ({ taskId, attempt: rt.attempt }));
      for (const [taskId, { task }] of this.held) tasks.push({ taskId, attempt: task.attempt });
      for (const [taskId, o] of this.unacked) {
        if (!this.running.has(taskId) && !this.held.has(taskId)) tasks.push({ taskId, attempt: o.attempt });
      }
      heartbeat = { tasks, reports: this.nextReports(MAX_REQUEST_BYTES - size) };
    }
    if (this.outcomes.length > 0) this.wake.notify(); // the rest in the next message
    if (outcomes.length === 0 && credits === 0 && heartbeat === undefined) return undefined;
    return WorkRequest.fromPartial({ outcomes, credits, heartbeat });
  }

  /** The oldest outcomes that fit one message: at most MAX_FINISH_BATCH and MAX_REQUEST_BYTES (one always goes); and about how many bytes they take. */
  private nextBatch(): [TaskOutcome[], number] {
    let size = FRAMING;
    let n = 0;
    for (const o of this.outcomes) {
      if (n === MAX_FINISH_BATCH) break;
      const next = size + (o.success ? o.success.result.length + spawnBytes(o.success.spawn) : 0) + 3 * (o.failure?.error.length ?? 0) + 3 * (o.cancelled?.reason.length ?? 0) +
        3 * (o.released?.reason.length ?? 0) + 3 * (o.snoozed?.reason.length ?? 0) + (o.report ? reportBytes(o.report) : 0) + FRAMING + 32;
      if (n > 0 && next > MAX_REQUEST_BYTES) break;
      size = next;
      n++;
    }
    return [this.outcomes.splice(0, n), size];
  }

  /**
   * A heartbeat's reports: one per running attempt with something pending, those pending
   * longest first, in at most room bytes (the others wait for the next heartbeat). Each stays
   * pending until the heartbeat is answered; what the heartbeat carried is recorded for then.
   */
  private nextReports(room: number): TaskReport[] {
    const reports: TaskReport[] = [];
    const sent = new Map<bigint, SentReport>();
    for (const [taskId, pending] of this.reports) {
      const report: TaskReport = { taskId, attempt: pending.attempt, progress: pending.progress?.value, checkpoint: pending.checkpoint?.data };
      const bytes = reportBytes(report);
      if (bytes > room) continue;
      room -= bytes;
      reports.push(report);
      sent.set(taskId, { progress: pending.progress?.version, checkpoint: pending.checkpoint?.version });
    }
    this.sentBeats.push(sent);
    return reports;
  }

  /**
   * A heartbeat was answered: what it carried of each report is no longer pending, unless a
   * newer one replaced it since. The server may answer several heartbeats at once: the answer
   * is taken as the oldest one's (a report of a later one stays pending, sent again, until the
   * next answer).
   */
  private reportsAnswered(): void {
    for (const [taskId, sent] of this.sentBeats.shift() ?? []) {
      const pending = this.reports.get(taskId);
      if (!pending) continue;
      if (pending.progress && pending.progress.version === sent.progress) delete pending.progress;
      if (pending.checkpoint && pending.checkpoint.version === sent.checkpoint) delete pending.checkpoint;
      if (!pending.progress && !pending.checkpoint) this.reports.delete(taskId);
    }
  }

  /** Records a running attempt's report (the latest replaces what was pending); nothing once the attempt has ended, been given back or lost. */
  private record(taskId: bigint, rt: RunningTask, update: ReportUpdate): void {
    if (rt.lost || this.running.get(taskId) !== rt) return;
    let pending = this.reports.get(taskId);
    if (!pending) {
      pending = { attempt: rt.attempt };
      this.reports.set(taskId, pending);
    }
    const version = ++this.reportVersion;
    if (update.progress) pending.progress = { value: update.progress, version };
    if (update.checkpoint) pending.checkpoint = { data: update.checkpoint, version };
  }

  /** What of the attempt's report is still pending, unsent or unanswered (for its outcome); it is no longer pending. */
  private takeReport(taskId: bigint, attempt: number): TaskReport | undefined {
    const pending = this.reports.get(taskId);
    if (!pending || pending.attempt !== attempt) return undefined;
    this.reports.delete(taskId);
    return { taskId, attempt, progress: pending.progress?.value, checkpoint: pending.checkpoint?.data };
  }

  /** Handles what the server sent: tasks to run, the results of outcomes, a heartbeat's answer. */
  private answered(answer: WorkResponse): void {
    for (const r of answer.results) {
      const outcome = this.unacked.get(r.taskId);
      const pool = this.unackedPools.get(r.taskId);
      if (this.unacked.delete(r.taskId)) this.processedCount++;
      this.unackedPools.delete(r.taskId);
      if (!r.accepted) {
        this.conn.log.warn("cronoq: outcome refused",
          { task_id: r.taskId.toString(), attempt: outcome?.attempt, pool, code: r.code, message: r.message });
      }
    }
    for (const task of answer.tasks) {
      if (this.closed) { // sent as the stream closed: the server releases it, as nothing can be sent
        this.conn.log.debug("cronoq: task arrived after the work stream closed; the server releases it", taskFields(task));
        continue;
      }
      if (this.stopping) { // sent for slots given before the stop: give it back
        this.freed++;
        this.queue(TaskOutcome.fromPartial({ taskId: task.id, attempt: task.attempt, released: { reason: RELEASE_REASON } }), task.pool);
        continue;
      }
      if (this.running.size < this.concurrency) this.start(task, performance.now());
      else this.held.set(task.id, { task, received: performance.now() }); // starts as a handler ends
    }
    if (answer.heartbeat) {
      this.reportsAnswered();
      for (const id of answer.heartbeat.cancelledTaskIds) {
        const held = this.held.get(id);
        if (held) { // never started: it ends CANCELLED without its handler
          this.held.delete(id);
          this.freed++;
          this.queue(TaskOutcome.fromPartial({ taskId: id, attempt: held.task.attempt, cancelled: { reason: "cancelled" } }), held.task.pool);
          continue;
        }
        const rt = this.running.get(id);
        if (rt) {
          rt.cancelRequested = true;
          rt.abort.abort(new TaskCancelledError());
        }
      }
      for (const id of answer.heartbeat.lostTaskIds) {
        const held = this.held.get(id);
        if (held) { // never started: dropped, nothing reported
          this.held.delete(id);
          this.conn.log.warn("cronoq: task lost its lease before it started", taskFields(held.task));
          this.freed++;
          continue;
        }
        const rt = this.running.get(id);
        if (rt) {
          this.conn.log.warn("cronoq: task lost its lease; its outcome will not be reported", taskFields(rt.task));
          rt.lost = true;
          this.takeReport(id, rt.attempt); // the server would ignore it
          rt.abort.abort(new LeaseLostError());
        }
      }
    }
    this.wake.notify();
  }

  /** Runs the task's handler in a free slot; received: when the task came (its timeout counts from then). */
  private start(task: Task, received: number): void {
    const rt: RunningTask = {
      task, attempt: task.attempt, spawned: [], returned: false, abort: new AbortController(), done: Promise.resolve(), finished: false,
      cancelRequested: false, releasing: false, lost: false,
    };
    this.running.set(task.id, rt);
    rt.done = this.execute(task, rt, received)
      .catch((err: unknown) => this.conn.log.error("cronoq: reporting a task's outcome failed", taskFields(task, { error: String(err) })))
      .finally(() => {
        rt.finished = true;
      });
  }

  /**
   * A slot is free: the oldest held task starts in it. One whose timeout ran out while it was
   * held fails as timed out without running (the server ends its lease there). None start once
   * stopping: they are released.
   */
  private startHeld(): void {
    for (const [id, { task, received }] of this.held) {
      if (this.stopping || this.running.size >= this.concurrency) return;
      this.held.delete(id);
      if (task.timeoutMs > 0n && performance.now() - received >= Number(task.timeoutMs)) {
        this.freed++;
        this.queue(TaskOutcome.fromPartial({
          taskId: id, attempt: task.attempt,
          failure: { error: `timed out after ${task.timeoutMs} ms, before it could start`, retryable: true, retryAfterMs: 0 },
        }), task.pool);
        continue;
      }
      this.start(task, received);
    }
  }

  private async execute(task: Task, rt: RunningTask, received: number): Promise<void> {
    let timedOut = false;
    // The attempt's timeout counts from its lease: a held task's handler gets what is left.
    const timer = task.timeoutMs > 0n
      ? setTimeout(() => {
        timedOut = true;
        rt.abort.abort(new TaskTimeoutError(task.timeoutMs));
      }, Number(task.timeoutMs) - (performance.now() - received))
      : undefined;
    const ctx = new TaskContext(task, this.maxCheckpointBytes, (update) => this.record(task.id, rt, update), (request) => {
      if (rt.returned) {
        throw new FailedPreconditionError(Status.FAILED_PRECONDITION, `spawn: the handler of task ${task.id} has returned; nothing more is sent with its outcome`);
      }
      rt.spawned.push(request);
    });
    let ok = false;
    let result: unknown;
    let error: unknown;
    try {
      await Promise.resolve(); // the handler runs after start() has recorded the task
      // In the task's span: the child of its trace context's (so of the submitter's span), or a
      // root linked to a schedule's, or a root.
      rt.span = TaskSpan.start(task);
      const handle = () => this.handler(task, rt.abort.signal, ctx);
      result = await (rt.span ? rt.span.run(handle) : handle());
      ok = true;
    } catch (err) {
      error = err;
    } finally {
      rt.returned = true;
      clearTimeout(timer);
    }
    if (this.running.get(task.id) === rt) {
      this.running.delete(task.id);
      this.freed++;
      this.startHeld();
    }
    if (rt.lost) { // no longer ours (or released already at shutdown: its span ended so)
      rt.span?.end("lost");
      this.wake.notify();
      return;
    }
    const outcome = TaskOutcome.fromPartial({ taskId: task.id, attempt: task.attempt });
    outcome.report = this.takeReport(task.id, task.attempt);
    const failure = (message: string, retryable: boolean, afterMs = 0) => {
      outcome.failure = { error: message, retryable, retryAfterMs: afterMs > 0 ? Math.min(Math.max(Math.round(afterMs), 1), 2 ** 31) : 0 };
    };
    if (ok) {
      try {
        const { data, contentType } = encodePayload(result);
        const spawned = spawnBytes(rt.spawned);
        if (data.length > this.maxResultBytes) {
          failure(`result of ${data.length} bytes exceeds max_result_bytes ${this.maxResultBytes}`, false);
        } else if (data.length + spawned > MAX_REQUEST_BYTES) { // one outcome goes in one message
          failure(`the result and the ${rt.spawned.length} spawned tasks take about ${data.length + spawned} bytes, more than a message's ${MAX_REQUEST_BYTES}`, false);
        } else {
          outcome.success = { result: data, contentType, spawn: rt.spawned };
        }
      } catch (err) {
        failure(`result: ${(err as Error).message}`, false);
      }
    } else if (rt.cancelRequested) { // the server asked: the task ends CANCELLED
      outcome.cancelled = { reason: "cancelled" };
    } else if (rt.releasing) { // shutdown: give it back unfinished
      outcome.released = { reason: RELEASE_REASON };
    } else if (timedOut) {
      failure(`timed out after ${task.timeoutMs} ms`, true);
    } else if (error instanceof Snooze) {
      outcome.snoozed = { snoozeMs: error.ms, reason: error.reason };
    } else if (error instanceof TaskFailure) {
      failure(error.message, error.retryable, error.retryAfterMs);
    } else {
      failure(error instanceof Error ? error.message || error.name : String(error), true);
    }
    rt.span?.end(spanOutcome(outcome), outcome.failure?.error);
    this.queue(outcome, task.pool);
  }

  /** Queues an outcome (of a task of pool) for the stream and wakes the sender. */
  private queue(outcome: TaskOutcome, pool: string): void {
    this.unacked.set(outcome.taskId, outcome);
    this.unackedPools.set(outcome.taskId, pool);
    this.outcomes.push(outcome);
    this.wake.notify();
  }
}
