// The client's submissions and day-2 calls (retry, delete, attempts, bulk actions,
// pause/resume, schedules, the read calls) against an in-process grpc-js server that plays
// cronoq's task, admin, schedule and worker services and records requests.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import {
  Metadata,
  Server,
  status as Status,
  type sendUnaryData,
  type ServerUnaryCall,
  type UntypedServiceImplementation,
} from "@grpc/grpc-js";
import {
  CancelTaskResponse,
  CancelTasksResponse,
  GetTaskResponse,
  ListTasksResponse,
  RetryTaskResponse,
  SubmitBatchResponse,
  SubmitTaskResponse,
  TaskServiceService,
  type CancelTaskRequest,
  type GetTaskRequest,
  type ListTasksRequest,
  type SubmitBatchRequest,
  type SubmitTaskRequest,
} from "../src/gen/cronoq/v1/task_service.js";
import { AdminServiceService, GetServerInfoResponse, GetSnapshotResponse, Role } from "../src/gen/cronoq/v1/admin_service.js";
import { ListSchedulesResponse, Schedule, ScheduleServiceService, type PutScheduleRequest } from "../src/gen/cronoq/v1/schedule_service.js";
import { ListWorkersResponse, WorkerServiceService } from "../src/gen/cronoq/v1/worker_service.js";
import { Attempt, AttemptOutcome, DependencyResult, Task, TaskState } from "../src/gen/cronoq/v1/task.js";
import { Client, FailedPreconditionError, InvalidArgumentError, isTerminal, KeyMode, NotFoundError, PermissionDeniedError, RunWhen, type BulkResult } from "../src/index.js";
import { listenLocal, silent, statusDetailsBin, TOP_BIT_ID } from "./helpers.js";

/** What a call of the fake answers: a response, or a gRPC error. */
type Answer = object | { code: number; details: string; reason?: string };

/** Plays every unary day-2 RPC: records each request by method, answers from `answers` (in order; the last repeats). */
class OpsShard {
  readonly server = new Server();
  url = "";
  readonly requests: Record<string, unknown[]> = {};
  readonly tokens: string[] = [];

  constructor(private readonly answers: Record<string, Answer[]>) {
    const handler = (method: string) => (call: ServerUnaryCall<unknown, unknown>, cb: sendUnaryData<unknown>) => {
      (this.requests[method] ??= []).push(call.request);
      this.tokens.push(String(call.metadata.get("authorization")[0] ?? ""));
      const queue = this.answers[method] ?? [{ code: Status.UNIMPLEMENTED, details: `${method} not played` }];
      const answer = queue.length > 1 ? queue.shift()! : queue[0]!;
      if ("code" in answer) {
        const md = new Metadata();
        if (answer.reason) md.set("grpc-status-details-bin", statusDetailsBin(answer.reason, {}));
        cb({ code: answer.code, details: answer.details, metadata: md });
      } else {
        cb(null, answer);
      }
    };
    const task: UntypedServiceImplementation = {};
    for (const method of ["submitTask", "submitBatch", "getTask", "cancelTask", "listTasks", "retryTask", "deleteTask", "cancelTasks", "retryTasks", "deleteTasks"]) task[method] = handler(method);
    this.server.addService(TaskServiceService, task);
    const admin: UntypedServiceImplementation = {};
    for (const method of ["pausePool", "resumePool", "getSnapshot", "getServerInfo"]) admin[method] = handler(method);
    this.server.addService(AdminServiceService, admin);
    const schedule: UntypedServiceImplementation = {};
    for (const method of ["putSchedule", "deleteSchedule", "listSchedules"]) schedule[method] = handler(method);
    this.server.addService(ScheduleServiceService, schedule);
    this.server.addService(WorkerServiceService, { listWorkers: handler("listWorkers") });
  }

  async start(): Promise<this> {
    running.push(this);
    this.url = await listenLocal(this.server);
    return this;
  }

  stop(): void {
    this.server.forceShutdown();
  }
}

const running: OpsShard[] = [];
after(() => running.forEach((s) => s.stop()));

