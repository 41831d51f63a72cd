// The worker and the client against in-process grpc-js servers that play cronoq's services.
import { test } from "node:test";
import assert from "node:assert/strict";
import type { TaskReport } from "../src/gen/cronoq/v1/worker_service.js";
import { Task, type TaskEvent } from "../src/gen/cronoq/v1/task.js";
import {
  Client,
  defaultPrefetch,
  InvalidArgumentError,
  NotFoundError,
  Snooze,
  TaskCancelledError,
  TooManyRedirectsError,
  Worker,
  type Handler,
  type WorkerOptions,
} from "../src/index.js";
import { TaskContext } from "../src/worker.js";
import { FakeShard, jsonTask, tracked, until } from "./fake_shard.js";
import { silent, TOP_BIT_ID } from "./helpers.js";

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

test("the default prefetch is 4 tasks a slot, fewer when concurrency + prefetch would pass 100,000", () => {
  assert.equal(defaultPrefetch(1), 4);
  assert.equal(defaultPrefetch(16), 64);
  assert.equal(defaultPrefetch(99_000), 1_000);
  assert.equal(defaultPrefetch(100_000), 0);
  for (const concurrency of [99_000, 100_000]) { // the default is always a valid prefetch
    new Worker({ endpoint: "http://127.0.0.1:1", pools: ["default"], concurrency }, () => null);
  }
});

test("each Work stream's first message gives slots = concurrency; credits add the default prefetch unless one is given, 0: none", async () => {
  for (const [prefetch, credits] of [[undefined, 5 * 3], [0, 3], [2, 5]] as const) {
    const shard = await new FakeShard({ tasks: [jsonTask(1n, {}), jsonTask(2n, {})], failFirstStream: true }).start();
    const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], concurrency: 3, prefetch, logger: silent,
      retry: { initialBackoffMs: 5 } }, () => "ok"));
    const run = worker.run();
    await until(() => new Set(shard.outcomes.map((o) => o.taskId)).size === 2 && shard.heartbeats.length > 0);
    worker.stop();
    await run;
    shard.stop();
    assert.deepEqual(shard.firstCredits, [credits, credits], `prefetch ${prefetch}`);
    assert.deepEqual(shard.firstSlots, [3, 3], `prefetch ${prefetch}`);
    assert.equal(shard.laterSlots, 0, `prefetch ${prefetch}: slots only in a stream's first message`);
  }
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

/** The reports of a task that heartbeats carried, with the stream each came on and whether it was answered. */
function reportsOf(shard: FakeShard, id: bigint): Array<{ stream: number; report: TaskReport; answered: boolean }> {
  return shard.beatReports.flatMap((beat) => beat.reports.filter((r) => r.taskId === id).map((report) => ({ ...beat, report })));
}

/** Runs a worker on shard until it has reported n outcomes, then stops it. */
async function runUntilOutcomes(shard: FakeShard, n: number, handler: Handler, opts: Partial<WorkerOptions> = {}): Promise<void> {
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], logger: silent, retry: { initialBackoffMs: 5 }, ...opts }, handler));
  const run = worker.run();
  await until(() => shard.outcomes.length >= n);
  worker.stop();
  await run;
  shard.stop();
}

test("a handler's Snooze is reported snoozed with its ms, rounded down, and its reason", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(1n, { ms: 1500.9, reason: "busy" }), jsonTask(2n, { ms: 0 })] }).start();
  await runUntilOutcomes(shard, 2, (task) => {
    const { ms, reason } = JSON.parse(task.payload.toString()) as { ms: number; reason?: string };
    throw new Snooze(ms, reason);
  });
  const byId = new Map(shard.outcomes.map((o) => [o.taskId, o]));
  assert.deepEqual(byId.get(1n)?.snoozed, { snoozeMs: 1500, reason: "busy" });
  assert.deepEqual(byId.get(2n)?.snoozed, { snoozeMs: 0, reason: "" });
  assert.ok(shard.outcomes.every((o) => o.failure === undefined && o.success === undefined));
});

