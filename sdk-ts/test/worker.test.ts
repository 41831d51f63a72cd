// The worker and the client against in-process grpc-js servers that play cronoq's services.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import {
  Metadata,
  Server,
  status as Status,
  type sendUnaryData,
  type ServerDuplexStream,
  type ServerUnaryCall,
  type ServerWritableStream,
  type UntypedServiceImplementation,
} from "@grpc/grpc-js";
import {
  TaskServiceService,
  GetTaskResponse,
  type GetTaskRequest,
  type WatchRequest,
  type WatchResponse,
} from "../src/gen/cronoq/v1/task_service.js";
import {
  WorkerServiceService,
  type RegisterWorkerRequest,
  type RegisterWorkerResponse,
  type TaskOutcome,
  type WorkRequest,
  type WorkResponse,
} from "../src/gen/cronoq/v1/worker_service.js";
import { Task, TaskState, type TaskEvent } from "../src/gen/cronoq/v1/task.js";
import { Client, InvalidArgumentError, NotFoundError, TaskCancelledError, TooManyRedirectsError, Worker } from "../src/index.js";
import { listenLocal, silent, statusDetailsBin, TOP_BIT_ID } from "./helpers.js";

// Whatever a failed test leaves running is stopped, so that the run ends.
const started: Array<{ stop(): void }> = [];
after(() => started.forEach((s) => s.stop()));
function tracked<T extends { stop(): void }>(thing: T): T {
  started.push(thing);
  return thing;
}

/** One Watch call of a FakeShard: where it says it starts, its events, then a failure or a clean end. */
interface WatchStep {
  start?: string;
  events: TaskEvent[];
  fail?: boolean;
}

interface FakeOptions {
  watch?: WatchStep[];
  tasks?: Task[];
  cancel?: bigint[];
  redirectTo?: () => string;
  /** The first stream fails with UNAVAILABLE on the first outcomes, without answering them. */
  failFirstStream?: boolean;
  /** Every stream is answered UNAVAILABLE on its first message. */
  refuseStreams?: boolean;
}

/** A server that registers workers (or redirects them), hands out each of its tasks once as credits allow, and records outcomes. */
class FakeShard {
  readonly server = new Server();
  url = "";
  readonly outcomes: TaskOutcome[] = [];
  readonly firstCredits: number[] = []; // each stream's first message's credits
  readonly messagesWithOutcomes: number[] = [];
  readonly heartbeats: bigint[][] = [];
  registers = 0;
  streams = 0;
  deregistered = false;
  tokens: string[] = [];
  readonly watchCursors: string[] = [];