async function withClient(answers: Record<string, Answer[]>, body: (client: Client, shard: OpsShard) => Promise<void>): Promise<void> {
  const shard = await new OpsShard(answers).start();
  const client = new Client({ endpoint: shard.url, token: "t", logger: silent, retry: { initialBackoffMs: 5, maxBackoffMs: 20 } });
  try {
    await body(client, shard);
  } finally {
    client.close();
    shard.stop();
  }
}

const failed = Task.fromPartial({ id: TOP_BIT_ID, key: "job-1", state: TaskState.TASK_STATE_PENDING, attempt: 3, maxAttempts: 4 });

test("retry by key sends run_at and extra_attempts and answers the task", async () => {
  await withClient({ retryTask: [RetryTaskResponse.fromPartial({ task: failed, dependentsRestored: 2n })] }, async (client, shard) => {
    const task = await client.retry({ key: "job-1" }, { runAt: new Date(1_700_000_000_250), extraAttempts: 3 });
    assert.equal(task.id, TOP_BIT_ID);
    assert.equal(task.state, TaskState.TASK_STATE_PENDING);
    assert.deepEqual(shard.requests["retryTask"], [{
      task: { key: "job-1", id: undefined },
      runAt: { seconds: 1_700_000_000n, nanos: 250_000_000 },
      extraAttempts: 3,
    }]);
    assert.deepEqual(shard.tokens, ["Bearer t"]);
  });
});

test("retry by id without options leaves run_at unset and extra_attempts 0 (the server's defaults)", async () => {
  await withClient({ retryTask: [RetryTaskResponse.fromPartial({ task: failed })] }, async (client, shard) => {
    await client.retry(TOP_BIT_ID);
    assert.deepEqual(shard.requests["retryTask"], [{ task: { id: TOP_BIT_ID, key: undefined }, runAt: undefined, extraAttempts: 0 }]);
  });
});

test("retry and delete are retried on UNAVAILABLE as cancel is; a refusal is raised with its reason, not retried", async () => {
  const unavailable = { code: Status.UNAVAILABLE, details: "restarting" };
  await withClient({
    retryTask: [unavailable, { code: Status.FAILED_PRECONDITION, details: "task 5 is RUNNING", reason: "TASK_NOT_RETRYABLE" }],
    deleteTask: [unavailable, { id: 5n }],
  }, async (client, shard) => {
    await assert.rejects(client.retry(5n), (err: unknown) =>
      err instanceof FailedPreconditionError && err.message === "task 5 is RUNNING" && err.reason === "TASK_NOT_RETRYABLE");
    assert.equal(shard.requests["retryTask"]!.length, 2);
    assert.equal(await client.delete(5n), 5n);
    assert.equal(shard.requests["deleteTask"]!.length, 2);
  });
});

test("delete answers the id deleted, whole; a missing key is a NotFoundError", async () => {
  await withClient({
    deleteTask: [{ id: TOP_BIT_ID }, { code: Status.NOT_FOUND, details: "no task with key gone", reason: "TASK_NOT_FOUND" }],
  }, async (client, shard) => {
    assert.equal(await client.delete({ id: TOP_BIT_ID }), TOP_BIT_ID);
    await assert.rejects(client.delete({ key: "gone" }), (err: unknown) => err instanceof NotFoundError && err.reason === "TASK_NOT_FOUND");
    assert.deepEqual(shard.requests["deleteTask"], [{ task: { id: TOP_BIT_ID, key: undefined } }, { task: { key: "gone", id: undefined } }]);
  });
});

test("getWithAttempts asks for the attempts and answers the task with them, oldest first", async () => {
  const attempts = [
    Attempt.fromPartial({ attempt: 1, workerName: "w-1", outcome: AttemptOutcome.ATTEMPT_OUTCOME_FAILED, error: "boom", durationMs: 12n }),
    Attempt.fromPartial({ attempt: 2, workerName: "w-2", outcome: AttemptOutcome.ATTEMPT_OUTCOME_RUNNING }),
  ];
  await withClient({ getTask: [GetTaskResponse.fromPartial({ task: failed, attempts })] }, async (client, shard) => {
    const got = await client.getWithAttempts({ key: "job-1" });
    assert.equal(got.task.id, TOP_BIT_ID);
    assert.deepEqual(got.attempts.map((a) => [a.attempt, a.outcome, a.error]), [
      [1, AttemptOutcome.ATTEMPT_OUTCOME_FAILED, "boom"],
      [2, AttemptOutcome.ATTEMPT_OUTCOME_RUNNING, ""],
    ]);
    const req = shard.requests["getTask"]![0] as { includeAttempts: boolean; includeDependents: boolean };
    assert.equal(req.includeAttempts, true);
    assert.equal(req.includeDependents, false);
  });
});

