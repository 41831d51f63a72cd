// The package as an application gets it: built as npm pack builds it (tsconfig.build.json)
// into a scratch node_modules/cronoq with its package.json (its exports), then imported by name
// from a strict NodeNext TypeScript file that is compiled against its declarations and run.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { copyFileSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const SDK = fileURLToPath(new URL("..", import.meta.url));
const TSC = join(SDK, "node_modules", "typescript", "bin", "tsc");

const scratch = mkdtempSync(join(tmpdir(), "cronoq-ts-package-"));
after(() => rmSync(scratch, { recursive: true, force: true }));

/** Runs tsc with args; a compile error fails the test with tsc's output. */
function tsc(...args: string[]): void {
  try {
    execFileSync(process.execPath, [TSC, ...args], { cwd: scratch, encoding: "utf8", stdio: "pipe" });
  } catch (err) {
    const { stdout, stderr } = err as { stdout: string; stderr: string };
    assert.fail(`tsc ${args.join(" ")}:\n${stdout}${stderr}`);
  }
}

// Every read call's and schedule call's answer, typed by the names the entry exports.
const APPLICATION = `
import {
  Client,
  Role,
  roleToJSON,
  type GetServerInfoResponse,
  type GetSnapshotResponse,
  type ListSchedulesResponse,
  type ListWorkersResponse,
  type RegisteredWorker,
  type Schedule,
  type ScheduleSpec,
  type ShardSnapshot,
} from "cronoq";

export async function overview(client: Client): Promise<string[]> {
  const info: GetServerInfoResponse = await client.serverInfo();
  const snapshot: GetSnapshotResponse = await client.snapshot();
  const shards: ShardSnapshot[] = snapshot.shards;
  const schedules: ListSchedulesResponse = await client.listSchedules({ pool: "default" });
  const workers: ListWorkersResponse = await client.listWorkers();
  const first: RegisteredWorker | undefined = workers.workers[0];
  const spec: ScheduleSpec = { pool: "default", name: "nightly", cron: "0 3 * * *", payload: { full: true } };
  const put: Schedule = await client.putSchedule(spec);
  await client.deleteSchedule(put.pool, put.name);
  return [roleToJSON(info.role), ...shards.map((s) => s.shard), ...schedules.schedules.map((s: Schedule) => s.name), first?.name ?? ""];
}

console.log(roleToJSON(Role.ROLE_LEADER), typeof Client.prototype.putSchedule);
`;

test("an application imports the schedule and read calls' types by the package's name, and runs", () => {
  const pkg = join(scratch, "node_modules", "cronoq");
  mkdirSync(pkg, { recursive: true });
  copyFileSync(join(SDK, "package.json"), join(pkg, "package.json"));
  symlinkSync(join(SDK, "node_modules"), join(pkg, "node_modules")); // its dependencies, as npm installs them
  tsc("-p", join(SDK, "tsconfig.build.json"), "--outDir", join(pkg, "dist"));

  writeFileSync(join(scratch, "package.json"), JSON.stringify({ name: "application", private: true, type: "module" }));
  writeFileSync(join(scratch, "app.ts"), APPLICATION);
  writeFileSync(join(scratch, "tsconfig.json"), JSON.stringify({
    compilerOptions: {
      target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", strict: true,
      types: ["node"], typeRoots: [join(SDK, "node_modules", "@types")], outDir: "out",
    },
    files: ["app.ts"],
  }));
  tsc("-p", scratch);
  const printed = execFileSync(process.execPath, [join(scratch, "out", "app.js")], { cwd: scratch, encoding: "utf8" });
  assert.equal(printed.trim(), "ROLE_LEADER function");
});
