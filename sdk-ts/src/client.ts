// The client: submit, submitBatch, get, wait, cancel, list and watch, and the operator's calls
// (retry, delete, attempts, bulk actions by filter, pause/resume a pool, schedules, the
// workers, the snapshot and the server's info), on any shard's server
// (or several servers), with the transport retries of the connection.
import { randomBytes } from "node:crypto";
import { status as Status, type Metadata, type StatusObject } from "@grpc/grpc-js";
import { TaskState, type Attempt, type KeyMode, type RunWhen, type TaskEvent, type TaskRef as TaskRefProto, type Task } from "./gen/cronoq/v1/task.js";
import {
  GetTaskRequest,
  ListTasksRequest,
  SubmitTaskRequest,
  type BulkShardResult,
  type CancelTaskResponse,
  type CancelTasksResponse,
  type DeleteTaskResponse,
  type DeleteTasksResponse,
  type GetTaskResponse,
  type ListTasksResponse,
  type RetryTaskResponse,
  type RetryTasksResponse,
  type SubmitTaskResponse,
  type WaitTaskResponse,
  type SubmitBatchResponse,
  type TaskFilter as TaskFilterProto,
  type WatchResponse,
} from "./gen/cronoq/v1/task_service.js";
import type { GetServerInfoResponse, GetSnapshotResponse, PausePoolResponse, PoolPause, ResumePoolResponse } from "./gen/cronoq/v1/admin_service.js";
import { Schedule, type ListSchedulesResponse, type PutScheduleResponse } from "./gen/cronoq/v1/schedule_service.js";
import type { ListWorkersResponse } from "./gen/cronoq/v1/worker_service.js";
import type { Timestamp } from "./gen/google/protobuf/timestamp.js";
import { AbortedError, CancelledError, fromGrpcError, InternalError, InvalidArgumentError, UnavailableError } from "./errors.js";
import { currentTrace, type W3CTrace } from "./otel.js";
import { encodePayload } from "./payload.js";
import { backoffMs, Connection, sleep, type ConnectionOptions } from "./transport.js";
import type { Endpoint } from "./endpoint.js";

/** Names one task: its id (a bigint: uint64 ids must not pass through a number), or its key. */
export type TaskRef = bigint | { id: bigint } | { key: string };

function refProto(ref: TaskRef): TaskRefProto {
  if (typeof ref === "bigint") return { id: ref };
  if ("id" in ref && typeof ref.id === "bigint") return { id: ref.id };
  if ("key" in ref && typeof ref.key === "string") return { key: ref.key };
  throw new InvalidArgumentError(Status.INVALID_ARGUMENT, "task: give an id (bigint), { id }, or { key }");
}