// The three bulk responses have the same fields.
const bulkAnswer = CancelTasksResponse.fromPartial({
  matched: 7n,
  changed: 5n,
  shards: [{ shard: "cpu", matched: 4n, changed: 4n }, { shard: "gpu", matched: 3n, changed: 1n }],
  unavailableShards: ["tpu"],
});

test("a bulk retry sends the whole filter, dry_run, run_at and extra_attempts, and answers the counts per shard", async () => {
  await withClient({ retryTasks: [bulkAnswer] }, async (client, shard) => {
    const result = await client.retryTasks({
      pool: "llm",
      states: [TaskState.TASK_STATE_FAILED],
      createdAfter: 1_700_000_000_000,
      createdBefore: new Date(1_700_000_001_500),
      finishedAfter: 1_700_000_002_000,
      finishedBefore: 1_700_000_003_000,
      keyPrefix: "op-",
      errorContains: "timeout",
      ids: [TOP_BIT_ID, 3n],
      parentId: TOP_BIT_ID,
    }, { dryRun: true, runAt: 1_800_000_000_000, extraAttempts: 2 });
    assert.deepEqual(result, bulkAnswer);
    assert.deepEqual(shard.requests["retryTasks"], [{
      filter: {
        pool: "llm",
        states: [TaskState.TASK_STATE_FAILED],
        createdAfter: { seconds: 1_700_000_000n, nanos: 0 },
        createdBefore: { seconds: 1_700_000_001n, nanos: 500_000_000 },
        finishedAfter: { seconds: 1_700_000_002n, nanos: 0 },
        finishedBefore: { seconds: 1_700_000_003n, nanos: 0 },
        keyPrefix: "op-",
        errorContains: "timeout",
        ids: [TOP_BIT_ID, 3n],
        parentId: TOP_BIT_ID,
      },
      dryRun: true,
      runAt: { seconds: 1_800_000_000n, nanos: 0 },
      extraAttempts: 2,
    }]);
  });
});

test("a bulk answer says when a shard stopped at its time bound (incomplete: call again)", async () => {
  const partial = CancelTasksResponse.fromPartial({ matched: 9n, changed: 2n, shards: [{ shard: "cpu", matched: 9n, changed: 2n, incomplete: true }], incomplete: true });
  await withClient({ deleteTasks: [partial] }, async (client) => {
    const result: BulkResult = await client.deleteTasks({ pool: "default" });
    assert.equal(result.incomplete, true);
    assert.equal(result.shards[0]!.incomplete, true);
  });
});

test("a bulk cancel and a bulk delete send their filter and dry_run (false when absent)", async () => {
  const empty = { pool: "", states: [], createdAfter: undefined, createdBefore: undefined, finishedAfter: undefined,
    finishedBefore: undefined, keyPrefix: "", errorContains: "", ids: [], parentId: 0n };
  await withClient({ cancelTasks: [bulkAnswer], deleteTasks: [bulkAnswer] }, async (client, shard) => {
    assert.deepEqual(await client.cancelTasks({ keyPrefix: "op-" }), bulkAnswer);
    assert.deepEqual(await client.deleteTasks({ pool: "llm" }, { dryRun: true }), bulkAnswer);
    assert.deepEqual(shard.requests["cancelTasks"], [{ filter: { ...empty, keyPrefix: "op-" }, dryRun: false }]);
    assert.deepEqual(shard.requests["deleteTasks"], [{ filter: { ...empty, pool: "llm" }, dryRun: true }]);
  });
});

