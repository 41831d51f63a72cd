// Workflows in a handler: its dependencies' results (ctx.dependencies, dependencyResults,
// dependency) and the tasks it spawns (ctx.spawn), sent with its success alone; against the
// fake shard of the worker tests.
import { test } from "node:test";
import assert from "node:assert/strict";
import { DependencyResult as DependencyResultProto, Task, TaskState } from "../src/gen/cronoq/v1/task.js";
import type { SubmitTaskRequest } from "../src/gen/cronoq/v1/task_service.js";
import {
  FailedPreconditionError,
  InvalidArgumentError,
  RunWhen,
  Snooze,
  TaskFailure,
  Worker,
  type Handler,
  type TaskContext,
} from "../src/index.js";
import { TaskContext as Context } from "../src/worker.js";
import { FakeShard, jsonTask, tracked, until } from "./fake_shard.js";
import { silent, TOP_BIT_ID } from "./helpers.js";

const JSON_TYPE = "application/json";

/** A leased task (id 100) whose dependencies ended as given. */
function dependentTask(dependencyResults: Array<Partial<DependencyResultProto>>): Task {
  return Task.fromPartial({ ...jsonTask(100n, {}), dependencyResults: dependencyResults.map((d) => DependencyResultProto.fromPartial(d)) });
}

/** Runs one worker over tasks until each has an outcome; answers the outcomes by task id. */
async function runTasks(tasks: Task[], handler: Handler, opts: { lost?: bigint[] } = {}) {
  const shard = await new FakeShard({ tasks, lost: opts.lost }).start();
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], logger: silent }, handler));
  const run = worker.run();
  await until(() => shard.outcomes.length === tasks.length);
  worker.stop();
  await run;
  shard.stop();
  return new Map(shard.outcomes.map((o) => [o.taskId, o]));
}

const threeDependencies = dependentTask([
  { id: 5n, key: "wf-a", state: TaskState.TASK_STATE_SUCCEEDED, result: Buffer.from('{"n": 2}'), contentType: JSON_TYPE },
  { id: TOP_BIT_ID, key: "wf-b", state: TaskState.TASK_STATE_SUCCEEDED, result: Buffer.from([0, 255, 1]), contentType: "application/octet-stream" },
  { id: 7n, state: TaskState.TASK_STATE_FAILED, error: "boom" },
]);

test("a handler reads its dependencies in depends_on order: JSON parsed, other bytes as they are, null without a result", async () => {
  let seen: TaskContext | undefined;
  const outcomes = await runTasks([threeDependencies], (_task, _signal, ctx) => {
    seen = ctx;
    return "ok";
  });
  assert.ok(outcomes.get(100n)?.success);
  const ctx = seen!;
  assert.deepEqual(ctx.dependencies.map((d) => [d.id, d.key, d.state, d.error]), [
    [5n, "wf-a", TaskState.TASK_STATE_SUCCEEDED, ""],
    [TOP_BIT_ID, "wf-b", TaskState.TASK_STATE_SUCCEEDED, ""],
    [7n, "", TaskState.TASK_STATE_FAILED, "boom"],
  ]);
  assert.deepEqual(ctx.dependencies[0]!.value, { n: 2 });
  assert.deepEqual([...(ctx.dependencies[1]!.value as Uint8Array)], [0, 255, 1]);
  assert.equal(ctx.dependencies[2]!.value, null);
  assert.deepEqual([...ctx.dependencyResults.keys()], [5n, TOP_BIT_ID, 7n]);
  assert.deepEqual(ctx.dependencyResults.get(5n), { n: 2 });
  assert.deepEqual(ctx.dependency("wf-a"), { n: 2 });
  assert.deepEqual([...(ctx.dependency(TOP_BIT_ID) as Uint8Array)], [0, 255, 1]);
  assert.equal(ctx.dependency(7n), null);
});

test("dependency() of a key or id the task does not depend on is a RangeError naming it and the dependencies", () => {
  const ctx = new Context(threeDependencies, 8, () => {}, () => {});
  assert.throws(() => ctx.dependency("wf-z"), (err: unknown) =>
    err instanceof RangeError && err.message.includes('key "wf-z"') && err.message.includes('5 ("wf-a")') && err.message.includes("7"));
  assert.throws(() => ctx.dependency(8n), (err: unknown) => err instanceof RangeError && err.message.includes("id 8"));
  assert.throws(() => ctx.dependency(""), RangeError); // the dependency without a key is not ""
  const alone = new Context(jsonTask(1n, {}), 8, () => {}, () => {});
  assert.deepEqual(alone.dependencies, []);
  assert.throws(() => alone.dependency("wf-a"), /dependencies: none/);
});

test("a JSON dependency result that does not parse fails when read (InvalidArgumentError naming the dependency), not before", () => {
  const ctx = new Context(dependentTask([{ id: 6n, key: "bad", state: TaskState.TASK_STATE_SUCCEEDED, result: Buffer.from("{nope"), contentType: JSON_TYPE }]),
    8, () => {}, () => {});
  assert.throws(() => ctx.dependencies, (err: unknown) => err instanceof InvalidArgumentError && err.message.includes("task 6"));
});

