// A map-reduce workflow against a cronoq server: a "split" task spawns 100 "map" tasks (each
// returns a number) and a "sum" task that depends on all of them and returns their sum. It
// submits the split task, runs a worker until the sum ends, prints the sum and exits.
//
//   npx tsx examples/mapreduce.ts --endpoint http://127.0.0.1:7070 --pool default   (in sdk-ts)
//
// It imports "cronoq" as an application does: in sdk-ts, tsconfig.json's `paths` maps it to src/.
// The endpoint and token also come from CRONOQ_ENDPOINT and CRONOQ_TOKEN.
import { randomUUID } from "node:crypto";
import { parseArgs } from "node:util";
import { Client, decodePayload, decodeResult, TaskState, taskStateToJSON, Worker, type Task, type TaskContext } from "cronoq";

const MAPS = 100;

type Job = { step: "split"; run: string } | { step: "map"; n: number } | { step: "sum" };

/** The keys of one run's tasks: a spawned task depends on its siblings by key. */
const mapKey = (run: string, n: number) => `${run}-map-${n}`;
const sumKey = (run: string) => `${run}-sum`;

/** split spawns the maps and the sum (sent with its success: all or none); map returns n; sum adds its dependencies' results. */
function handler(pool: string) {
  return (task: Task, _signal: AbortSignal, ctx: TaskContext): unknown => {
    const job = decodePayload(task) as Job;
    switch (job.step) {
      case "split": {
        const maps: string[] = [];
        for (let n = 1; n <= MAPS; n++) {
          ctx.spawn(pool, { step: "map", n }, { key: mapKey(job.run, n) });
          maps.push(mapKey(job.run, n));
        }
        ctx.spawn(pool, { step: "sum" }, { key: sumKey(job.run), dependsOn: maps });
        return { spawned: MAPS + 1 };
      }
      case "map":
        return job.n;
      case "sum":
        return [...ctx.dependencyResults.values()].reduce((sum: number, value) => sum + (value as number), 0);
    }
  };
}

async function main(): Promise<number> {
  const { values } = parseArgs({
    options: {
      endpoint: { type: "string", default: process.env.CRONOQ_ENDPOINT ?? "http://127.0.0.1:7070" },
      pool: { type: "string", default: "default" },
    },
  });
  const pool = values.pool!;
  const opts = { endpoint: values.endpoint!, token: process.env.CRONOQ_TOKEN };
  const client = new Client(opts);
  const run = `mapreduce-${randomUUID()}`; // a key names one task in a shard: a fresh prefix each run
  const { task: split } = await client.submit({ pool, payload: { step: "split", run } });
  console.log(`submitted split task ${split.id}`);

  const worker = new Worker({ ...opts, pools: [pool], concurrency: 16 }, handler(pool));
  process.once("SIGINT", () => worker.stop());
  const running = worker.run();
  try {
    const splitDone = await client.wait(split.id, 60_000); // the sum exists once the split has succeeded
    if (splitDone.task.state !== TaskState.TASK_STATE_SUCCEEDED) {
      console.error(`split task ${split.id}: ${taskStateToJSON(splitDone.task.state)} ${splitDone.task.error}`);
      return 1;
    }
    const { children } = await client.get(split.id, { includeChildren: true });
    console.log(`split task ${split.id} spawned ${children.length} tasks`);
    const { task: sum, done } = await client.wait({ key: sumKey(run) }, 120_000);
    if (!done || sum.state !== TaskState.TASK_STATE_SUCCEEDED) {
      console.error(`sum task ${sum.id}: ${taskStateToJSON(sum.state)} ${sum.error}`);
      return 1;
    }
    console.log(`sum of ${MAPS} children: ${JSON.stringify(decodeResult(sum))}`);
    return 0;
  } finally {
    worker.stop();
    await running;
    client.close();
  }
}

main().then((code) => process.exit(code), (err: unknown) => {
  console.error("example:", err);
  process.exit(1);
});