/** One task to submit. */
export interface TaskSpec {
  pool: string;
  /** Bytes as they are, anything else as JSON. */
  payload?: unknown;
  /** Deduplicates within a shard: a known key returns the existing task (unless keyMode says otherwise). */
  key?: string;
  priority?: number;
  /** Not before this time (ms since the epoch, or a Date); delayMs: not before now + delayMs. */
  runAt?: Date | number;
  delayMs?: number;
  /** 0 or absent: the pool's default. */
  maxAttempts?: number;
  /** Tasks of the same shard (a batch may name its own keys). */
  dependsOn?: TaskRef[];
  /**
   * When it runs, given its dependencies: absent, once every one has succeeded;
   * RunWhen.RUN_WHEN_DEPENDENCIES_ENDED, once every one has ended whatever its outcome (a
   * finalizer: its handler sees each one's state and error in ctx.dependencies).
   */
  runWhen?: RunWhen;
  resources?: Record<string, bigint | number>;
  /** Each attempt's timeout (capped by the pool's); absent: the pool's. */
  timeoutMs?: number;
  /** The task's group (a tenant, a user; absent: none): in a pool with max_running_per_group, at most that many tasks of one group run at once. */
  groupKey?: string;
  /**
   * What a submission whose key already names a task does (absent: the pool's default_key_mode):
   * KeyMode.KEY_MODE_RETURN_EXISTING answers that task unchanged (deduplicated);
   * KeyMode.KEY_MODE_REPLACE_PENDING gives a PENDING or BLOCKED one this spec's payload,
   * priority and runAt (replaced), and answers a running or ended one unchanged;
   * KeyMode.KEY_MODE_DEBOUNCE replaces as well and makes it due debounceMs after the latest
   * submission (no runAt then). Needs a key.
   */
  keyMode?: KeyMode;
  /** With KEY_MODE_DEBOUNCE (1 to 604800000; absent: the pool's debounce): the task is due this long after its key's latest submission. */
  debounceMs?: number;
  /** With KEY_MODE_DEBOUNCE (0 or absent: no bound; else debounceMs to 604800000): due at most this long after the submission that created it, however long the burst lasts. */
  maxDebounceMs?: number;
  /** Unique for a period: once the task has ended and this long has passed, its key is free for a new task (0 or absent: held until the task is deleted; at most 366 days). Needs a key. */
  keyTtlMs?: number;
  /** A deadline to start (ms since the epoch, or a Date; after runAt): a task not started by then ends EXPIRED without running. */
  startBy?: Date | number;
  /**
   * The W3C trace context its handler runs in. Absent: the caller's current span's, when
   * @opentelemetry/api is installed and a span is active (see Tracing in the README).
   */
  trace?: TaskTrace;
}

/** A W3C trace context (https://www.w3.org/TR/trace-context/), as its HTTP headers carry it. */
export interface TaskTrace {
  /** "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>", lowercase. */
  traceparent: string;
  /** At most 512 bytes. */
  tracestate?: string;
}

/**
 * A cron schedule to put: (pool, name) names it; each time it fires it submits a task of pool
 * with its payload and task options (0 or absent: the pool's defaults, as a submit's).
 */
export interface ScheduleSpec {
  pool: string;
  name: string;
  /** Five fields (minute hour day-of-month month day-of-week), or six with seconds first ("*\/5 * * * * *": every five seconds); checked by the server. */
  cron: string;
  /** An IANA zone name ("Europe/Paris"); absent: UTC. */
  timezone?: string;
  /** Bytes as they are, anything else as JSON: every fired task's payload. */
  payload?: unknown;
  priority?: number;
  maxAttempts?: number;
  resources?: Record<string, bigint | number>;
  /** Each fired task's attempt timeout; absent: the pool's. */
  timeoutMs?: number;
  /** Each fired task's groupKey. */
  groupKey?: string;
  /** Kept, but fires nothing until put again unpaused. */
  paused?: boolean;
  /** After downtime, fire every missed slot rather than only the latest. */
  fireAllMissed?: boolean;
  /**
   * The trace context each fired task links to. Absent: the caller's current span's, when
   * @opentelemetry/api is installed and a span is active (as submit's).
   */
  trace?: TaskTrace;
}

/** Which pool a read call answers for. */
export interface PoolOptions {
  /** Absent: every pool the caller may read. */
  pool?: string;
}

function timestamp(ms: number): Timestamp {
  const whole = Math.floor(ms / 1000);
  return { seconds: BigInt(whole), nanos: Math.round((ms - whole * 1000) * 1e6) };
}

/** A duration in ms as an int64 (absent: 0), rounded; out-of-range values go as they are, for the server to refuse by name. */
function durationMs(field: string, ms: number | undefined): bigint {
  if (ms === undefined) return 0n;
  if (!Number.isFinite(ms)) throw new InvalidArgumentError(Status.INVALID_ARGUMENT, `${field}: ${ms} is not a number of milliseconds`);
  return BigInt(Math.round(ms));
}

/** A time given as a Date or ms since the epoch, as a Timestamp; absent stays absent. */
function optionalTimestamp(time: Date | number | undefined): Timestamp | undefined {
  return time === undefined ? undefined : timestamp(Number(time));
}