test("pausePool and resumePool name the pool and answer its pause: since when and by whom", async () => {
  const pausedAt = { seconds: 1_700_000_000n, nanos: 0 };
  await withClient({
    pausePool: [{ pause: { pool: "llm", paused: true, pausedAt, pausedBy: "token:ops" } }],
    resumePool: [{ pause: { pool: "llm", paused: false, pausedAt: undefined, pausedBy: "" } }],
  }, async (client, shard) => {
    assert.deepEqual(await client.pausePool("llm"), { pool: "llm", paused: true, pausedAt, pausedBy: "token:ops" });
    assert.deepEqual(await client.resumePool("llm"), { pool: "llm", paused: false, pausedAt: undefined, pausedBy: "" });
    assert.deepEqual(shard.requests["pausePool"], [{ pool: "llm" }]);
    assert.deepEqual(shard.requests["resumePool"], [{ pool: "llm" }]);
  });
});

test("submit and submitBatch send each task's groupKey (none given: empty), and the task answered has it", async () => {
  const grouped = Task.fromPartial({ id: TOP_BIT_ID, pool: "default", groupKey: "tenant-a" });
  const answers = {
    submitTask: [SubmitTaskResponse.fromPartial({ task: grouped })],
    submitBatch: [SubmitBatchResponse.fromPartial({ tasks: [grouped, grouped] })],
  };
  await withClient(answers, async (client, shard) => {
    const { task } = await client.submit({ pool: "default", groupKey: "tenant-a" });
    assert.equal(task.groupKey, "tenant-a");
    assert.equal((shard.requests["submitTask"]![0] as SubmitTaskRequest).groupKey, "tenant-a");
    await client.submitBatch([{ pool: "default", groupKey: "tenant-b" }, { pool: "default" }]);
    const batch = shard.requests["submitBatch"]![0] as SubmitBatchRequest;
    assert.deepEqual(batch.tasks.map((t) => t.groupKey), ["tenant-b", ""]);
  });
});

test("submit and submitBatch send runWhen (absent: unspecified, the server's once-all-succeeded)", async () => {
  const task = Task.fromPartial({ id: 9n, pool: "default", runWhen: RunWhen.RUN_WHEN_DEPENDENCIES_ENDED });
  const answers = { submitTask: [SubmitTaskResponse.fromPartial({ task })], submitBatch: [SubmitBatchResponse.fromPartial({ tasks: [task, task] })] };
  await withClient(answers, async (client, shard) => {
    const finalizer = { pool: "default", dependsOn: [{ key: "wf-a" }], runWhen: RunWhen.RUN_WHEN_DEPENDENCIES_ENDED };
    const { task: answered } = await client.submit(finalizer);
    assert.equal(answered.runWhen, RunWhen.RUN_WHEN_DEPENDENCIES_ENDED);
    const sent = shard.requests["submitTask"]![0] as SubmitTaskRequest;
    assert.equal(sent.runWhen, RunWhen.RUN_WHEN_DEPENDENCIES_ENDED);
    assert.deepEqual(sent.dependsOn, [{ key: "wf-a", id: undefined }]);
    await client.submitBatch([finalizer, { pool: "default" }]);
    const batch = shard.requests["submitBatch"]![0] as SubmitBatchRequest;
    assert.deepEqual(batch.tasks.map((t) => t.runWhen), [RunWhen.RUN_WHEN_DEPENDENCIES_ENDED, RunWhen.RUN_WHEN_UNSPECIFIED]);
  });
});