  constructor(private readonly opts: FakeOptions = {}) {
    const queue = [...(opts.tasks ?? [])]; // a task leased stays leased: never sent twice
    const impl: UntypedServiceImplementation = {
      registerWorker: (call: ServerUnaryCall<RegisterWorkerRequest, RegisterWorkerResponse>, cb: sendUnaryData<RegisterWorkerResponse>) => {
        this.registers++;
        this.tokens.push(String(call.metadata.get("authorization")[0] ?? ""));
        if (opts.redirectTo) {
          const md = new Metadata();
          md.set("cronoq-shard-endpoint", opts.redirectTo());
          md.set("cronoq-shard", "gpu");
          cb({ code: Status.FAILED_PRECONDITION, details: "pool gpu is on shard gpu", metadata: md });
          return;
        }
        cb(null, { workerId: "w1", heartbeatIntervalMs: 100, shard: "cpu", maxResultBytes: 0n, maxLeaseBytes: 0n });
      },
      deregisterWorker: (_call: unknown, cb: sendUnaryData<object>) => {
        this.deregistered = true;
        cb(null, {});
      },
      work: (call: ServerDuplexStream<WorkRequest, WorkResponse>) => {
        const stream = ++this.streams;
        let credits = 0;
        let first = true;
        call.on("data", (req: WorkRequest) => {
          if (opts.refuseStreams) {
            call.emit("error", { code: Status.UNAVAILABLE, details: "going away" });
            return;
          }
          if (first) this.firstCredits.push(req.credits);
          first = false;
          credits += req.credits;
          if (opts.failFirstStream && stream === 1 && req.outcomes.length > 0) {
            this.outcomes.push(...req.outcomes);
            call.emit("error", { code: Status.UNAVAILABLE, details: "draining" });
            return;
          }
          const answer: WorkResponse = { tasks: [], results: [], heartbeat: undefined };
          if (req.outcomes.length > 0) this.messagesWithOutcomes.push(req.outcomes.length);
          for (const o of req.outcomes) {
            this.outcomes.push(o);
            answer.results.push({ taskId: o.taskId, accepted: true, code: "", message: "" });
          }
          if (req.heartbeat) {
            const ids = req.heartbeat.tasks.map((t) => t.taskId);
            this.heartbeats.push(ids);
            answer.heartbeat = { cancelledTaskIds: ids.filter((id) => opts.cancel?.includes(id)), lostTaskIds: [] };
          }
          while (credits > 0 && queue.length > 0) {
            answer.tasks.push(queue.shift()!);
            credits--;
          }
          call.write(answer);
        });
        call.on("end", () => call.end());
      },
    };
    this.server.addService(WorkerServiceService, impl);
    this.server.addService(TaskServiceService, {
      watch: (call: ServerWritableStream<WatchRequest, WatchResponse>) => {
        this.watchCursors.push(call.request.cursor);
        const step = opts.watch?.shift() ?? { events: [], fail: true };
        const md = new Metadata();
        if (step.start) {
          md.set("cronoq-watch-cursor", step.start);
          call.sendMetadata(md);
        }
        for (const event of step.events) call.write({ event });
        if (step.fail) call.emit("error", { code: Status.UNAVAILABLE, details: "shutting down", metadata: md });
        else call.end(md);
      },
      getTask: (call: ServerUnaryCall<GetTaskRequest, GetTaskResponse>, cb: sendUnaryData<GetTaskResponse>) => {
        const id = call.request.task?.id;
        if (id !== TOP_BIT_ID) {
          const md = new Metadata();
          md.set("grpc-status-details-bin", statusDetailsBin("TASK_NOT_FOUND", {}));
          cb({ code: Status.NOT_FOUND, details: `no task ${id}`, metadata: md });
          return;
        }
        cb(null, GetTaskResponse.fromPartial({ task: Task.fromPartial({ id, state: TaskState.TASK_STATE_RUNNING }) }));
      },
    });
  }

  async start(): Promise<this> {
    tracked(this);
    this.url = await listenLocal(this.server);
    return this;
  }

  stop(): void {
    this.server.forceShutdown();
  }
}

function jsonTask(id: bigint, payload: unknown): Task {
  return Task.fromPartial({ id, attempt: 1, pool: "default", payload: Buffer.from(JSON.stringify(payload)), contentType: "application/json" });
}

async function until(check: () => boolean, ms = 5000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!check()) {
    if (Date.now() > deadline) throw new Error("timed out waiting");
    await new Promise((r) => setTimeout(r, 5));
  }
}

test("a worker runs tasks, keeps a top-bit id whole, batches outcomes and deregisters on stop", async () => {
  const tasks = [jsonTask(TOP_BIT_ID, { r: 1 }), ...[1n, 2n, 3n, 4n, 5n].map((id) => jsonTask(id, { r: Number(id) }))];
  const shard = await new FakeShard({ tasks }).start();
  let running = 0;
  let most = 0;
  const worker = tracked(new Worker({ endpoint: shard.url, token: "t", pools: ["default"], concurrency: 3, logger: silent }, async () => {
    running++;
    most = Math.max(most, running);
    await new Promise((r) => setTimeout(r, 20));
    running--;
    return { ok: true };
  }));
  const run = worker.run();
  await until(() => shard.outcomes.length === tasks.length);
  worker.stop();
  await run;
  shard.stop();
  assert.ok(shard.outcomes.some((o) => o.taskId === TOP_BIT_ID && o.success !== undefined));
  assert.ok(shard.outcomes.every((o) => o.success !== undefined));
  assert.ok(most <= 3, `at most 3 at once, saw ${most}`);
  assert.ok(shard.messagesWithOutcomes.some((n) => n >= 2), `outcomes batched: ${shard.messagesWithOutcomes}`);
  assert.ok(shard.deregistered);
  assert.deepEqual(new Set(shard.tokens), new Set(["Bearer t"]));
});

