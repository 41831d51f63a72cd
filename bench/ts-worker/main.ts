// The TypeScript SDK's burn-down: N no-op tasks submitted in batches with the TS client, then
// drained by one TS worker. Prints one JSON line. Not run by ./dev bench (yet).
//
//   cd sdk-ts && npm ci && npx tsx ../bench/ts-worker/main.ts [--tasks 20000] [--concurrency 64] [--batch 500] [--endpoint URL]
//
// Without --endpoint it starts its own cronoq-server (from PATH, or --server) on SQLite in a
// temporary directory, as bench/burndown.py does; run it where ./dev installed the server,
// e.g. with PATH=.nox/bench/bin:$PATH.
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { Client, Worker, type Logger, type TaskSpec } from "../../sdk-ts/src/index.js";

const quiet: Logger = { debug() {}, info() {}, warn() {}, error: (m, f) => console.error(m, f ?? "") };

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      server.close(() => (address && typeof address === "object" ? resolve(address.port) : reject(new Error("no port"))));
    });
  });
}

/** Starts a cronoq-server on SQLite in a temporary directory and waits until it leads. */
async function startServer(command: string): Promise<{ endpoint: string; stop: () => Promise<void> }> {
  const dir = mkdtempSync(join(tmpdir(), "cronoq-ts-bench-"));
  const [grpcPort, httpPort] = [await freePort(), await freePort()];
  const config = join(dir, "cronoq.toml");
  writeFileSync(config, `[server]\nlisten = "127.0.0.1:${grpcPort}"\nhttp_listen = "127.0.0.1:${httpPort}"\n` +
    `[store]\npath = ${JSON.stringify(join(dir, "cronoq.db"))}\n[[pools]]\nname = "default"\n`);
  const proc: ChildProcess = spawn(command, ["--config", config], { stdio: ["ignore", "inherit", "inherit"] });
  const exited = new Promise<void>((resolve) => proc.once("exit", () => resolve()));
  const stop = async () => {
    proc.kill("SIGTERM");
    await exited;
    rmSync(dir, { recursive: true, force: true });
  };
  const deadline = Date.now() + 15_000;
  for (;;) {
    try {
      const resp = await fetch(`http://127.0.0.1:${httpPort}/readyz`);
      if (resp.ok) return { endpoint: `http://127.0.0.1:${grpcPort}`, stop };
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline || proc.exitCode !== null) {
      await stop();
      throw new Error(`${command} did not become ready in 15 s`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      tasks: { type: "string", default: "20000" },
      concurrency: { type: "string", default: "64" },
      batch: { type: "string", default: "500" },
      endpoint: { type: "string", default: "" },
      server: { type: "string", default: "cronoq-server" },
    },
  });
  const total = Number(values.tasks);
  const concurrency = Number(values.concurrency);
  const batch = Number(values.batch);
  let endpoint = values.endpoint!;
  let stopServer: (() => Promise<void>) | undefined;
  if (!endpoint) ({ endpoint, stop: stopServer } = await startServer(values.server!));
  try {
    const opts = { endpoint, logger: quiet };
    const client = new Client(opts);
    const submitStarted = performance.now();
    for (let i = 0; i < total; i += batch) {
      const specs: TaskSpec[] = Array.from({ length: Math.min(batch, total - i) }, () => ({ pool: "default" }));
      await client.submitBatch(specs);
    }
    const submitted = (performance.now() - submitStarted) / 1000;
    client.close();

    let handled = 0;
    let allHandled: () => void = () => {};
    const done = new Promise<void>((resolve) => {
      allHandled = resolve;
    });
    const worker = new Worker({ ...opts, pools: ["default"], concurrency }, () => {
      if (++handled === total) allHandled();
      return undefined;
    });
    const drainStarted = performance.now();
    const run = worker.run();
    const outcome = await Promise.race([done.then(() => "done"), run.then(() => "stopped", (err: unknown) => err)]);
    if (outcome !== "done") throw new Error(`the worker stopped after ${handled} tasks: ${String(outcome)}`);
    const drained = (performance.now() - drainStarted) / 1000;
    worker.stop();
    await run;
    console.log(JSON.stringify({
      tasks: total,
      concurrency,
      submit_tasks_per_s: Math.floor(total / submitted),
      drain_tasks_per_s: Math.floor(total / drained),
      drain_seconds: drained,
      outcomes_acknowledged: worker.processed,
    }));
  } finally {
    await stopServer?.();
  }
}

main().catch((err: unknown) => {
  console.error("ts-worker bench:", err);
  process.exit(1);
});