test("submit and submitBatch send the key mode, debounce, max debounce, key TTL and start deadline (absent: zero, unset), and answer replaced", async () => {
  const task = Task.fromPartial({ id: TOP_BIT_ID, pool: "default", key: "reindex-7" });
  const answers = {
    submitTask: [SubmitTaskResponse.fromPartial({ task, replaced: true })],
    submitBatch: [SubmitBatchResponse.fromPartial({ tasks: [task, task], deduplicatedIds: [], replacedIds: [TOP_BIT_ID] })],
  };
  await withClient(answers, async (client, shard) => {
    const debounced = {
      pool: "default", key: "reindex-7", keyMode: KeyMode.KEY_MODE_DEBOUNCE, debounceMs: 2000.4, maxDebounceMs: 30_000,
      keyTtlMs: 86_400_000, startBy: new Date(1_700_000_000_250),
    };
    assert.deepEqual(await client.submit(debounced), { task, deduplicated: false, replaced: true });
    const sent = shard.requests["submitTask"]![0] as SubmitTaskRequest;
    assert.deepEqual([sent.keyMode, sent.debounceMs, sent.maxDebounceMs, sent.keyTtlMs, sent.startBy],
      [KeyMode.KEY_MODE_DEBOUNCE, 2000n, 30_000n, 86_400_000n, { seconds: 1_700_000_000n, nanos: 250_000_000 }]);
    const batch = await client.submitBatch([
      { pool: "default", key: "a", keyMode: KeyMode.KEY_MODE_REPLACE_PENDING, startBy: 1_700_000_001_000 },
      { pool: "default" },
    ]);
    assert.deepEqual(batch.replacedIds, [TOP_BIT_ID]);
    const [replacing, plain] = (shard.requests["submitBatch"]![0] as SubmitBatchRequest).tasks;
    assert.deepEqual([replacing!.keyMode, replacing!.startBy], [KeyMode.KEY_MODE_REPLACE_PENDING, { seconds: 1_700_000_001n, nanos: 0 }]);
    assert.deepEqual([plain!.keyMode, plain!.debounceMs, plain!.maxDebounceMs, plain!.keyTtlMs, plain!.startBy],
      [KeyMode.KEY_MODE_UNSPECIFIED, 0n, 0n, 0n, undefined]);
  });
});

test("a duration that is not a number is refused before sending, naming the field; a negative one is the server's to refuse", async () => {
  const task = Task.fromPartial({ id: 3n, pool: "default" });
  await withClient({ submitTask: [SubmitTaskResponse.fromPartial({ task })] }, async (client, shard) => {
    await assert.rejects(client.submit({ pool: "default", key: "k", keyTtlMs: Number.NaN }),
      (err: unknown) => err instanceof InvalidArgumentError && err.message === "key_ttl_ms: NaN is not a number of milliseconds");
    assert.equal(shard.requests["submitTask"], undefined);
    await client.submit({ pool: "default", key: "k", keyMode: KeyMode.KEY_MODE_DEBOUNCE, debounceMs: -5 });
    assert.equal((shard.requests["submitTask"]![0] as SubmitTaskRequest).debounceMs, -5n);
  });
});

test("EXPIRED is terminal, with SUCCEEDED, FAILED and CANCELLED; PENDING, BLOCKED and RUNNING are not", () => {
  const ended = Object.values(TaskState).filter((s): s is TaskState => typeof s === "number" && isTerminal(s));
  assert.deepEqual(ended.sort((a, b) => a - b), [TaskState.TASK_STATE_SUCCEEDED, TaskState.TASK_STATE_FAILED, TaskState.TASK_STATE_CANCELLED, TaskState.TASK_STATE_EXPIRED]);
});

test("get asks for dependency results and children only when told; with includeChildren it answers the task and its children", async () => {
  const dependencyResults = [DependencyResult.fromPartial({ id: 4n, key: "wf-a", state: TaskState.TASK_STATE_SUCCEEDED, result: Buffer.from("2"), contentType: "application/json" })];
  const parent = Task.fromPartial({ id: TOP_BIT_ID, state: TaskState.TASK_STATE_SUCCEEDED, dependencyResults });
  const children = [Task.fromPartial({ id: 11n, parentId: TOP_BIT_ID }), Task.fromPartial({ id: 12n, parentId: TOP_BIT_ID })];
  await withClient({ getTask: [GetTaskResponse.fromPartial({ task: parent, children })] }, async (client, shard) => {
    const plain: Task = await client.get(TOP_BIT_ID);
    assert.equal(plain.id, TOP_BIT_ID);
    const withResults: Task = await client.get(TOP_BIT_ID, { includeDependencyResults: true });
    assert.deepEqual(withResults.dependencyResults.map((d) => [d.id, d.key, d.result.toString()]), [[4n, "wf-a", "2"]]);
    const family = await client.get({ key: "root" }, { includeChildren: true, includeDependencyResults: true });
    assert.equal(family.task.id, TOP_BIT_ID);
    assert.deepEqual(family.children.map((c) => [c.id, c.parentId]), [[11n, TOP_BIT_ID], [12n, TOP_BIT_ID]]);
    const flags = (shard.requests["getTask"] as GetTaskRequest[]).map((r) => [r.includeChildren, r.includeDependencyResults, r.includeAttempts]);
    assert.deepEqual(flags, [[false, false, false], [false, true, false], [true, true, false]]);
  });
});