/** Resource amounts as int64s. */
function resourcesProto(resources: Record<string, bigint | number> | undefined): Record<string, bigint> {
  const amounts: Record<string, bigint> = {};
  for (const [name, n] of Object.entries(resources ?? {})) amounts[name] = BigInt(n);
  return amounts;
}

/** An attempt's timeout as an int64 (absent or not positive: 0, the pool's). */
function timeoutProto(ms: number | undefined): bigint {
  return ms && ms > 0 ? BigInt(Math.max(Math.round(ms), 1)) : 0n;
}

/** The trace context given, else current (the caller's, when tracing). */
function traceProto(given: TaskTrace | undefined, current: W3CTrace | undefined): W3CTrace | undefined {
  return given ? { traceparent: given.traceparent, tracestate: given.tracestate ?? "" } : current;
}

/** A task to submit as its request; current: the caller's trace context, sent unless the spec gives one. */
function specProto(spec: TaskSpec, current: W3CTrace | undefined): SubmitTaskRequest {
  const { data, contentType } = encodePayload(spec.payload);
  const runAtMs = spec.runAt !== undefined ? Number(spec.runAt) : spec.delayMs && spec.delayMs > 0 ? Date.now() + spec.delayMs : undefined;
  return SubmitTaskRequest.fromPartial({
    pool: spec.pool,
    key: spec.key ?? "",
    payload: data,
    contentType,
    priority: spec.priority ?? 0,
    runAt: runAtMs !== undefined ? timestamp(runAtMs) : undefined,
    maxAttempts: spec.maxAttempts ?? 0,
    dependsOn: (spec.dependsOn ?? []).map(refProto),
    resources: resourcesProto(spec.resources),
    timeoutMs: timeoutProto(spec.timeoutMs),
    groupKey: spec.groupKey ?? "",
    trace: traceProto(spec.trace, current),
    runWhen: spec.runWhen ?? 0,
    keyMode: spec.keyMode ?? 0,
    debounceMs: durationMs("debounce_ms", spec.debounceMs),
    maxDebounceMs: durationMs("max_debounce_ms", spec.maxDebounceMs),
    keyTtlMs: durationMs("key_ttl_ms", spec.keyTtlMs),
    startBy: optionalTimestamp(spec.startBy),
  });
}

/** A task as submit sends it (without a request id), in the caller's trace unless spec.trace is given. */
export function submitRequest(spec: TaskSpec): SubmitTaskRequest {
  return specProto(spec, currentTrace());
}

/**
 * How ctx.spawn submits a task: as client.submit does, but dependsOn may name a task by its key
 * alone (a string: another task this handler spawns, or one of the shard's).
 */
export type SpawnOptions = Omit<TaskSpec, "pool" | "payload" | "dependsOn"> & {
  /** Keys (strings), ids (bigint: task.id names the spawning task itself), { id } or { key }. */
  dependsOn?: Array<string | TaskRef>;
};

/** A task a handler spawns as its request, in the handler's trace (its span's, when tracing). */
export function spawnRequest(pool: string, payload: unknown, opts: SpawnOptions): SubmitTaskRequest {
  const dependsOn = (opts.dependsOn ?? []).map((ref) => (typeof ref === "string" ? { key: ref } : ref));
  return specProto({ ...opts, pool, payload, dependsOn }, currentTrace());
}

/** A fresh request id: the server answers a repeated one with what the first call created. */
export function newRequestId(): string {
  return randomBytes(16).toString("hex");
}

export interface Submitted {
  task: Task;
  /** The key already named this task: nothing was created or changed. */
  deduplicated: boolean;
  /** The key named this PENDING or BLOCKED task and the submission replaced its payload, priority and runAt (keyMode REPLACE_PENDING or DEBOUNCE): nothing was created. */
  replaced: boolean;
}