test("spawned tasks go with the success, in order: keys, payloads, run_when, dependencies on a key and on the spawning task", async () => {
  const outcomes = await runTasks([jsonTask(TOP_BIT_ID, {})], (task, _signal, ctx) => {
    ctx.spawn("default", { n: 1 }, { key: "c1" });
    ctx.spawn("default", new Uint8Array([9, 8]), { key: "c2", priority: 3 });
    ctx.spawn("reduce", undefined, { dependsOn: ["c1", "c2", task.id], runWhen: RunWhen.RUN_WHEN_DEPENDENCIES_ENDED });
    return { spawned: 3 };
  });
  const success = outcomes.get(TOP_BIT_ID)?.success;
  assert.ok(success);
  assert.equal(success.result.toString(), '{"spawned":3}');
  const spawned: SubmitTaskRequest[] = success.spawn;
  assert.deepEqual(spawned.map((s) => [s.pool, s.key, s.contentType, s.runWhen, s.priority]), [
    ["default", "c1", JSON_TYPE, RunWhen.RUN_WHEN_UNSPECIFIED, 0],
    ["default", "c2", "", RunWhen.RUN_WHEN_UNSPECIFIED, 3],
    ["reduce", "", "", RunWhen.RUN_WHEN_DEPENDENCIES_ENDED, 0],
  ]);
  assert.equal(spawned[0]!.payload.toString(), '{"n":1}');
  assert.deepEqual([...spawned[1]!.payload], [9, 8]);
  assert.deepEqual(spawned[2]!.dependsOn.map((r) => r.key ?? r.id), ["c1", "c2", TOP_BIT_ID]);
});

test("spawns are not sent when the attempt fails or snoozes", async () => {
  const outcomes = await runTasks([jsonTask(1n, { fail: true }), jsonTask(2n, { snooze: true })], (task, _signal, ctx) => {
    ctx.spawn("default", { child: true }, { key: `child-of-${task.id}` });
    if (task.id === 1n) throw new TaskFailure("no", { retryable: false });
    throw new Snooze(1000);
  });
  assert.ok(outcomes.get(1n)?.failure);
  assert.ok(outcomes.get(2n)?.snoozed);
  assert.ok([...outcomes.values()].every((o) => o.success === undefined));
});

test("a spawn of an attempt whose lease was lost is never sent: no outcome at all", async () => {
  const shard = await new FakeShard({ tasks: [jsonTask(51n, {}), jsonTask(52n, {})], lost: [51n] }).start();
  let lostReturned = false;
  const worker = tracked(new Worker({ endpoint: shard.url, pools: ["default"], logger: silent }, async (task, signal, ctx) => {
    if (task.id !== 51n) return "fine";
    await until(() => signal.aborted); // told lost by a heartbeat (every 100 ms)
    ctx.spawn("default", { late: true });
    lostReturned = true;
    return "too late";
  }));
  const run = worker.run();
  await until(() => lostReturned && shard.outcomes.some((o) => o.taskId === 52n));
  await new Promise((r) => setTimeout(r, 300)); // a few heartbeats more: room for a wrong outcome
  worker.stop();
  await run;
  shard.stop();
  assert.ok(shard.heartbeats.some((ids) => ids.includes(51n)));
  assert.deepEqual(shard.outcomes.map((o) => o.taskId), [52n]);
});

test("spawned tasks too large for one message fail the attempt, not retryable, and nothing is spawned", async () => {
  const outcomes = await runTasks([jsonTask(4n, {})], (_task, _signal, ctx) => {
    for (let i = 0; i < 5; i++) ctx.spawn("default", new Uint8Array(15 << 20));
    return "done";
  });
  const failure = outcomes.get(4n)?.failure;
  assert.ok(failure && !failure.retryable && failure.error.includes("5 spawned tasks"), failure?.error);
  assert.equal(outcomes.get(4n)?.success, undefined);
});

test("a spawn after the handler returned is a FailedPreconditionError, and its success carried none", async () => {
  let kept: TaskContext | undefined;
  const outcomes = await runTasks([jsonTask(3n, {})], (_task, _signal, ctx) => {
    kept = ctx;
    return "done";
  });
  assert.deepEqual(outcomes.get(3n)?.success?.spawn, []);
  assert.throws(() => kept!.spawn("default", {}), (err: unknown) => err instanceof FailedPreconditionError && err.message.includes("task 3"));
});

test("a spawn payload that is not JSON-serializable throws in the handler as submit does, and nothing is recorded", () => {
  const spawned: SubmitTaskRequest[] = [];
  const ctx = new Context(jsonTask(1n, {}), 8, () => {}, (request) => spawned.push(request));
  const circular: Record<string, unknown> = {};
  circular["self"] = circular;
  assert.throws(() => ctx.spawn("default", circular), InvalidArgumentError);
  assert.equal(spawned.length, 0);
  ctx.spawn("default", { big: 2n ** 64n - 1n }, { dependsOn: [{ id: 4n }, { key: "k" }] });
  assert.equal(spawned[0]!.payload.toString(), '{"big":"18446744073709551615"}');
  assert.deepEqual(spawned[0]!.dependsOn.map((r) => r.id ?? r.key), [4n, "k"]);
});
