"""The TypeScript SDK as npm users get it: `npm pack` in sdk-ts builds the package (prepack)
and the tarball installs into a project outside the repository, where it imports (ESM),
type-checks (its .d.ts resolve) and runs the SDK's example against a server. It ships dist
(JavaScript and types, no source maps: nothing they could point at is shipped), README,
LICENSE (the repository's) and package.json only."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from conftest import ServerProcess  # type: ignore[import-not-found]
from preconditions import missing  # type: ignore[import-not-found]

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
TS_SDK = REPO / "sdk-ts"
TSC = TS_SDK / "node_modules" / ".bin" / "tsc"
NPM_FLAGS = ["--no-audit", "--no-fund", "--prefer-offline"]
# What the package's root holds besides dist/ (npm adds README and LICENSE itself).
TOP_LEVEL = {"package.json", "README.md", "LICENSE"}

# The scratch project's program: the public API, named as the README uses it.
APP_TS = """\
import { Client, Worker, TaskState, decodePayload, nonRetryable, type Task } from "cronoq";
import { enqueue, type Queryable } from "cronoq/outbox";

const client: Client = new Client({ endpoint: "http://127.0.0.1:7070" });
const state: TaskState = TaskState.TASK_STATE_PENDING;
const worker = new Worker({ endpoint: "http://127.0.0.1:7070", pools: ["default"], concurrency: 2 },
  async (task: Task, signal: AbortSignal) => {
    if (signal.aborted) throw nonRetryable("stopped");
    return { id: task.id.toString(), input: decodePayload(task), state };
  });
