"""`./dev release --dry-run`: builds every artifact of a release from this checkout into dist/
and proves each installs the way its ecosystem installs, outside the repository:

- names: every name the release publishes (PyPI, npm, crates.io, the Go module path) is free in
  its registry or already ours (release/names.py); one another project holds fails the run;
- python: the three wheels (`pip wheel --no-deps`), installed by pip into a fresh virtualenv;
  `cronoq-server` and `cronoq` from there say VERSION; that server (free loopback ports, a
  temporary SQLite store) serves every example below;
- npm: `npm pack` of sdk-ts, installed into a scratch project with TypeScript, which compiles
  the SDK's example against the package's types and runs it;
- rust: `cargo package` of sdk-rust, unpacked into a scratch directory, a path dependency of a
  scratch cargo project without a lock file (what a new project resolves) that builds, with
  warnings as errors, and runs the SDK's example;
- go: the module's files (as its tag serves them: tracked, no nested modules) required by a
  scratch module through `replace`, which builds and runs the SDK's example.

Each example submits three tasks (one succeeds, one after two failures, one fails for good),
works them with the SDK's worker and prints how each ended; the step checks those lines.

    python release/dry_run.py [--only npm,go] [--keep]

Exits 1 naming the step that failed; the scratch directory is kept then (and with --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from names import check as check_names
from names import published
from versions import ROOT, release_version, rust_crate_name

DIST = ROOT / "dist"
PY_PROJECTS = ["proto/python", "sdk-python", "server"]  # cronoq-api first: the others pin it
GO_MODULE = "github.com/cronoq/cronoq/sdk-go"
# What each example prints for its three tasks: double (1 attempt), flaky (3), broken (FAILED at 1).
EXPECTED_LINES = [r"SUCCEEDED after 1 attempt\(s\)", r"SUCCEEDED after 3 attempt\(s\)", r"FAILED after 1 attempt\(s\)"]
EXAMPLE_TIMEOUT_S = 120.0


class StepFailed(Exception):
    """A step could not build, install or run what it should; the message says what."""


@dataclass
class Context:
    version: str
    scratch: Path
    endpoint: str = ""  # the gRPC endpoint of the server started from the built wheel
    http: str = ""


def run(cmd: list[str], cwd: Path, timeout: float = 900, env: dict[str, str] | None = None) -> str:
    """Runs cmd; its output, or StepFailed with the command and the tail of its output."""
    shown = " ".join(cmd)
    print(f"    $ {shown}  (in {cwd})", flush=True)
    full_env = {**os.environ, **(env or {})}
    full_env.pop("PYTHONPATH", None)  # nothing of the checkout on sys.path
    full_env.pop("VIRTUAL_ENV", None)
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as err:
        raise StepFailed(f"{shown}: {err}") from None
    except subprocess.TimeoutExpired:
        raise StepFailed(f"{shown}: no end within {timeout:.0f}s") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
        raise StepFailed(f"{shown}: exit code {proc.returncode}\n{tail}")
    return proc.stdout


def check_example(name: str, output: str) -> None:
    """The example's three tasks ended as they should (see EXPECTED_LINES)."""
    for line in EXPECTED_LINES:
        if not re.search(rf"^task \d+: {line}", output, re.MULTILINE):
            raise StepFailed(f"{name}: no line 'task N: {line}' in its output:\n{output}")
    print(f"    {name}: the three tasks ended as expected", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- names --------------------------------------------------------------------------


def step_names(ctx: Context, stack: list[Callable[[], None]]) -> None:
    taken = check_names(published())
    if taken:
        raise StepFailed("\n".join(taken))


# -- python -------------------------------------------------------------------------


def step_python(ctx: Context, stack: list[Callable[[], None]]) -> None:
    venv = ctx.scratch / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=ctx.scratch)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    wheels = DIST / "python"
    run([*pip, "wheel", "--no-deps", "-w", str(wheels), *(str(ROOT / p) for p in PY_PROJECTS)], cwd=ctx.scratch)
    built = sorted(wheels.glob("*.whl"))
    names = [w.name for w in built]
    print(f"    built {', '.join(names)}", flush=True)
    for dist in ("cronoq_api", "cronoq_sdk", "cronoq_server"):
        if f"{dist}-{ctx.version}-py3-none-any.whl" not in names:
            raise StepFailed(f"no wheel {dist}-{ctx.version}-py3-none-any.whl among {names}")
    run([*pip, "install", "--quiet", *(str(w) for w in built)], cwd=ctx.scratch)
    for command, prog in (("cronoq-server", "cronoq-server"), ("cronoq", "cronoq")):
        said = run([str(venv / "bin" / command), "--version"], cwd=ctx.scratch).strip()
        if said != f"{prog} {ctx.version}":
            raise StepFailed(f"{command} --version says {said!r}, expected '{prog} {ctx.version}'")
    start_server(ctx, venv, stack)
    submitted = run(
        [str(venv / "bin" / "cronoq"), "submit", "--endpoint", ctx.endpoint, "--json-payload", '{"n": 1}', "--json"],
        cwd=ctx.scratch,
    )
    print(f"    cronoq submit: task {json.loads(submitted)['id']}", flush=True)
    example = ctx.scratch / "python-example" / "worker.py"
    example.parent.mkdir()
    shutil.copy(ROOT / "sdk-python" / "examples" / "worker.py", example)
    out = run(
        [str(venv / "bin" / "python"), str(example), "--endpoint", ctx.endpoint], example.parent, EXAMPLE_TIMEOUT_S
    )
    check_example("sdk-python/examples/worker.py", out)
    mapreduce = example.parent / "mapreduce.py"
    shutil.copy(ROOT / "sdk-python" / "examples" / "mapreduce.py", mapreduce)
    out = run(
        [str(venv / "bin" / "python"), str(mapreduce), "--endpoint", ctx.endpoint], example.parent, EXAMPLE_TIMEOUT_S
    )
    if not re.search(r"^sum of 100 children: 5050$", out, re.MULTILINE):
        raise StepFailed(f"sdk-python/examples/mapreduce.py: no line 'sum of 100 children: 5050' in:\n{out}")
    print("    sdk-python/examples/mapreduce.py: the join summed the 100 children", flush=True)