test("cancel with includeDescendants asks for them and answers how many were cancelled; without, it answers the task", async () => {
  const cancelled = Task.fromPartial({ id: 5n, state: TaskState.TASK_STATE_CANCELLED });
  await withClient({ cancelTask: [CancelTaskResponse.fromPartial({ task: cancelled, descendantsCancelled: 7n })] }, async (client, shard) => {
    const task: Task = await client.cancel(5n);
    assert.equal(task.state, TaskState.TASK_STATE_CANCELLED);
    const tree = await client.cancel({ key: "root" }, { includeDescendants: true });
    assert.equal(tree.task.id, 5n);
    assert.equal(tree.descendantsCancelled, 7n);
    assert.deepEqual((shard.requests["cancelTask"] as CancelTaskRequest[]).map((r) => r.includeDescendants), [false, true]);
  });
});

test("list sends the filter's parentId (a top-bit id whole); absent, 0: any task", async () => {
  await withClient({ listTasks: [ListTasksResponse.fromPartial({ tasks: [Task.fromPartial({ id: 3n, parentId: TOP_BIT_ID })] })] }, async (client, shard) => {
    const page = await client.list({ filter: { parentId: TOP_BIT_ID } });
    assert.equal(page.tasks[0]!.parentId, TOP_BIT_ID);
    await client.list({ filter: { pool: "default" } });
    assert.deepEqual((shard.requests["listTasks"] as ListTasksRequest[]).map((r) => r.filter?.parentId), [TOP_BIT_ID, 0n]);
  });
});

const nextFireAt = { seconds: 1_700_000_060n, nanos: 0 };