// @ts-expect-error the types are real: an endpoint is a string
new Client({ endpoint: 7070 });
client.close();
void worker;
// The outbox takes any client with query(text, values): its types need no `pg` installed.
const db: Queryable = { query: async () => ({ rows: [{ id: "1" }] }) };
const outboxId: Promise<bigint> = enqueue(db, "default", { n: 1 }, { key: "k" });
void outboxId;
"""

APP_TSCONFIG = {
    "compilerOptions": {
        "target": "ES2022",
        "module": "NodeNext",
        "moduleResolution": "NodeNext",
        "strict": True,
        "types": ["node"],
        "outDir": "out",
    },
    "files": ["app.ts", "example.ts"],
}

# The package's exports at run time, imported as ESM from the installed tarball.
APP_MJS = """\
import * as cronoq from "cronoq";
import assert from "node:assert/strict";
for (const name of ["Client", "Worker", "TaskFailure", "decodePayload", "encodePayload"]) {
  assert.equal(typeof cronoq[name], "function", name);
}
assert.equal(cronoq.TaskState.TASK_STATE_SUCCEEDED, 4);
const client = new cronoq.Client({ endpoint: "http://127.0.0.1:7070" });
client.close();
// The outbox runs without `pg` installed (an optional peer dependency): it uses the client it is given.
const outbox = await import("cronoq/outbox");
const sent = [];
const id = await outbox.enqueue({ query: async (text, values) => (sent.push(values), { rows: [{ id: "7" }] }) }, "default", { n: 1 });
assert.equal(id, 7n);
assert.deepEqual(sent[0][0], ["default"]);
await assert.rejects(import("pg"), { code: "ERR_MODULE_NOT_FOUND" });
console.log("imported");
"""


def run(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(args)} (in {cwd}) exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """`npm pack` in sdk-ts (its prepack builds dist): the tarball and the paths it holds."""
    if shutil.which("npm") is None:
        missing("npm is not installed")
    if not TSC.exists():
        run(["npm", "ci", *NPM_FLAGS], TS_SDK)
    out = tmp_path_factory.mktemp("npm-pack")
    (info,) = json.loads(run(["npm", "pack", "--json", "--pack-destination", str(out)], TS_SDK))
    return out / info["filename"], sorted(f["path"] for f in info["files"])


def tarball_text(tarball: Path, path: str) -> str:
    with tarfile.open(tarball) as tar:
        member = tar.extractfile(f"package/{path}")
        assert member is not None, path
        return member.read().decode()


def test_pack_ships_dist_with_types_license_and_readme(packed: tuple[Path, list[str]]) -> None:
    tarball, files = packed
    version = json.loads((TS_SDK / "package.json").read_text())["version"]
    assert tarball.name == f"cronoq-{version}.tgz"
    assert TOP_LEVEL | {"dist/index.js", "dist/index.d.ts", "dist/client.js", "dist/worker.js"} <= set(files), files
    assert set(files) - TOP_LEVEL == {f for f in files if f.startswith("dist/")}, f"outside dist/: {files}"
    js = {f.removesuffix(".js") for f in files if f.endswith(".js")}
    dts = {f.removesuffix(".d.ts") for f in files if f.endswith(".d.ts")}
    assert js == dts, f"JavaScript without types or types without JavaScript: {sorted(js ^ dts)}"
    assert set(files) - TOP_LEVEL == {f"{m}.js" for m in js} | {f"{m}.d.ts" for m in dts}, files
    # Only the code the SDK imports: not the method options the server reads, nor descriptor.proto's types.
    unused = re.compile(r"gen/google/protobuf/descriptor|gen/cronoq/v1/options")
    assert not [f for f in files if unused.search(f)], files
    assert not [p for p in (TS_SDK / "src" / "gen").rglob("*") if unused.search(p.as_posix())]
    # No source maps, and no comment pointing at one.
    assert not [f for f in js if "sourceMappingURL" in tarball_text(tarball, f"{f}.js")]
    assert tarball_text(tarball, "LICENSE") == (REPO / "LICENSE").read_text()
    assert not (TS_SDK / "LICENSE").exists(), "npm pack left its copy of LICENSE in sdk-ts (postpack removes it)"


def test_package_json_declares_license_repository_engines_exports(packed: tuple[Path, list[str]]) -> None:
    meta = json.loads(tarball_text(packed[0], "package.json"))
    assert meta["name"] == "cronoq" and meta["type"] == "module"
    assert meta["license"] == "Apache-2.0"
    assert meta["repository"] == {
        "type": "git",
        "url": "git+https://github.com/cronoq/cronoq.git",
        "directory": "sdk-ts",
    }
    assert meta["engines"] == {"node": ">=20"}
    assert meta["exports"] == {
        ".": {"types": "./dist/index.d.ts", "import": "./dist/index.js"},
        "./outbox": {"types": "./dist/outbox.d.ts", "import": "./dist/outbox.js"},
    }
    assert meta["peerDependenciesMeta"]["pg"] == {"optional": True}
    assert "pg" not in meta["dependencies"], meta["dependencies"]
    assert re.fullmatch(r"\^1\.\d+\.\d+", meta["dependencies"]["@grpc/grpc-js"]), meta["dependencies"]
    assert all(v.startswith("^") for v in meta["dependencies"].values()), meta["dependencies"]


def test_tarball_installs_imports_type_checks_and_runs_the_example_outside_the_repository(
    packed: tuple[Path, list[str]], tmp_path: Path, server: ServerProcess
) -> None:
    app = tmp_path / "app"
    app.mkdir()
    assert REPO not in app.parents
    (app / "package.json").write_text(json.dumps({"name": "app", "private": True, "type": "module"}))
    run(["npm", "install", *NPM_FLAGS, str(packed[0])], app)  # as the README says: nothing else
    (app / "app.mjs").write_text(APP_MJS)
    assert run(["node", "app.mjs"], app).strip() == "imported"
    (app / "app.ts").write_text(APP_TS)
    # The SDK's example imports "cronoq", as an application does: it compiles and runs here unchanged.
    shutil.copy(TS_SDK / "examples" / "worker.ts", app / "example.ts")
    (app / "tsconfig.json").write_text(json.dumps(APP_TSCONFIG))
    run([str(TSC), "-p", str(app)], app)
    printed = run(["node", "out/example.js", "--endpoint", server.endpoint, "--pool", "default"], app)
    assert re.search(r"SUCCEEDED after 1 attempt\(s\): \{\"doubled\":42\}", printed), printed
    assert re.search(r"SUCCEEDED after 3 attempt\(s\): \{\"doubled\":8\}", printed), printed
    assert re.search(r"FAILED after 1 attempt\(s\): broken input", printed), printed