test("a snooze, a progress or a checkpoint out of bounds is a RangeError, and nothing is recorded", () => {
  for (const ms of [-1, -0.5, 4_294_967_296, Number.NaN, Number.POSITIVE_INFINITY]) {
    assert.throws(() => new Snooze(ms), RangeError, `snooze ${ms}`);
  }
  assert.equal(new Snooze(4_294_967_295.9).ms, 4_294_967_295);
  const recorded: unknown[] = [];
  const ctx = new TaskContext(jsonTask(1n, {}), 8, (update) => recorded.push(update), () => {});
  for (const value of [Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY]) {
    assert.throws(() => ctx.reportProgress(value), RangeError, `progress ${value}`);
  }
  assert.throws(() => ctx.reportProgress(0.5, "é".repeat(512) + "x"), RangeError); // 1,025 bytes
  for (const message of ["line one\nline two", "\u0000", "tab\t", "\u007f", "c1 \u0085"]) {
    assert.throws(() => ctx.reportProgress(0.5, message), /control character/, JSON.stringify(message));
  }
  assert.throws(() => ctx.saveCheckpoint(new Uint8Array(9)), RangeError);
  assert.throws(() => ctx.saveCheckpoint("ninebytes"), RangeError);
  assert.deepEqual(recorded, []);
  assert.equal(ctx.checkpoint, null);
  ctx.reportProgress(-2.5, "é".repeat(512)); // 1,024 bytes
  ctx.reportProgress(1, "\u00a0 is not a control character");
  ctx.saveCheckpoint("eight by");
  assert.equal(recorded.length, 3);
  assert.equal(Buffer.from(ctx.checkpoint!).toString(), "eight by");
});

test("a progress message with a line separator or a bidi control is a RangeError naming it, and nothing is recorded", () => {
  const hex = (c: string) => c.charCodeAt(0).toString(16).padStart(4, "0");
  const recorded: unknown[] = [];
  const ctx = new TaskContext(jsonTask(1n, {}), 8, (update) => recorded.push(update), () => {});
  for (const bad of "\u2028\u2029\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u061c") {
    assert.throws(
      () => ctx.reportProgress(0.5, `report${bad}fdp.exe`),
      (err: unknown) => err instanceof RangeError && err.message.includes(`control character "\\u${hex(bad)}"`),
      `U+${hex(bad)}`,
    );
  }
  assert.deepEqual(recorded, []);
});

test("a handler gets the leased task's snoozes and checkpoint, then the checkpoint it saved; max_checkpoint_bytes is the server's, else 256 KiB", async () => {
  const resumed = Task.fromPartial({ ...jsonTask(1n, {}), snoozes: 3, checkpoint: Buffer.from("step-7") });
  for (const [max, limit] of [[0n, 262_144], [100n, 100]] as const) {
    const shard = await new FakeShard({ tasks: [resumed, jsonTask(2n, {})], maxCheckpointBytes: max }).start();
    const seen: Array<[bigint, number, string | null, string | null, boolean, boolean]> = [];
    await runUntilOutcomes(shard, 2, (task, _signal, ctx) => {
      const leased = ctx.checkpoint && Buffer.from(ctx.checkpoint).toString();
      const fits = (n: number) => {
        try {
          ctx.saveCheckpoint(new Uint8Array(n));
          return true;
        } catch (err) {
          if (err instanceof RangeError) return false;
          throw err;
        }
      };
      const bounds = [fits(limit), fits(limit + 1)] as const;
      ctx.saveCheckpoint(`after ${task.id}`);
      seen.push([task.id, ctx.snoozes, leased, ctx.checkpoint && Buffer.from(ctx.checkpoint).toString(), ...bounds]);
      return null;
    }, { concurrency: 1 });
    assert.deepEqual(seen, [[1n, 3, "step-7", "after 1", true, false], [2n, 0, null, "after 2", true, false]]);
  }
});