test("putSchedule sends the schedule with its payload as submit encodes it and answers it stored, with its next fire", async () => {
  const stored = Schedule.fromPartial({ pool: "llm", name: "nightly", cron: "0 3 * * *", timezone: "Europe/Paris", groupKey: "tenant-a", nextFireAt });
  await withClient({ putSchedule: [{ schedule: stored }] }, async (client, shard) => {
    const put = await client.putSchedule({
      pool: "llm", name: "nightly", cron: "0 3 * * *", timezone: "Europe/Paris", payload: { n: 1 }, priority: 5, maxAttempts: 3,
      resources: { gpu: 1, tokens: 2n ** 40n }, timeoutMs: 1500.4, groupKey: "tenant-a", paused: true, fireAllMissed: true,
      trace: { traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" },
    });
    assert.deepEqual(put, stored);
    assert.deepEqual(shard.requests["putSchedule"], [{
      schedule: Schedule.fromPartial({
        pool: "llm", name: "nightly", cron: "0 3 * * *", timezone: "Europe/Paris", payload: Buffer.from('{"n":1}'), contentType: "application/json",
        priority: 5, maxAttempts: 3, resources: { gpu: 1n, tokens: 2n ** 40n }, timeoutMs: 1500n, groupKey: "tenant-a", paused: true, fireAllMissed: true,
        trace: { traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", tracestate: "", link: false },
      }),
    } satisfies PutScheduleRequest]);
    assert.deepEqual(shard.tokens, ["Bearer t"]);
  });
});

test("putSchedule with only its name and cron sends the server's defaults: UTC, no payload, the pool's options, no trace outside a span", async () => {
  await withClient({ putSchedule: [{ schedule: Schedule.fromPartial({ pool: "default", name: "tick", nextFireAt }) }] }, async (client, shard) => {
    await client.putSchedule({ pool: "default", name: "tick", cron: "*/5 * * * * *" });
    await client.putSchedule({ pool: "default", name: "raw", cron: "* * * * *", payload: Buffer.from([0, 255]) });
    const [plain, raw] = (shard.requests["putSchedule"] as PutScheduleRequest[]).map((r) => r.schedule!);
    assert.deepEqual(plain, Schedule.fromPartial({ pool: "default", name: "tick", cron: "*/5 * * * * *", payload: Buffer.alloc(0) }));
    assert.deepEqual([raw!.payload, raw!.contentType], [Buffer.from([0, 255]), ""]);
  });
});

test("putSchedule is retried on UNAVAILABLE, a bad cron is the server's InvalidArgumentError (not retried); a missing schedule's delete is a NotFoundError", async () => {
  await withClient({
    putSchedule: [{ code: Status.UNAVAILABLE, details: "restarting" }, { code: Status.INVALID_ARGUMENT, details: 'cron: "61 * * * *" is not a cron expression' }],
    deleteSchedule: [{}, { code: Status.NOT_FOUND, details: "no schedule llm/nightly", reason: "SCHEDULE_NOT_FOUND" }],
  }, async (client, shard) => {
    await assert.rejects(client.putSchedule({ pool: "llm", name: "nightly", cron: "61 * * * *" }),
      (err: unknown) => err instanceof InvalidArgumentError && err.message === 'cron: "61 * * * *" is not a cron expression');
    assert.equal(shard.requests["putSchedule"]!.length, 2);
    assert.equal(await client.deleteSchedule("llm", "nightly"), undefined);
    await assert.rejects(client.deleteSchedule("llm", "nightly"), (err: unknown) => err instanceof NotFoundError && err.reason === "SCHEDULE_NOT_FOUND");
    assert.deepEqual(shard.requests["deleteSchedule"], [{ pool: "llm", name: "nightly" }, { pool: "llm", name: "nightly" }]);
  });
});

test("listSchedules and listWorkers name the pool (absent: every pool) and answer the shards that did not answer", async () => {
  const schedules = ListSchedulesResponse.fromPartial({ schedules: [{ pool: "llm", name: "nightly", nextFireAt }], unavailableShards: ["gpu"] });
  const workers = ListWorkersResponse.fromPartial({ workers: [{ id: "w1", name: "box-1", pools: ["llm"], concurrency: 4, shard: "cpu" }], unavailableShards: ["gpu"] });
  await withClient({ listSchedules: [schedules], listWorkers: [workers] }, async (client, shard) => {
    assert.deepEqual(await client.listSchedules({ pool: "llm" }), schedules);
    assert.deepEqual(await client.listSchedules(), schedules);
    assert.deepEqual(await client.listWorkers({ pool: "llm" }), workers);
    assert.deepEqual(await client.listWorkers(), workers);
    assert.deepEqual(shard.requests["listSchedules"], [{ pool: "llm" }, { pool: "" }]);
    assert.deepEqual(shard.requests["listWorkers"], [{ pool: "llm" }, { pool: "" }]);
  });
});

test("snapshot and serverInfo answer the server's; a refusal is raised as the SDK's error", async () => {
  const snapshot = GetSnapshotResponse.fromPartial({ shards: [{ shard: "cpu", number: 0, leader: "http://127.0.0.1:1", term: 3n, pools: [{ pool: "llm", pending: 2n }] }] });
  const info = GetServerInfoResponse.fromPartial({ version: "0.2.0", shard: "cpu", role: Role.ROLE_LEADER, term: 3n, caller: { name: "ops", allPools: true } });
  await withClient({
    getSnapshot: [snapshot],
    getServerInfo: [{ code: Status.UNAVAILABLE, details: "restarting" }, info],
  }, async (client, shard) => {
    assert.deepEqual(await client.snapshot(), snapshot);
    assert.deepEqual(await client.serverInfo(), info);
    assert.equal(shard.requests["getServerInfo"]!.length, 2);
    assert.deepEqual(shard.requests["getSnapshot"], [{}]);
  });
  await withClient({ getSnapshot: [{ code: Status.PERMISSION_DENIED, details: "token ops may not read" }] }, async (client) => {
    await assert.rejects(client.snapshot(), (err: unknown) => err instanceof PermissionDeniedError && err.message === "token ops may not read");
  });
});