def start_server(ctx: Context, venv: Path, stack: list[Callable[[], None]]) -> None:
    """cronoq-server from the virtualenv, on free loopback ports with a temporary SQLite store."""
    grpc_port, http_port = free_port(), free_port()
    home = ctx.scratch / "server"
    home.mkdir()
    (home / "cronoq.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{grpc_port}"\nhttp_listen = "127.0.0.1:{http_port}"\n'
        f'[store]\npath = "{home / "cronoq.db"}"\n'
    )
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen(
        [str(venv / "bin" / "cronoq-server"), "--config", str(home / "cronoq.toml")],
        cwd=home,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()

    stack.append(stop)
    ctx.endpoint, ctx.http = f"http://127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise StepFailed(f"cronoq-server exited with {proc.returncode}:\n{(home / 'server.log').read_text()}")
        try:
            with urllib.request.urlopen(ctx.http + "/v1/info", timeout=1) as reply:
                info = json.load(reply)
            if info.get("role") == "ROLE_LEADER":
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise StepFailed(f"cronoq-server did not lead within 30 s:\n{(home / 'server.log').read_text()}")
        time.sleep(0.1)
    if info.get("version") != ctx.version:
        raise StepFailed(f"GetServerInfo says version {info.get('version')!r}, expected {ctx.version!r}")
    print(f"    cronoq-server {info['version']} from the wheel leads at {ctx.endpoint} (HTTP {ctx.http})", flush=True)


# -- npm ------------------------------------------------------------------------------


def step_npm(ctx: Context, stack: list[Callable[[], None]]) -> None:
    sdk = ROOT / "sdk-ts"
    manifest = json.loads((sdk / "package.json").read_text())
    out = DIST / "npm"
    out.mkdir(parents=True, exist_ok=True)
    packed = json.loads(run(["npm", "pack", "--json", "--pack-destination", str(out)], cwd=sdk))[0]
    tarball = out / packed["filename"]
    files = sorted(f["path"] for f in packed["files"])
    print(f"    built {tarball.relative_to(ROOT)} ({len(files)} files)", flush=True)
    if packed["version"] != ctx.version:
        raise StepFailed(f"npm pack made version {packed['version']}, expected {ctx.version}")
    for needed in ("dist/index.js", "dist/index.d.ts"):
        if needed not in files:
            raise StepFailed(f"{tarball.name} has no {needed} (pack must build: a prepack script); it has {files}")
    project = ctx.scratch / "npm-project"
    project.mkdir()
    (project / "package.json").write_text(json.dumps({"name": "release-check", "private": True, "type": "module"}))
    dev = manifest.get("devDependencies", {})
    tools = [f"typescript@{dev.get('typescript', 'latest')}", f"@types/node@{dev.get('@types/node', 'latest')}"]
    run(["npm", "install", "--no-audit", "--no-fund", str(tarball), *tools], cwd=project)
    examples = ["worker.ts", "mapreduce.ts"]
    for name in examples:
        example = (sdk / "examples" / name).read_text()
        if f'from "{manifest["name"]}"' not in example:
            raise StepFailed(f"sdk-ts/examples/{name} does not import {manifest['name']!r}, as an application does")
        (project / name).write_text(example)  # unchanged: it imports the package by its name
    tsconfig = {
        "compilerOptions": {
            "target": "ES2022",
            "module": "NodeNext",
            "moduleResolution": "NodeNext",
            "strict": True,
            "types": ["node"],
            "outDir": "out",
        },
        "files": examples,
    }
    (project / "tsconfig.json").write_text(json.dumps(tsconfig))
    run([str(project / "node_modules" / ".bin" / "tsc"), "-p", "."], cwd=project)  # the package's types, strict
    out_text = run(["node", "out/worker.js", "--endpoint", ctx.endpoint], project, EXAMPLE_TIMEOUT_S)
    check_example("sdk-ts/examples/worker.ts", out_text)
    out_text = run(["node", "out/mapreduce.js", "--endpoint", ctx.endpoint], project, EXAMPLE_TIMEOUT_S)
    if not re.search(r"^sum of 100 children: 5050$", out_text, re.MULTILINE):
        raise StepFailed(f"sdk-ts/examples/mapreduce.ts: no line 'sum of 100 children: 5050' in:\n{out_text}")
    print("    sdk-ts/examples/mapreduce.ts: the join summed the 100 children", flush=True)


# -- rust -----------------------------------------------------------------------------


def step_rust(ctx: Context, stack: list[Callable[[], None]]) -> None:
    sdk = ROOT / "sdk-rust"
    crate = rust_crate_name()
    cargo = tomllib.loads((sdk / "Cargo.toml").read_text())
    manifest = cargo["package"]
    lib = cargo.get("lib", {}).get("name", crate.replace("-", "_"))  # the name the example's `use` lines say
    # The scratch build below is the verification (from the packaged files alone): not twice.
    run(["cargo", "package", "--locked", "--allow-dirty", "--no-verify"], sdk)
    packaged = sdk / "target" / "package" / f"{crate}-{ctx.version}.crate"
    if not packaged.exists():
        raise StepFailed(f"cargo package made no {packaged.relative_to(ROOT)}")
    out = DIST / "cargo"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(packaged, out / packaged.name)
    print(f"    built dist/cargo/{packaged.name}", flush=True)
    unpacked = ctx.scratch / "crates"
    with tarfile.open(packaged) as tar:
        tar.extractall(unpacked, filter="data")
    project = ctx.scratch / "cargo-project"
    (project / "src").mkdir(parents=True)
    (project / "Cargo.toml").write_text(
        "[package]\n"
        'name = "release-check"\n'
        'version = "0.0.0"\n'
        f'edition = "{manifest["edition"]}"\n'
        "publish = false\n\n"
        "[dependencies]\n"
        f'{lib} = {{ package = "{crate}", path = "{unpacked / f"{crate}-{ctx.version}"}" }}\n'
        'tokio = { version = "1", features = ["macros", "rt-multi-thread", "signal"] }\n'
        'serde = { version = "1", features = ["derive"] }\n'
        'serde_json = "1"\n'
        'tracing-subscriber = "0.3"\n'
    )
    # No lock file: the newest versions the manifests admit, as a user's new project resolves them.
    shutil.copy(sdk / "examples" / "worker.rs", project / "src" / "main.rs")
    (project / "examples").mkdir()
    shutil.copy(sdk / "examples" / "mapreduce.rs", project / "examples" / "mapreduce.rs")
    # A warning in the SDK's code fails (cargo caps the lints of registry crates, not of a path dependency).
    env = {"CARGO_TARGET_DIR": str(project / "target"), "RUSTFLAGS": "-D warnings"}
    run(["cargo", "build", "--quiet", "--examples"], project, env=env)
    out_text = run(["cargo", "run", "--quiet", "--", ctx.endpoint, "default"], project, EXAMPLE_TIMEOUT_S, env)
    check_example("sdk-rust/examples/worker.rs", out_text)
    # The workflow example: 100 spawned map tasks (1 to 100) and the join that sums them.
    cmd = ["cargo", "run", "--quiet", "--example", "mapreduce", "--", ctx.endpoint, "default"]
    out_text = run(cmd, project, EXAMPLE_TIMEOUT_S, env)
    if not re.search(r"^sum of 100 map tasks: 5050$", out_text, re.MULTILINE):
        raise StepFailed(f"sdk-rust/examples/mapreduce.rs: no line 'sum of 100 map tasks: 5050' in:\n{out_text}")
    print("    sdk-rust/examples/mapreduce.rs: the join summed the 100 map tasks", flush=True)


# -- go -------------------------------------------------------------------------------


def step_go(ctx: Context, stack: list[Callable[[], None]]) -> None:
    sdk = ROOT / "sdk-go"
    module = ctx.scratch / "go-module"
    tracked = run(["git", "ls-files", "-z", "--", "."], cwd=sdk).split("\0")
    nested = {str(Path(f).parent) for f in tracked if f.endswith("/go.mod")}  # other modules: not in this one
    files = [f for f in tracked if f and not any(f == n or f.startswith(n + "/") for n in nested)]
    for name in files:
        (module / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(sdk / name, module / name)
    print(f"    the module {GO_MODULE} v{ctx.version}: {len(files)} tracked files", flush=True)
    go_directive = re.search(r"^go (\S+)$", (sdk / "go.mod").read_text(), re.MULTILINE)
    if go_directive is None:
        raise StepFailed("sdk-go/go.mod has no go directive")
    project = ctx.scratch / "go-project"
    project.mkdir()
    (project / "go.mod").write_text(
        "module example.com/releasecheck\n\n"
        f"go {go_directive.group(1)}\n\n"
        f"require {GO_MODULE} v{ctx.version}\n\n"
        f"replace {GO_MODULE} => {module}\n"
    )
    shutil.copy(sdk / "examples" / "worker" / "main.go", project / "main.go")
    (project / "mapreduce").mkdir()
    shutil.copy(sdk / "examples" / "mapreduce" / "main.go", project / "mapreduce" / "main.go")
    env = {"GOFLAGS": "-mod=mod", "GOWORK": "off"}
    run(["go", "mod", "tidy"], project, env=env)
    run(["go", "build", "-o", "example", "."], project, env=env)
    run(["go", "build", "-o", "mapreduce-example", "./mapreduce"], project, env=env)
    out_text = run(["./example", "-endpoint", ctx.endpoint, "-pool", "default"], project, EXAMPLE_TIMEOUT_S)
    check_example("sdk-go/examples/worker", out_text)
    # A workflow: the root spawns 100 map tasks (n squared, n = 1..100) and a join that sums them.
    out_text = run(["./mapreduce-example", "-endpoint", ctx.endpoint, "-pool", "default"], project, EXAMPLE_TIMEOUT_S)
    if not re.search(r"^sum of 100 children: 338350$", out_text, re.MULTILINE):
        raise StepFailed(f"sdk-go/examples/mapreduce: no line 'sum of 100 children: 338350' in its output:\n{out_text}")
    print("    sdk-go/examples/mapreduce: the join summed the 100 map tasks", flush=True)


STEPS: dict[str, Callable[[Context, list[Callable[[], None]]], None]] = {
    "names": step_names,  # first: a taken name fails the release before anything is built
    "python": step_python,  # it starts the server the others use
    "npm": step_npm,
    "rust": step_rust,
    "go": step_go,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", help=f"comma-separated steps of {','.join(STEPS)} (names and python always run: the server)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args(argv)
    always = ["names", "python"]
    wanted = [*always, *[s for s in (args.only or ",".join(STEPS)).split(",") if s and s not in always]]
    unknown = [s for s in wanted if s not in STEPS]
    if unknown:
        ap.error(f"--only: no step {unknown} (steps: {', '.join(STEPS)})")
    ctx = Context(release_version(), Path(tempfile.mkdtemp(prefix="cronoq-release-")))
    shutil.rmtree(DIST, ignore_errors=True)
    print(f"release --dry-run: version {ctx.version}, artifacts into {DIST}, scratch {ctx.scratch}", flush=True)
    cleanups: list[Callable[[], None]] = []
    timings: list[str] = []
    failed = ""
    started = time.monotonic()
    try:
        for name in wanted:
            print(f"== {name}", flush=True)
            t0 = time.monotonic()
            try:
                STEPS[name](ctx, cleanups)
            except StepFailed as err:
                failed = name
                print(f"release --dry-run: step {name} FAILED: {err}", file=sys.stderr, flush=True)
                break
            except Exception:  # a bug here, or an output not as expected: still named by its step
                failed = name
                traceback.print_exc()
                break
            timings.append(f"{name} {time.monotonic() - t0:.0f}s")
            print(f"   {name}: ok ({time.monotonic() - t0:.0f}s)", flush=True)
    finally:
        for cleanup in reversed(cleanups):
            cleanup()
    total = time.monotonic() - started
    if failed:
        print(f"release --dry-run: FAILED at step {failed} after {total:.0f}s; scratch kept in {ctx.scratch}")
        return 1
    if not args.keep:
        shutil.rmtree(ctx.scratch, ignore_errors=True)
    print(f"release --dry-run: every artifact of {ctx.version} installs and runs ({', '.join(timings)}; {total:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