test("outcomes a failed stream did not answer are sent again on the next stream", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(7n, {})], failFirstStream: true }).start();
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], logger: silent, retry: { initialBackoffMs: 5 } }, () => "ok"));
  const run = worker.run();
  await until(() => worker.processed === 1);
  worker.stop();
  await run;
  shard.stop();
  assert.ok(shard.streams >= 2, `streams: ${shard.streams}`);
  assert.deepEqual(shard.outcomes.map((o) => o.taskId), [7n, 7n]);
});

// Timing-sensitive (generous margins): 10 ms doubling to 400 ms with equal jitter waits at
// least 5, 10, 20, 40, 80, 160, 200, 200 ms: at most 10 streams in 1 s.
test("a stream answered UNAVAILABLE every time is opened again with backoff, with one warning", async () => {
  const shard = await new FakeShard({ refuseStreams: true }).start();
  const warnings: string[] = [];
  const logger = { ...silent, warn: (message: string) => warnings.push(message) };
  const retry = { initialBackoffMs: 10, maxBackoffMs: 400, maxElapsedMs: -1 };
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], logger, retry }, () => "ok"));
  const run = worker.run();
  await new Promise((r) => setTimeout(r, 1000));
  const opened = shard.streams;
  worker.stop();
  await run;
  shard.stop();
  assert.ok(opened >= 4 && opened <= 10, `${opened} streams in 1 s`);
  assert.deepEqual(warnings, ["cronoq: work stream failed; retrying with backoff"]);
});

test("a cancellation named by a heartbeat aborts the handler and reports the task cancelled", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(25n, {})], cancel: [25n] }).start();
  let reason: unknown;
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], logger: silent }, (_task, signal) =>
    new Promise((_resolve, reject) => signal.addEventListener("abort", () => {
      reason = signal.reason;
      reject(signal.reason);
    }))));
  const run = worker.run();
  await until(() => shard.outcomes.length === 1);
  worker.stop();
  await run;
  shard.stop();
  assert.ok(reason instanceof TaskCancelledError);
  assert.ok(shard.outcomes[0]!.cancelled !== undefined);
  assert.ok(shard.heartbeats.some((ids) => ids.includes(25n)));
});

test("a graceful stop lets a task finish within the grace and releases one that outlives it", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(1n, { ms: 50 }), jsonTask(2n, { ms: 10_000 })] }).start();
  let started = 0;
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], concurrency: 2, shutdownGraceMs: 300, logger: silent },
    async (task, signal) => {
      started++;
      await sleepPayloadMs(task, signal);
      return "done";
    }));
  const run = worker.run();
  await until(() => started === 2);
  worker.stop();
  await run;
  shard.stop();
  const byId = new Map(shard.outcomes.map((o) => [o.taskId, o]));
  assert.ok(byId.get(1n)?.success !== undefined);
  assert.ok(byId.get(2n)?.released !== undefined);
});

/** Sleeps the ms a task's JSON payload names; rejects with the signal's reason when it aborts. */
function sleepPayloadMs(task: Task, signal: AbortSignal): Promise<unknown> {
  const { ms } = JSON.parse(task.payload.toString()) as { ms: number };
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(signal.reason);
    });
  });
}

