// The client: submit, submitBatch, get, wait, cancel, list and watch, on any shard's server
// (or several servers), with the transport retries of the connection.
import { randomBytes } from "node:crypto";
import { status as Status, type Metadata, type StatusObject } from "@grpc/grpc-js";
import type { TaskEvent, TaskRef as TaskRefProto, Task, TaskState } from "./gen/cronoq/v1/task.js";
import {
  GetTaskRequest,
  ListTasksRequest,
  SubmitTaskRequest,
  type CancelTaskResponse,
  type GetTaskResponse,
  type ListTasksResponse,
  type SubmitTaskResponse,
  type WaitTaskResponse,
  type SubmitBatchResponse,
  type WatchResponse,
} from "./gen/cronoq/v1/task_service.js";
import { AbortedError, CancelledError, fromGrpcError, InternalError, InvalidArgumentError, UnavailableError } from "./errors.js";
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
  /** Deduplicates within a shard: a known key returns the existing task. */
  key?: string;
  priority?: number;
  /** Not before this time (ms since the epoch, or a Date); delayMs: not before now + delayMs. */
  runAt?: Date | number;
  delayMs?: number;
  /** 0 or absent: the pool's default. */
  maxAttempts?: number;
  /** Tasks of the same shard (a batch may name its own keys). */
  dependsOn?: TaskRef[];
  resources?: Record<string, bigint | number>;
  /** Each attempt's timeout (capped by the pool's); absent: the pool's. */
  timeoutMs?: number;
}

function timestamp(ms: number): { seconds: bigint; nanos: number } {
  const whole = Math.floor(ms / 1000);
  return { seconds: BigInt(whole), nanos: Math.round((ms - whole * 1000) * 1e6) };
}

function specProto(spec: TaskSpec): SubmitTaskRequest {
  const { data, contentType } = encodePayload(spec.payload);
  const runAtMs = spec.runAt !== undefined ? Number(spec.runAt) : spec.delayMs && spec.delayMs > 0 ? Date.now() + spec.delayMs : undefined;
  const resources: Record<string, bigint> = {};
  for (const [name, n] of Object.entries(spec.resources ?? {})) resources[name] = BigInt(n);
  return SubmitTaskRequest.fromPartial({
    pool: spec.pool,
    key: spec.key ?? "",
    payload: data,
    contentType,
    priority: spec.priority ?? 0,
    runAt: runAtMs !== undefined ? timestamp(runAtMs) : undefined,
    maxAttempts: spec.maxAttempts ?? 0,
    dependsOn: (spec.dependsOn ?? []).map(refProto),
    resources,
    timeoutMs: spec.timeoutMs && spec.timeoutMs > 0 ? BigInt(Math.max(Math.round(spec.timeoutMs), 1)) : 0n,
  });
}

/** A fresh request id: the server answers a repeated one with what the first call created. */
export function newRequestId(): string {
  return randomBytes(16).toString("hex");
}

export interface Submitted {
  task: Task;
  deduplicated: boolean;
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

  /** Submits one task (with a request id: a retry never creates a second one). */
  async submit(spec: TaskSpec, opts: CallOptions = {}): Promise<Submitted> {
    const req = { ...specProto(spec), requestId: newRequestId() };
    const resp = await this.conn.invoke<SubmitTaskResponse>("SubmitTask", (c, md, o, cb) => c.task.submitTask(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return { task: resp.task!, deduplicated: resp.deduplicated };
  }

  /** Submits tasks of one shard together: all or none. */
  async submitBatch(specs: TaskSpec[], opts: CallOptions = {}): Promise<SubmitBatchResponse> {
    const req = { tasks: specs.map(specProto), requestId: newRequestId() };
    return this.conn.invoke<SubmitBatchResponse>("SubmitBatch", (c, md, o, cb) => c.task.submitBatch(req, md, o, cb), this.conn.timeoutMs, opts.signal);
  }

  async get(ref: TaskRef, opts: CallOptions = {}): Promise<Task> {
    const req = GetTaskRequest.fromPartial({ task: refProto(ref) });
    const resp = await this.conn.invoke<GetTaskResponse>("GetTask", (c, md, o, cb) => c.task.getTask(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return resp.task!;
  }

  /** Waits up to timeoutMs for the task to end (done: false when it has not). */
  async wait(ref: TaskRef, timeoutMs: number, opts: CallOptions = {}): Promise<Waited> {
    const req = { task: refProto(ref), timeoutMs: Math.min(Math.max(Math.round(timeoutMs), 1), 2 ** 31) };
    const resp = await this.conn.invoke<WaitTaskResponse>("WaitTask", (c, md, o, cb) => c.task.waitTask(req, md, o, cb),
      this.conn.timeoutMs > 0 ? timeoutMs + this.conn.timeoutMs : 0, opts.signal);
    return { task: resp.task!, done: resp.done };
  }

  /** Requests cancellation: a pending task ends CANCELLED at once, a running one when its worker stops it. */
  async cancel(ref: TaskRef, opts: CallOptions = {}): Promise<Task> {
    const req = { task: refProto(ref) };
    const resp = await this.conn.invoke<CancelTaskResponse>("CancelTask", (c, md, o, cb) => c.task.cancelTask(req, md, o, cb), this.conn.timeoutMs, opts.signal);
    return resp.task!;
  }

  /** One page of tasks (nextPageToken: the next page's, "" after the last). */
  async list(opts: ListOptions & CallOptions = {}): Promise<ListTasksResponse> {
    const req = ListTasksRequest.fromPartial({ pool: opts.pool ?? "", state: opts.state ?? 0, pageSize: opts.pageSize ?? 100, pageToken: opts.pageToken ?? "" });
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
