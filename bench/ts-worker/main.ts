// The TypeScript SDK's side of the burn-down: one TS worker drains N no-op tasks that
// bench/burndown.py --worker ts submitted, and prints one JSON line. Timed from the worker's
// start to the last task's start, as the Python worker and the anchors time it.
//
//   node --import tsx bench/ts-worker/main.ts --endpoint URL [--tasks 20000] [--concurrency 64] [--prefetch N]
//
// Without --prefetch the worker takes the SDK's default prefetch (4 tasks a slot).
//
// (from sdk-ts, after `npm ci` there: tsx is one of its dev dependencies)
import { parseArgs } from "node:util";
import { Worker, type Logger } from "../../sdk-ts/src/index.js";

const quiet: Logger = { debug() {}, info() {}, warn() {}, error: (m, f) => console.error(m, f ?? "") };

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      endpoint: { type: "string", default: "" },
      tasks: { type: "string", default: "20000" },
      concurrency: { type: "string", default: "64" },
      prefetch: { type: "string" },
    },
  });
  if (!values.endpoint) throw new Error("--endpoint is required");
  const total = Number(values.tasks);
  let handled = 0;
  let allHandled: () => void = () => {};
  const done = new Promise<void>((resolve) => {
    allHandled = resolve;
  });
  const worker = new Worker(
    {
      endpoint: values.endpoint,
      logger: quiet,
      pools: ["default"],
      concurrency: Number(values.concurrency),
      prefetch: values.prefetch === undefined ? undefined : Number(values.prefetch),
    },
    () => {
      if (++handled === total) allHandled();
      return undefined;
    },
  );
  const started = performance.now();
  const run = worker.run();
  const outcome = await Promise.race([done.then(() => "done"), run.then(() => "stopped", (err: unknown) => err)]);
  if (outcome !== "done") throw new Error(`the worker stopped after ${handled} tasks: ${String(outcome)}`);
  const drained = (performance.now() - started) / 1000;
  worker.stop();
  await run;
  console.log(JSON.stringify({ tasks: total, drain_s: drained }));
}

main().catch((err: unknown) => {
  console.error("ts-worker bench:", err);
  process.exit(1);
});