const TERMINAL_STATES: ReadonlySet<TaskState> = new Set([
  TaskState.TASK_STATE_SUCCEEDED,
  TaskState.TASK_STATE_FAILED,
  TaskState.TASK_STATE_CANCELLED,
  TaskState.TASK_STATE_EXPIRED,
]);

/** Whether a task in this state has ended (SUCCEEDED, FAILED, CANCELLED or EXPIRED): what wait waits for. */
export function isTerminal(state: TaskState): boolean {
  return TERMINAL_STATES.has(state);
}

export interface Waited {
  task: Task;
  /** False when the wait's timeout passed first. */
  done: boolean;
}

export interface ListOptions {
  pool?: string;
  state?: TaskState;
  /** 100 when absent. */
  pageSize?: number;
  pageToken?: string;
  /** Only the tasks that match it, as a bulk action matches them (any state may be named). */
  filter?: TaskFilter;
}

export interface WatchOptions {
  pool?: string;
  includePayloads?: boolean;
  /** Resume after this event's cursor. */
  cursor?: string;
  signal?: AbortSignal;
}

export interface CallOptions {
  signal?: AbortSignal;
}

export interface GetOptions {
  /** Also fill task.dependencyResults: how the tasks it depends on ended, as its handler sees them. */
  includeDependencyResults?: boolean;
  /** Also answer the tasks its handler spawned (TaskWithChildren). */
  includeChildren?: boolean;
}

/** A task with the tasks its handler spawned (their parentId is its id), in id order, at most 1,000 (list with filter.parentId pages through them all), without payload, result or checkpoint. */
export interface TaskWithChildren {
  task: Task;
  children: Task[];
}

export interface CancelOptions {
  /** Also cancel the tasks it spawned, theirs, and so on, with the tasks that depend on any of them (CancelledWithDescendants). */
  includeDescendants?: boolean;
}

/** A cancelled task, and how many of its descendants the call cancelled (or asked to stop, when running). */
export interface CancelledWithDescendants {
  task: Task;
  descendantsCancelled: bigint;
}

/** A task with every attempt it made, oldest first (a running one last, outcome ATTEMPT_OUTCOME_RUNNING). */
export interface TaskWithAttempts {
  task: Task;
  attempts: Attempt[];
}

export interface RetryOptions {
  /** When it may run again (ms since the epoch, or a Date); absent: now. */
  runAt?: Date | number;
  /** 0 to 1000 (0 or absent: 1): how many more attempts a task that used all of its attempts gets; one with attempts left keeps them. */
  extraAttempts?: number;
}

/** Which tasks a bulk action applies to: those that match every field given. */
export interface TaskFilter {
  /** Absent: every pool the caller may act on. */
  pool?: string;
  /** Absent: every state the action applies to (cancel: PENDING, BLOCKED, RUNNING; retry: FAILED, CANCELLED; delete: SUCCEEDED, FAILED, CANCELLED). */
  states?: TaskState[];
  /** Times as ms since the epoch, or Dates. */
  createdAfter?: Date | number;
  createdBefore?: Date | number;
  finishedAfter?: Date | number;
  finishedBefore?: Date | number;
  /** Tasks whose key starts with this. */
  keyPrefix?: string;
  /** Tasks whose error contains this text (case-sensitive). */
  errorContains?: string;
  /** Only these tasks (at most 1000). */
  ids?: bigint[];
  /** Only the tasks this task's handler spawned (Task.parentId). */
  parentId?: bigint;
}

export interface BulkOptions {
  /** Count the tasks that match; change nothing (changed is 0). */
  dryRun?: boolean;
}

/**
 * What a bulk action did: tasks matched and changed in all, per shard, and the shards that could
 * not be asked (their tasks are not counted: repeat the call, it is safe to).
 */
export interface BulkResult {
  matched: bigint;
  changed: bigint;
  shards: BulkShardResult[];
  unavailableShards: string[];
  /** Some shard stopped at its time bound before the end of the matching tasks (shards[].incomplete): the same call again continues. */
  incomplete: boolean;
}

