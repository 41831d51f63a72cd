// A TypeScript worker and client against a cronoq server: it submits a few tasks to a pool,
// runs a worker for them, waits for each and prints how it ended; Ctrl-C stops it gracefully.
//
//   npx tsx examples/worker.ts --endpoint http://127.0.0.1:7070 --pool default   (in sdk-ts)
//
// It imports "cronoq" as an application does: in sdk-ts, tsconfig.json's `paths` maps it to src/.
// The endpoint and token also come from CRONOQ_ENDPOINT and CRONOQ_TOKEN.
import { parseArgs } from "node:util";
import { Client, decodePayload, decodeResult, nonRetryable, retryAfter, TaskState, taskStateToJSON, Worker, type Task } from "cronoq";

interface Job {
  kind: "double" | "flaky" | "broken";
  n: number;
}

/** Doubles n; "broken" fails for good, "flaky" fails its first two attempts. */
async function handle(task: Task, signal: AbortSignal): Promise<unknown> {
  const job = decodePayload(task) as Job;
  if (job.kind === "broken") throw nonRetryable("broken input: will not retry");
  if (job.kind === "flaky" && task.attempt < 3) throw retryAfter(`flaky failure on attempt ${task.attempt}`, 200);
  await new Promise((resolve, reject) => { // some work, given up when the task is cancelled
    const timer = setTimeout(resolve, 50);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(signal.reason);
    }, { once: true });
  });
  return { doubled: job.n * 2 };
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      endpoint: { type: "string", default: process.env.CRONOQ_ENDPOINT ?? "http://127.0.0.1:7070" },
      pool: { type: "string", default: "default" },
    },
  });
  const opts = { endpoint: values.endpoint!, token: process.env.CRONOQ_TOKEN };
  const client = new Client(opts);
  const ids: bigint[] = [];
  for (const job of [{ kind: "double", n: 21 }, { kind: "flaky", n: 4 }, { kind: "broken", n: 0 }]) {
    const { task } = await client.submit({ pool: values.pool!, payload: job, maxAttempts: 5 });
    console.log(`submitted task ${task.id} (${job.kind})`);
    ids.push(task.id);
  }

  const worker = new Worker({ ...opts, pools: [values.pool!], concurrency: 8 }, handle);
  process.once("SIGINT", () => worker.stop());
  const running = worker.run();
  for (const id of ids) {
    const { task, done } = await client.wait(id, 30_000);
    const state = taskStateToJSON(task.state).replace("TASK_STATE_", "");
    if (!done) console.log(`task ${id}: still ${state}`);
    else if (task.state === TaskState.TASK_STATE_SUCCEEDED) console.log(`task ${id}: ${state} after ${task.attempt} attempt(s): ${JSON.stringify(decodeResult(task))}`);
    else console.log(`task ${id}: ${state} after ${task.attempt} attempt(s): ${task.error}`);
  }
  worker.stop();
  await running;
  client.close();
}

main().catch((err: unknown) => {
  console.error("example:", err);
  process.exit(1);
});