/** A handler that sleeps the payload's ms (until its signal aborts), recording what starts and how many run at once. */
function sleeper() {
  const seen = { started: [] as bigint[], running: 0, most: 0 };
  const handler = async (task: Task, signal: AbortSignal) => {
    seen.started.push(task.id);
    seen.running++;
    seen.most = Math.max(seen.most, seen.running);
    try {
      await sleepPayloadMs(task, signal);
      return "done";
    } finally {
      seen.running--;
    }
  };
  return { seen, handler };
}

test("with prefetch a worker gives concurrency + prefetch credits, runs at most concurrency at once and heartbeats held tasks", async () => {
  const shard = await new FakeShard({ tasks: [1n, 2n, 3n].map((id) => jsonTask(id, { ms: 150 })) }).start();
  const { seen, handler } = sleeper();
  let beatsBefore3 = -1;
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], concurrency: 1, prefetch: 2, logger: silent }, (task, signal) => {
    if (task.id === 3n) beatsBefore3 = shard.heartbeats.length;
    return handler(task, signal);
  }));
  const run = worker.run();
  await until(() => shard.outcomes.length === 3);
  worker.stop();
  await run;
  shard.stop();
  assert.deepEqual(shard.firstCredits, [3]);
  assert.deepEqual(seen.started, [1n, 2n, 3n]);
  assert.equal(seen.most, 1);
  assert.ok(shard.outcomes.every((o) => o.success !== undefined));
  assert.ok(shard.heartbeats.slice(0, beatsBefore3).some((ids) => ids.includes(3n)), "task 3 heartbeated while held");
});

test("an invalid prefetch is refused", () => {
  for (const [concurrency, prefetch] of [[1, -1], [1, 1.5], [50_000, 50_001]] as const) {
    assert.throws(() => new Worker({ endpoint: "http://127.0.0.1:1", pools: ["default"], concurrency, prefetch }, () => null),
      (err: unknown) => err instanceof InvalidArgumentError && err.message.includes(`prefetch: ${prefetch}`));
  }
  new Worker({ endpoint: "http://127.0.0.1:1", pools: ["default"], concurrency: 50_000, prefetch: 50_000 }, () => null);
});

test("a held task the server cancels is reported cancelled without running", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(1n, { ms: 400 }), jsonTask(2n, { ms: 0 })], cancel: [2n] }).start();
  const { seen, handler } = sleeper();
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], concurrency: 1, prefetch: 1, logger: silent }, handler));
  const run = worker.run();
  await until(() => shard.outcomes.length === 2);
  worker.stop();
  await run;
  shard.stop();
  const byId = new Map(shard.outcomes.map((o) => [o.taskId, o]));
  assert.ok(byId.get(1n)?.success !== undefined);
  assert.ok(byId.get(2n)?.cancelled !== undefined);
  assert.deepEqual(seen.started, [1n]);
});

test("a graceful stop releases held tasks at once and lets the running one finish", async () => {
  const shard = await new FakeShard({ tasks: [1n, 2n, 3n].map((id) => jsonTask(id, { ms: 300 })) }).start();
  const { seen, handler } = sleeper();
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], concurrency: 1, prefetch: 2, logger: silent }, handler));
  const run = worker.run();
  await until(() => seen.started.length === 1 && shard.firstCredits.length === 1);
  await new Promise((r) => setTimeout(r, 20)); // tasks 2 and 3 arrive, held
  worker.stop();
  await until(() => shard.outcomes.length === 2);
  assert.deepEqual(shard.outcomes.map((o) => [o.taskId, o.released !== undefined]), [[2n, true], [3n, true]]);
  await run;
  shard.stop();
  assert.ok(shard.outcomes[2]?.taskId === 1n && shard.outcomes[2].success !== undefined);
  assert.deepEqual(seen.started, [1n]);
});