function filterProto(filter: TaskFilter): TaskFilterProto {
  return {
    pool: filter.pool ?? "",
    states: filter.states ?? [],
    createdAfter: optionalTimestamp(filter.createdAfter),
    createdBefore: optionalTimestamp(filter.createdBefore),
    finishedAfter: optionalTimestamp(filter.finishedAfter),
    finishedBefore: optionalTimestamp(filter.finishedBefore),
    keyPrefix: filter.keyPrefix ?? "",
    errorContains: filter.errorContains ?? "",
    ids: filter.ids ?? [],
    parentId: filter.parentId ?? 0n,
  };
}

/**
 * Calls cronoq: any shard's server, or several servers. UNAVAILABLE moves it to the leader a
 * standby names, or to the next endpoint, and is retried with backoff. close() it when done.
 */
// Where a sharded server says a live Watch stream starts.
const WATCH_START_KEY = "cronoq-watch-cursor";

export class Client {
  private readonly conn: Connection;

  /** Checks the options (endpoints, TLS files); connects on the first call. */
  constructor(opts: ConnectionOptions) {
    this.conn = new Connection(opts);
  }

  /** The server the client talks to now. */
  get endpoint(): Endpoint {
    return this.conn.endpoint;
  }

  close(): void {
    this.conn.close();
  }