test("progress reported twice between heartbeats goes as one report, the last; answered, it is not sent again", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(1n, {})] }).start();
  await runUntilOutcomes(shard, 1, async (_task, _signal, ctx) => {
    ctx.reportProgress(0.25, "a quarter");
    ctx.reportProgress(0.5, "half");
    await until(() => reportsOf(shard, 1n).length > 0);
    const beats = shard.heartbeats.length;
    await until(() => shard.heartbeats.length >= beats + 2); // two more heartbeats, after the answer
    return null;
  });
  assert.deepEqual(reportsOf(shard, 1n).map(({ report }) => [report.progress?.value, report.progress?.message, report.checkpoint]),
    [[0.5, "half", undefined]]);
  assert.equal(shard.outcomes[0]?.report, undefined);
});

test("a report still pending when the handler ends rides its outcome, whatever the outcome", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(1n, {}), jsonTask(2n, {})], heartbeatIntervalMs: 60_000 }).start();
  await runUntilOutcomes(shard, 2, (task, _signal, ctx) => {
    ctx.saveCheckpoint(`page ${task.id}`);
    ctx.reportProgress(0.9, "nearly");
    if (task.id === 2n) throw new Snooze(10);
    return null;
  });
  assert.deepEqual(shard.beatReports.flatMap((b) => b.reports), []);
  for (const id of [1n, 2n]) {
    const outcome = shard.outcomes.find((o) => o.taskId === id);
    assert.equal(outcome?.report?.taskId, id);
    assert.equal(outcome?.report?.attempt, 1);
    assert.deepEqual(outcome?.report?.progress, { value: 0.9, message: "nearly", updatedAt: undefined });
    assert.equal(outcome?.report?.checkpoint?.toString(), `page ${id}`);
  }
  assert.ok(shard.outcomes.find((o) => o.taskId === 2n)?.snoozed);
});

test("a report a broken stream did not answer is sent again on the next stream", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(1n, {})], failFirstStreamOnReports: true }).start();
  await runUntilOutcomes(shard, 1, async (_task, _signal, ctx) => {
    ctx.saveCheckpoint("step-2");
    await until(() => reportsOf(shard, 1n).some(({ stream }) => stream === 2));
    const beats = shard.heartbeats.length;
    await until(() => shard.heartbeats.length >= beats + 2);
    return null;
  });
  const sent = reportsOf(shard, 1n);
  assert.deepEqual(sent.map(({ stream, report }) => [stream, report.checkpoint?.toString()]), [[1, "step-2"], [2, "step-2"]]);
  assert.equal(shard.outcomes[0]?.report, undefined);
});

// Timing-sensitive (generous margins): heartbeats every 100 ms, each answered 250 ms late.
test("a report sent but not answered rides the outcome; one that replaced it stays pending when the older is answered", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(1n, {}), jsonTask(2n, {})], heartbeatAnswerDelayMs: 250 }).start();
  await runUntilOutcomes(shard, 2, async (task, _signal, ctx) => {
    ctx.reportProgress(0.1, "first");
    await until(() => reportsOf(shard, task.id).length > 0); // sent, answered in 250 ms
    if (task.id === 1n) return null; // before the answer
    ctx.reportProgress(0.2, "second"); // sent by the next heartbeat, answered after this returns
    await until(() => reportsOf(shard, task.id)[0]!.answered);
    await new Promise((r) => setTimeout(r, 30)); // the worker reads the answer: "first" is no longer pending, "second" is
    return null;
  }, { concurrency: 1 });
  const byId = new Map(shard.outcomes.map((o) => [o.taskId, o]));
  assert.equal(byId.get(1n)?.report?.progress?.message, "first");
  assert.equal(byId.get(2n)?.report?.progress?.message, "second");
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
  const event = (seq: bigint): TaskEvent => ({ task: undefined, time: undefined, shard: "cpu", seq, cursor: `1:${seq},2:7`, progress: false, replaced: false });
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