test("a held task whose timeout passed while it waited fails as timed out without running", async () => {
  const late = Task.fromPartial({ ...jsonTask(2n, { ms: 0 }), timeoutMs: 50n });
  const shard = await new FakeShard({ tasks: [jsonTask(1n, { ms: 150 }), late, jsonTask(3n, { ms: 0 })] }).start();
  const { seen, handler } = sleeper();
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], concurrency: 1, prefetch: 2, logger: silent }, handler));
  const run = worker.run();
  await until(() => shard.outcomes.length === 3);
  worker.stop();
  await run;
  shard.stop();
  const byId = new Map(shard.outcomes.map((o) => [o.taskId, o]));
  assert.equal(byId.get(2n)?.failure?.retryable, true);
  assert.match(byId.get(2n)?.failure?.error ?? "", /timed out after 50 ms/);
  assert.deepEqual(seen.started, [1n, 3n]);
});

test("a broken stream keeps held tasks: the next stream's first credits subtract them", async () => {
  const tasks = [jsonTask(1n, { ms: 10 }), jsonTask(2n, { ms: 400 }), jsonTask(3n, { ms: 400 })];
  const shard = await new FakeShard({ tasks, failFirstStream: true }).start();
  const { seen, handler } = sleeper();
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], concurrency: 1, prefetch: 2, logger: silent,
    retry: { initialBackoffMs: 5 } }, handler));
  const run = worker.run();
  await until(() => new Set(shard.outcomes.map((o) => o.taskId)).size === 3);
  worker.stop();
  await run;
  shard.stop();
  assert.deepEqual(shard.firstCredits, [3, 1]); // 2 running, 3 held as the second stream opened
  assert.deepEqual(seen.started, [1n, 2n, 3n]);
  assert.ok(shard.outcomes.every((o) => o.success !== undefined));
});

test("a worker follows 3 redirects in a row and refuses the 4th, naming the chain", async () => {
  const shards: FakeShard[] = [];
  for (let i = 0; i < 5; i++) shards.push(new FakeShard({ redirectTo: () => shards[i + 1]!.url }));
  await Promise.all(shards.map((s) => s.start()));
  const worker = tracked(new Worker({ endpoint: shards[0]!.url, pools: ["gpu"], logger: silent }, () => null));
  await assert.rejects(worker.run(), (err: unknown) =>
    err instanceof TooManyRedirectsError && /more than 3/.test(err.message) && err.message.includes(shards[3]!.url));
  assert.deepEqual(shards.map((s) => s.registers), [1, 1, 1, 1, 0]);
  shards.forEach((s) => s.stop());
});

test("the client keeps a top-bit id whole and raises the code's error with the server's reason", async () => {
  const shard = await new FakeShard().start();
  const client = new Client({ endpoint: shard.url, logger: silent });
  const task = await client.get(TOP_BIT_ID);
  assert.equal(task.id, TOP_BIT_ID);
  await assert.rejects(client.get(5n), (err: unknown) =>
    err instanceof NotFoundError && err.reason === "TASK_NOT_FOUND" && err.message === "no task 5");
  client.close();
  shard.stop();
});

test("watch resumes from the start a sharded server states and skips events replayed after a reconnect", async () => {
  const event = (seq: bigint): TaskEvent => ({ task: undefined, time: undefined, shard: "cpu", seq, cursor: `1:${seq},2:7` });
  const shard = await new FakeShard({
    watch: [
      { start: "1:5,2:7", events: [], fail: true }, // broke before any event: resume from its start
      { start: "1:5,2:7", events: [event(6n), event(7n)], fail: true },
      { events: [event(7n), event(8n)] }, // 7 replayed
    ],
  }).start();
  const client = new Client({ endpoint: shard.url, logger: silent, retry: { initialBackoffMs: 1, maxBackoffMs: 5 } });
  const seqs: bigint[] = [];
  for await (const ev of client.watch()) {
    seqs.push(ev.seq);
    if (seqs.length === 3) break;
  }
  assert.deepEqual(seqs, [6n, 7n, 8n]);
  assert.deepEqual(shard.watchCursors, ["", "1:5,2:7", "1:7,2:7"]);
  client.close();
  shard.stop();
});