  /**
   * Submits one task (with a request id: a retry never creates a second one), in the caller's
   * trace: the current span's context goes with it (unless spec.trace is given).
   */
  async submit(spec: TaskSpec, opts: CallOptions = {}): Promise<Submitted> {
    const req = { ...submitRequest(spec), requestId: newRequestId() };
    const resp = await this.conn.invoke<SubmitTaskResponse>("SubmitTask", (c, md, o, cb) => c.task.submitTask(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return { task: resp.task!, deduplicated: resp.deduplicated, replaced: resp.replaced };
  }

  /**
   * Submits tasks of one shard together: all or none; each in the caller's trace, as submit.
   * Answers the tasks in order, deduplicatedIds (their key named an existing task) and
   * replacedIds (a pending task their submission replaced).
   */
  async submitBatch(specs: TaskSpec[], opts: CallOptions = {}): Promise<SubmitBatchResponse> {
    const current = currentTrace();
    const req = { tasks: specs.map((spec) => specProto(spec, current)), requestId: newRequestId() };
    return this.conn.invoke<SubmitBatchResponse>("SubmitBatch", (c, md, o, cb) => c.task.submitBatch(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /**
   * The task; with includeDependencyResults, its dependencyResults filled; with
   * includeChildren, the task and the tasks its handler spawned.
   */
  async get(ref: TaskRef, opts: GetOptions & CallOptions & { includeChildren: true }): Promise<TaskWithChildren>;
  async get(ref: TaskRef, opts?: GetOptions & CallOptions & { includeChildren?: false }): Promise<Task>;
  async get(ref: TaskRef, opts?: GetOptions & CallOptions): Promise<Task | TaskWithChildren>;
  async get(ref: TaskRef, opts: GetOptions & CallOptions = {}): Promise<Task | TaskWithChildren> {
    const resp = await this.getTask(ref, { ...opts, includeAttempts: false });
    return opts.includeChildren ? { task: resp.task!, children: resp.children } : resp.task!;
  }

  /** The task with its attempts (GetTask with include_attempts): get's variant for an operator. */
  async getWithAttempts(ref: TaskRef, opts: CallOptions = {}): Promise<TaskWithAttempts> {
    const resp = await this.getTask(ref, { ...opts, includeAttempts: true });
    return { task: resp.task!, attempts: resp.attempts };
  }

  private getTask(ref: TaskRef, opts: GetOptions & CallOptions & { includeAttempts: boolean }): Promise<GetTaskResponse> {
    const req = GetTaskRequest.fromPartial({
      task: refProto(ref),
      includeAttempts: opts.includeAttempts,
      includeChildren: opts.includeChildren ?? false,
      includeDependencyResults: opts.includeDependencyResults ?? false,
    });
    return this.conn.invoke<GetTaskResponse>("GetTask", (c, md, o, cb) => c.task.getTask(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /** Waits up to timeoutMs for the task to end (done: false when it has not). */
  async wait(ref: TaskRef, timeoutMs: number, opts: CallOptions = {}): Promise<Waited> {
    const req = { task: refProto(ref), timeoutMs: Math.min(Math.max(Math.round(timeoutMs), 1), 2 ** 31) };
    const resp = await this.conn.invoke<WaitTaskResponse>("WaitTask", (c, md, o, cb) => c.task.waitTask(req, md, o, cb),
      this.conn.timeoutMs > 0 ? timeoutMs + this.conn.timeoutMs : 0, opts.signal);
    return { task: resp.task!, done: resp.done };
  }

  /**
   * Requests cancellation: a pending task ends CANCELLED at once, a running one when its worker
   * stops it. With includeDescendants, the tasks it spawned too (transitively) and their
   * dependents, in one transaction: answers the task and how many of them were cancelled.
   */
  async cancel(ref: TaskRef, opts: CancelOptions & CallOptions & { includeDescendants: true }): Promise<CancelledWithDescendants>;
  async cancel(ref: TaskRef, opts?: CancelOptions & CallOptions & { includeDescendants?: false }): Promise<Task>;
  async cancel(ref: TaskRef, opts?: CancelOptions & CallOptions): Promise<Task | CancelledWithDescendants>;
  async cancel(ref: TaskRef, opts: CancelOptions & CallOptions = {}): Promise<Task | CancelledWithDescendants> {
    const req = { task: refProto(ref), includeDescendants: opts.includeDescendants ?? false };
    const resp = await this.conn.invoke<CancelTaskResponse>("CancelTask", (c, md, o, cb) => c.task.cancelTask(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return opts.includeDescendants ? { task: resp.task!, descendantsCancelled: resp.descendantsCancelled } : resp.task!;
  }

  /**
   * A FAILED or CANCELLED task back to PENDING, keeping its attempts and their history (any
   * other state: FailedPreconditionError naming it). Its dependents that ended because it
   * ended wait for it again.
   */
  async retry(ref: TaskRef, opts: RetryOptions & CallOptions = {}): Promise<Task> {
    const req = { task: refProto(ref), runAt: optionalTimestamp(opts.runAt), extraAttempts: opts.extraAttempts ?? 0 };
    const resp = await this.conn.invoke<RetryTaskResponse>("RetryTask", (c, md, o, cb) => c.task.retryTask(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return resp.task!;
  }

  /** Deletes an ended task (SUCCEEDED, FAILED or CANCELLED) with its attempts and events; answers its id. */
  async delete(ref: TaskRef, opts: CallOptions = {}): Promise<bigint> {
    const req = { task: refProto(ref) };
    const resp = await this.conn.invoke<DeleteTaskResponse>("DeleteTask", (c, md, o, cb) => c.task.deleteTask(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return resp.id;
  }

  /** Cancels the unfinished tasks that match filter, in every shard. */
  async cancelTasks(filter: TaskFilter, opts: BulkOptions & CallOptions = {}): Promise<BulkResult> {
    const req = { filter: filterProto(filter), dryRun: opts.dryRun ?? false };
    return this.conn.invoke<CancelTasksResponse>("CancelTasks", (c, md, o, cb) => c.task.cancelTasks(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /** Retries the FAILED and CANCELLED tasks that match filter, in every shard, as retry does. */
  async retryTasks(filter: TaskFilter, opts: BulkOptions & RetryOptions & CallOptions = {}): Promise<BulkResult> {
    const req = { filter: filterProto(filter), dryRun: opts.dryRun ?? false, runAt: optionalTimestamp(opts.runAt), extraAttempts: opts.extraAttempts ?? 0 };
    return this.conn.invoke<RetryTasksResponse>("RetryTasks", (c, md, o, cb) => c.task.retryTasks(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /** Deletes the ended tasks that match filter, in every shard, as delete does. */
  async deleteTasks(filter: TaskFilter, opts: BulkOptions & CallOptions = {}): Promise<BulkResult> {
    const req = { filter: filterProto(filter), dryRun: opts.dryRun ?? false };
    return this.conn.invoke<DeleteTasksResponse>("DeleteTasks", (c, md, o, cb) => c.task.deleteTasks(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /** Stops leasing the pool's tasks, across restarts, until resumePool; it still accepts submissions, and running tasks finish. */
  async pausePool(pool: string, opts: CallOptions = {}): Promise<PoolPause> {
    const req = { pool };
    const resp = await this.conn.invoke<PausePoolResponse>("PausePool", (c, md, o, cb) => c.admin.pausePool(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return resp.pause!;
  }

  /** Leases the pool's tasks again. */
  async resumePool(pool: string, opts: CallOptions = {}): Promise<PoolPause> {
    const req = { pool };
    const resp = await this.conn.invoke<ResumePoolResponse>("ResumePool", (c, md, o, cb) => c.admin.resumePool(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return resp.pause!;
  }

  /** The registered workers (of opts.pool, or of every pool the caller may read), from every shard; unavailableShards: those that did not answer. */
  async listWorkers(opts: PoolOptions & CallOptions = {}): Promise<ListWorkersResponse> {
    const req = { pool: opts.pool ?? "" };
    return this.conn.invoke<ListWorkersResponse>("ListWorkers", (c, md, o, cb) => c.worker.listWorkers(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /**
   * Creates or replaces the schedule (spec.pool, spec.name), in the caller's trace as submit
   * (unless spec.trace is given); answers it as stored, with its nextFireAt. A bad cron or
   * timezone is the server's InvalidArgumentError.
   */
  async putSchedule(spec: ScheduleSpec, opts: CallOptions = {}): Promise<Schedule> {
    const { data, contentType } = encodePayload(spec.payload);
    const schedule = Schedule.fromPartial({
      pool: spec.pool,
      name: spec.name,
      cron: spec.cron,
      timezone: spec.timezone ?? "",
      payload: data,
      contentType,
      priority: spec.priority ?? 0,
      maxAttempts: spec.maxAttempts ?? 0,
      resources: resourcesProto(spec.resources),
      timeoutMs: timeoutProto(spec.timeoutMs),
      groupKey: spec.groupKey ?? "",
      paused: spec.paused ?? false,
      fireAllMissed: spec.fireAllMissed ?? false,
      trace: traceProto(spec.trace, currentTrace()),
    });
    const req = { schedule };
    const resp = await this.conn.invoke<PutScheduleResponse>("PutSchedule", (c, md, o, cb) => c.schedule.putSchedule(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return resp.schedule!;
  }

  /** Deletes the schedule (pool, name); one that does not exist is a NotFoundError. */
  async deleteSchedule(pool: string, name: string, opts: CallOptions = {}): Promise<void> {
    const req = { pool, name };
    await this.conn.invoke("DeleteSchedule", (c, md, o, cb) => c.schedule.deleteSchedule(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /** The schedules (of opts.pool, or of every pool the caller may read), from every shard; unavailableShards: those that did not answer. */
  async listSchedules(opts: PoolOptions & CallOptions = {}): Promise<ListSchedulesResponse> {
    const req = { pool: opts.pool ?? "" };
    return this.conn.invoke<ListSchedulesResponse>("ListSchedules", (c, md, o, cb) => c.schedule.listSchedules(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /** Per shard: its leader and term, task counts by pool and state, resources, workers; unavailableShards: the shards that did not answer. */
  async snapshot(opts: CallOptions = {}): Promise<GetSnapshotResponse> {
    return this.conn.invoke<GetSnapshotResponse>("GetSnapshot", (c, md, o, cb) => c.admin.getSnapshot({}, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /** The server the client talks to: its version, shard, role, leader, and what the caller may do (a standby answers too). */
  async serverInfo(opts: CallOptions = {}): Promise<GetServerInfoResponse> {
    return this.conn.invoke<GetServerInfoResponse>("GetServerInfo", (c, md, o, cb) => c.admin.getServerInfo({}, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /** One page of tasks (nextPageToken: the next page's, "" after the last). */
  async list(opts: ListOptions & CallOptions = {}): Promise<ListTasksResponse> {
    const req = ListTasksRequest.fromPartial({ pool: opts.pool ?? "", state: opts.state ?? 0, pageSize: opts.pageSize ?? 100, pageToken: opts.pageToken ?? "", filter: opts.filter && filterProto(opts.filter) });
    return this.conn.invoke<ListTasksResponse>("ListTasks", (c, md, o, cb) => c.task.listTasks(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  /**
   * The changes of tasks, as they commit, until opts.signal aborts or the loop breaks. A stream
   * that ends or fails transiently is opened again after the last event's cursor.
   */
  async *watch(opts: WatchOptions = {}): AsyncGenerator<TaskEvent, void, undefined> {
    let cursor = opts.cursor ?? "";
    let failures = 0;
    let failingSince = 0;
    const lastSeq = new Map<string, bigint>(); // shard -> the seq of the last event yielded
    for (;;) {
      const { clients, endpoint } = this.conn.clients();
      const call = clients.task.watch({ pool: opts.pool ?? "", includePayloads: opts.includePayloads ?? false, cursor }, this.conn.metadata());
      // A sharded server states where a live stream starts (initial metadata, repeated in the
      // trailers): a reconnect before any event resumes from there, not live again.
      const stated = (md: Metadata | undefined) => {
        const value = md?.get(WATCH_START_KEY)[0];
        if (!cursor && value) cursor = String(value);
      };
      call.on("metadata", stated);
      call.on("status", (status: StatusObject) => stated(status.metadata));
      const onAbort = () => call.cancel();
      opts.signal?.addEventListener("abort", onAbort, { once: true });
      let failure: Error | undefined;
      let received = false;
      try {
        for await (const message of call as AsyncIterable<WatchResponse>) {
          received = true;
          const event = message.event;
          if (!event) continue;
          failures = 0;
          failingSince = 0;
          if (event.cursor) cursor = event.cursor;
          if (event.seq) {
            if (event.seq <= (lastSeq.get(event.shard) ?? 0n)) continue; // replayed after a reconnect, yielded before
            lastSeq.set(event.shard, event.seq);
          }
          yield event;
        }
      } catch (err) {
        failure = fromGrpcError(err);
        // A stream that failed before any event may be a failed TLS handshake.
        if (!received) failure = await this.conn.diagnose(endpoint, failure);
      } finally {
        opts.signal?.removeEventListener("abort", onAbort);
        call.cancel();
      }
      if (opts.signal?.aborted) return;
      const transient = failure === undefined || failure instanceof UnavailableError || failure instanceof CancelledError ||
        failure instanceof AbortedError || failure instanceof InternalError;
      if (!transient) throw failure;
      const now = Date.now();
      if (!failingSince) failingSince = now;
      if (this.conn.retry.maxElapsedMs > 0 && now - failingSince >= this.conn.retry.maxElapsedMs) {
        throw failure ?? new UnavailableError(Status.UNAVAILABLE, `watch: the server kept ending the stream for ${this.conn.retry.maxElapsedMs} ms`);
      }
      if (failure) this.conn.onUnavailable(failure);
      if (!(await sleep(backoffMs(this.conn.retry, failures++), opts.signal))) return;
    }
  }
}
