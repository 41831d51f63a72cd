"""The conformance runner: every case of conformance/cases/ against every SDK's driver.

    python conformance/runner.py [--sdk python] [--case NAME] [--verbose]

For each case it starts the scripted servers the case's roles need (conformance/scripted.py:
on loopback, and in a network namespace for roles on another host) or real cronoq-server
processes (`deployment`; "outbox" also a real PostgreSQL as the application's database),
hands the driver the case's input, then compares what the driver
observed and what the servers recorded with the case's `expect`. Prints a table case × SDK
and exits 1 on any failure. The case format and the driver protocol: conformance/README.md.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import ServerProcess  # type: ignore[import-not-found]  # noqa: E402
from netns import NetNs  # type: ignore[import-not-found]  # noqa: E402
from pgserver import TempPostgres, start_temp_postgres  # type: ignore[import-not-found]  # noqa: E402
from ports import free_port  # type: ignore[import-not-found]  # noqa: E402
from tls_pki import Pki  # type: ignore[import-not-found]  # noqa: E402

# How each SDK's driver is started (from the repository's root).
GO_DRIVER = ROOT / "sdk-go" / "bin" / "conformance-driver"  # gitignored: built by BUILDS
TS_DRIVER = ROOT / "sdk-ts" / "bin" / "conformance" / "driver.js"  # gitignored: built by BUILDS
RUST_DRIVER = ROOT / "sdk-rust" / "target" / "release" / "examples" / "conformance_driver"  # gitignored: BUILDS
DRIVERS: dict[str, list[str]] = {
    "python": [sys.executable, str(HERE / "drivers" / "python" / "driver.py")],
    "go": [str(GO_DRIVER)],
    "ts": ["node", str(TS_DRIVER)],
    "rust": [str(RUST_DRIVER)],
}
# What builds an SDK's driver, run once per run before its cases (from the repository's root).
BUILDS: dict[str, list[str]] = {
    "go": ["go", "-C", "sdk-go", "build", "-o", str(GO_DRIVER), "./cmd/conformance-driver"],
    "ts": [
        "sh",
        "-c",
        "npm --prefix sdk-ts ci --no-audit --no-fund && sdk-ts/node_modules/.bin/tsc -p sdk-ts/tsconfig.driver.json",
    ],
    "rust": [
        "cargo",
        "build",
        "--release",
        "--locked",
        "--features",
        "otel,outbox",  # the driver's submit step runs in a trace context; outbox_enqueue uses tokio-postgres
        "--manifest-path",
        "sdk-rust/Cargo.toml",
        "--example",
        "conformance_driver",
    ],
}
TOKEN = "conformance-token"
CLIENT_SUBJECT = "CN=conformance-worker"
REMOTE_PORTS = iter(range(31000, 32000))  # in the namespace nothing else listens
CASE_TIMEOUT_S = 60.0
VERSION = (ROOT / "VERSION").read_text().strip()  # every SDK's user-agent names it: cronoq-<sdk>/VERSION


@dataclass
class Pkis:
    trusted: Pki
    unknown: Pki
    hosts: tuple[str, ...]
    client: Any = None
    servers: dict[str, Any] = field(default_factory=dict)

    def server(self, unknown_ca: bool) -> Any:
        key = "unknown" if unknown_ca else "trusted"
        if key not in self.servers:
            self.servers[key] = (self.unknown if unknown_ca else self.trusted).server(*self.hosts)
        return self.servers[key]


def load_cases() -> list[dict[str, Any]]:
    cases = []
    for path in sorted((HERE / "cases").glob("*.json")):
        area = json.loads(path.read_text())
        for case in area["cases"]:
            cases.append({**case, "area": path.stem})
    names = [c["name"] for c in cases]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise SystemExit(f"conformance: case names used twice: {sorted(dupes)}")
    return cases


def substitute(value: Any, urls: dict[str, str]) -> Any:
    """Every "{role}" in the case's strings becomes that role's URL ("{role.port}": its port)."""
    if isinstance(value, str):
        for name, url in urls.items():
            value = value.replace("{" + name + "}", url)
        return value
    if isinstance(value, list):
        return [substitute(v, urls) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, urls) for k, v in value.items()}
    return value


def task_json(task: dict[str, Any]) -> dict[str, Any]:
    """A role's task as proto JSON: `payload_json` becomes a JSON payload."""
    out = {"state": "TASK_STATE_RUNNING", "attempt": 1, "pool": "default", **task}
    if "payload_json" in out:
        out["payload"] = base64.b64encode(json.dumps(out.pop("payload_json")).encode()).decode()
        out["content_type"] = "application/json"
    return out


def terminate(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM to each process still running, then each waited for grace seconds (killed after)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Scripted:
    """The scripted server processes of one case (one per network namespace used)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self, plan: list[dict[str, Any]], where: str, netns: NetNs | None) -> None:
        plan_path, log = self.workdir / f"plan-{where}.json", self.workdir / f"log-{where}.jsonl"
        plan_path.write_text(json.dumps(plan))
        cmd = [sys.executable, str(HERE / "scripted.py"), str(plan_path), str(log)]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns.name, *cmd]
        stderr = open(self.workdir / f"scripted-{where}.stderr", "ab")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        )
        self.procs.append(proc)
        self.logs.append(log)
        deadline = time.monotonic() + 15
        while not (log.exists() and '"ready"' in log.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = (self.workdir / f"scripted-{where}.stderr").read_text(errors="replace")
                raise RuntimeError(f"scripted server ({where}) did not start: {err[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> list[dict[str, Any]]:
        terminate(self.procs, 10)
        entries = []
        for log in self.logs:
            if log.exists():
                entries += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        return sorted((e for e in entries if "role" in e), key=lambda e: e["t"])


@contextmanager
def two_shards(workdir: Path) -> Iterator[dict[str, str]]:
    """A real deployment: shards cpu (pool default) and gpu (pool llm), one server each."""
    ports = {name: free_port() for name in ("cpu", "gpu")}
    config: dict[str, Any] = {
        "pools": [{"name": "default"}, {"name": "llm"}],
        "shards": [
            {"name": "cpu", "number": 1, "pools": ["default"], "endpoint": f"http://127.0.0.1:{ports['cpu']}"},
            {"name": "gpu", "number": 2, "pools": ["llm"], "endpoint": f"http://127.0.0.1:{ports['gpu']}"},
        ],
        "store": {"path": str(workdir / "cronoq-{shard}.db")},
        "tokens": [
            {
                "name": "conformance",
                "sha256": hashlib.sha256(TOKEN.encode()).hexdigest(),
                "pools": ["*"],
                "permissions": ["submit", "read", "cancel", "work", "schedule", "admin"],
            }
        ],
    }
    servers = [
        ServerProcess(workdir, {**config, "server": {"listen": f"127.0.0.1:{ports[n]}"}}, n, n) for n in ("cpu", "gpu")
    ]
    try:
        for server in servers:
            server.start()
        yield {s.name: s.endpoint for s in servers}
    finally:
        for server in servers:
            if server.proc is not None:
                server.stop()


@contextmanager
def outbox_deployment(workdir: Path, postgres: TempPostgres) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """One real server (pool default, SQLite store) relaying the outbox of a fresh schema of the
    run's PostgreSQL, the application's database; yields its URL and the driver's database input."""
    schema = f"conformance_{uuid.uuid4().hex[:10]}"  # a fresh outbox per case: nothing left from another
    install = [sys.executable, "-m", "cronoq.cli", "outbox", "install", "--url", postgres.url, "--schema", schema]
    subprocess.run(install, capture_output=True, text=True, timeout=60, check=True)
    config: dict[str, Any] = {
        "pools": [{"name": "default"}],
        "store": {"path": str(workdir / "cronoq.db")},
        "tokens": [
            {
                "name": "conformance",
                "sha256": hashlib.sha256(TOKEN.encode()).hexdigest(),
                "pools": ["*"],
                "permissions": ["submit", "read", "cancel", "work", "schedule", "admin"],
            }
        ],
        "outboxes": [{"url": postgres.url, "schema": schema, "pools": ["default"], "notify": True}],
    }
    server = ServerProcess(workdir, config, None, "server")
    try:
        server.start()
        yield {"server": server.endpoint}, {"database_url": postgres.url, "outbox_schema": schema}
    finally:
        if server.proc is not None:
            server.stop()


@contextmanager
def fast_worker(endpoint: str, pool: str, workdir: Path) -> Iterator[Callable[[], int | None]]:
    """A Python-SDK worker beside the driver's, whose handlers return at once
    (conformance/fast_worker.py). Yields what stops it gracefully and answers how many tasks
    it ran (None: it failed); stopped on the way out too."""
    count_file = workdir / "fast-worker.count"
    stderr = open(workdir / "fast-worker.stderr", "ab")
    cmd = [sys.executable, str(HERE / "fast_worker.py"), endpoint, TOKEN, pool, str(count_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)

    def stop() -> int | None:
        terminate([proc], 15)
        return int(count_file.read_text()) if count_file.exists() else None

    try:
        yield stop
    finally:
        stop()


# -- expectations ------------------------------------------------------------


def match(expected: Any, actual: Any, path: str) -> list[str]:
    """Where actual differs from expected: a dict names only the keys it checks; `x_count`
    checks the length of list x; `x_has` lists phrases the text x contains (`message_has`)."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{path}: expected an object, got {actual!r}"]
        problems = []
        for key, want in expected.items():
            if key.endswith("_has") and key not in actual:
                name = key[: -len("_has")]
                text = str(actual.get(name) or "").lower()
                problems += [f"{path}.{name}: {actual.get(name)!r} lacks {p!r}" for p in want if p.lower() not in text]
            elif key.endswith("_count") and key not in actual:
                got = len(actual.get(key[: -len("_count")]) or [])
                if got != want:
                    problems.append(f"{path}.{key[:-6]}: {got} entries, expected {want}")
            else:
                problems += match(want, actual.get(key), f"{path}.{key}")
        return problems
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [f"{path}: expected {expected!r}, got {actual!r}"]
        return [p for i, (w, a) in enumerate(zip(expected, actual, strict=True)) for p in match(w, a, f"{path}[{i}]")]
    if expected != actual:
        return [f"{path}: expected {expected!r}, got {actual!r}"]
    return []


def step_values(observed: dict[str, Any]) -> dict[str, str]:
    """What `{steps.N.field}` in a case's expect stands for: the driver's result of step N's
    text field (e.g. the id a submit answered, which a later step's parent_id must equal)."""
    steps = observed.get("steps") or []
    return {
        f"steps.{i}.{name}": value
        for i, step in enumerate(steps if isinstance(steps, list) else [])
        if isinstance(step, dict)
        for name, value in step.items()
        if isinstance(value, str)
    }


def lookup(obj: Any, dotted: str) -> Any:
    """The value at a dotted path of proto JSON: a number indexes a list (`outcomes.0.snoozed`)."""
    for part in dotted.split("."):
        if isinstance(obj, list) and part.isdigit():
            obj = obj[int(part)] if int(part) < len(obj) else None
        else:
            obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def check_reports(task_id: str, want: dict[str, Any], calls: list[dict[str, Any]]) -> list[str]:
    """A task's reports (TaskReport), in heartbeats and with outcomes, as expected: the last
    progress and checkpoint sent (a checkpoint as UTF-8 text), and whether a heartbeat carried one."""
    last: dict[str, Any] = {}
    in_heartbeat = False
    for c in calls:
        request = c["request"] or {}
        beats = (request.get("heartbeat") or {}).get("reports", []) + (
            request.get("reports", []) if c["method"] == "Heartbeat" else []
        )
        with_outcomes = [o["report"] for o in request.get("outcomes", []) if "report" in o]
        for report in beats + with_outcomes:
            if report.get("task_id") != task_id:
                continue
            in_heartbeat |= report in beats
            if "progress" in report:
                p = report["progress"]
                last["progress"] = {"value": p.get("value", 0), "message": p.get("message", "")}
            if "checkpoint" in report:
                last["checkpoint"] = base64.b64decode(report["checkpoint"]).decode()
    problems = []
    for name in ("progress", "checkpoint"):
        if name in want and last.get(name) != want[name]:
            problems.append(f"task {task_id}: last {name} reported {last.get(name)!r}, expected {want[name]!r}")
    if want.get("in_heartbeat") and not in_heartbeat:
        problems.append(f"task {task_id}: no heartbeat carried its report (only its outcome did, or nothing)")
    return problems


def check_servers(expect: dict[str, Any], log: list[dict[str, Any]], token: str | None, sdk: str) -> list[str]:
    """The case's expectations of what the scripted servers recorded."""
    calls = [e for e in log if e["event"] == "call"]
    problems = []
    for want in expect.get("calls", []):
        got = [c["role"] for c in calls if c["method"] in want["methods"]]
        if got != want["roles"]:
            problems.append(f"calls of {want['methods']}: on {got}, expected on {want['roles']}")
    for role in expect.get("no_connection", []):
        n = sum(1 for e in log if e["role"] == role and e["event"] == "connect")
        if n:
            problems.append(f"{role}: {n} connection(s), expected none")
    for role in expect.get("connected", []):
        if not any(e["role"] == role and e["event"] == "connect" for e in log):
            problems.append(f"{role}: no connection, expected some")
    bearer = f"Bearer {token}"
    for role in expect.get("token_at", []):
        there = [c for c in calls if c["role"] == role]
        if not there or any(c["authorization"] != bearer for c in there):
            problems.append(f"{role}: the token did not arrive with every call ({len(there)} call(s))")
    for role in expect.get("token_not_at", []):
        if any(token and token in c["authorization"] for c in calls if c["role"] == role):
            problems.append(f"{role}: the token arrived there")
    for role in expect.get("client_cert_at", []):
        there = [c for c in calls if c["role"] == role]
        if not there or any(not c["client_cert"] for c in there):
            problems.append(f"{role}: calls without the client certificate ({len(there)} call(s))")
    agent = f"cronoq-{sdk}/{VERSION}"  # first; gRPC's own name and version follow it
    for role in expect.get("user_agent_at", []):
        seen = sorted({c["user_agent"] for c in calls if c["role"] == role})
        if not seen or any(a != agent and not a.startswith(agent + " ") for a in seen):
            problems.append(f"{role}: user-agent {seen}, expected {agent!r} first in every call")
    outcomes: dict[str, str] = {}
    for e in log:
        if e["event"] == "outcome":
            outcomes[e["task_id"]] = e["kind"]
    for task_id, kind in expect.get("outcomes", {}).items():
        if outcomes.get(task_id) != kind:
            problems.append(f"task {task_id}: outcome {outcomes.get(task_id)!r}, expected {kind!r}")
    if expect.get("outcomes_batched"):
        if not any(len((c["request"] or {}).get("outcomes", [])) >= 2 for c in calls):
            problems.append("no request carried two outcomes or more: finishes are not batched")
    for task_id, least in expect.get("heartbeats", {}).items():
        beats = sum(
            1
            for c in calls
            if any(t.get("task_id") == task_id for t in lookup(c["request"], "heartbeat.tasks") or [])
            or (c["method"] == "Heartbeat" and any(t.get("task_id") == task_id for t in c["request"].get("tasks", [])))
        )
        if beats < least:
            problems.append(f"task {task_id}: named in {beats} heartbeat(s), expected at least {least}")
    for task_id, want in expect.get("reports", {}).items():
        problems += check_reports(task_id, want, calls)
    for role, least in expect.get("streams", {}).items():
        opened = sum(1 for e in log if e["role"] == role and e["event"] == "stream")
        if opened < least:
            problems.append(f"{role}: {opened} Work stream(s) opened, expected at least {least}")
    for role, most in expect.get("streams_at_most", {}).items():
        opened = sum(1 for e in log if e["role"] == role and e["event"] == "stream")
        if opened > most:
            problems.append(f"{role}: {opened} Work stream(s) opened, expected at most {most}")
    for role, most_by_method in expect.get("calls_at_most", {}).items():
        for method, most in most_by_method.items():
            n = sum(1 for c in calls if c["role"] == role and c["method"] == method)
            if n > most:
                problems.append(f"{role}: {method} called {n} time(s), expected at most {most}")
    for role, method in expect.get("retried", {}).items():
        n = sum(1 for c in calls if c["role"] == role and c["method"] == method)
        if n < 2:
            problems.append(f"{role}: {method} called {n} time(s), expected retries")
    for want in expect.get("requests", []):
        values = [
            lookup(c["request"], want["field"])
            for c in calls
            if c["role"] == want["role"] and c["method"] == want["method"]
        ]
        if want["equals"] not in values:
            problems.append(
                f"{want['role']} {want['method']}: {want['field']} was {values}, expected {want['equals']!r}"
            )
    return problems


# -- one case ----------------------------------------------------------------


@dataclass
class Outcome:
    passed: bool
    problems: list[str]
    seconds: float


def run_case(
    case: dict[str, Any], sdk: str, pkis: Pkis, netns: NetNs | None, postgres: TempPostgres | None, verbose: bool
) -> Outcome:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"conformance-{sdk}-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        roles: dict[str, dict[str, Any]] = case.get("roles", {})
        urls: dict[str, str] = {}
        database: dict[str, str] = {}
        if case.get("deployment") == "two_shards":
            urls = stack.enter_context(two_shards(workdir))
        elif case.get("deployment") == "outbox":
            if postgres is None:
                raise RuntimeError("an outbox case needs the run's PostgreSQL")
            urls, database = stack.enter_context(outbox_deployment(workdir, postgres))
        hosts: dict[str, str] = {}
        for name, role in roles.items():
            remote = role.get("host") == "remote"
            if remote and netns is None:
                raise RuntimeError("a role on another host needs the network namespace")
            host = netns.peer_ip if remote and netns else role.get("hostname", "127.0.0.1")
            port = next(REMOTE_PORTS) if remote else free_port()
            hosts[name] = "netns" if remote else "host"
            scheme = role.get("scheme", "https" if role.get("tls") else "http")
            urls[name] = f"{scheme}://{host}:{port}"
            urls[name + "|https"] = f"https://{host}:{port}"
            urls[name + ".port"] = str(port)
        scripted = Scripted(workdir)
        plans: dict[str, list[dict[str, Any]]] = {"host": [], "netns": []}
        for name, role in roles.items():
            if role.get("down"):
                continue
            url = urls[name]
            tls = None
            if role.get("tls"):
                pair = pkis.server(unknown_ca=role["tls"] == "unknown_ca")
                tls = {"cert": pair.cert, "key": pair.key}
                if role.get("client_cert_required"):
                    tls["client_ca"] = pkis.trusted.ca_path
            plans[hosts[name]].append(
                {
                    "name": name,
                    "host": url.rsplit("://", 1)[1].rsplit(":", 1)[0],
                    "port": int(url.rsplit(":", 1)[1]),
                    "tls": tls,
                    "shard": role.get("shard", "default"),
                    "heartbeat_interval_ms": role.get("heartbeat_interval_ms", 200),
                    "script": substitute(role.get("script", {}), urls),
                    "tasks": [task_json(t) for t in role.get("tasks", [])],
                    "cancel": role.get("cancel", []),
                    "lost": role.get("lost", []),
                }
            )
        try:
            for where, plan in plans.items():
                if plan:
                    scripted.start(plan, where, netns if where == "netns" else None)
            sdk_opts = case.get("sdk", {})
            token = sdk_opts.get("token", TOKEN)
            tls_opts: dict[str, str] = {}
            if sdk_opts.get("ca"):
                tls_opts["ca"] = pkis.trusted.ca_path
            if sdk_opts.get("client_cert"):
                tls_opts.update(cert=pkis.client.cert, key=pkis.client.key)
            driver_input = {
                "case": case["name"],
                "endpoints": [urls.get(e) or substitute(e, urls) for e in sdk_opts.get("endpoints", [])],
                "token": token,
                "tls": tls_opts or None,
                "insecure_redirect_http": sdk_opts.get("insecure_redirect_http", False),
                "retry": sdk_opts.get(
                    "retry", {"initial_backoff_ms": 20, "max_backoff_ms": 200, "max_elapsed_ms": 3000}
                ),
                "timeout_ms": sdk_opts.get("timeout_ms", 5000),
                "keepalive": sdk_opts.get("keepalive"),
                "steps": substitute(case["steps"], urls),
                **database,
            }
            fast = case.get("fast_worker")
            fast_handled = None
            if fast is not None:
                stop_fast = stack.enter_context(fast_worker(urls[fast["endpoint"]], fast["pool"], workdir))
            observed, problems = run_driver(sdk, driver_input, workdir, verbose)
            if fast is not None:
                fast_handled = stop_fast()
        finally:
            log = scripted.stop()
        if observed is not None:
            expect = substitute(case.get("expect", {}), {**urls, **step_values(observed)})
            problems += match(expect.get("steps", []), observed.get("steps"), "steps")
            problems += check_servers(expect, log, token, sdk)
            if "fast_worker_handled" in expect:
                problems += match(expect["fast_worker_handled"], fast_handled, "fast_worker_handled")
        if problems and verbose:
            problems.append(f"driver input: {json.dumps(driver_input)}")
            problems.append(f"observed: {json.dumps(observed)}")
            problems += [f"server: {json.dumps(e)}" for e in log]
    return Outcome(not problems, problems, time.monotonic() - started)


def run_driver(
    sdk: str, driver_input: dict[str, Any], workdir: Path, verbose: bool
) -> tuple[dict[str, Any] | None, list[str]]:
    try:
        proc = subprocess.run(
            DRIVERS[sdk],
            input=json.dumps(driver_input).encode(),
            capture_output=True,
            timeout=CASE_TIMEOUT_S,
            cwd=ROOT,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"").decode(errors="replace")[-2000:]
        return None, [f"the driver did not answer in {CASE_TIMEOUT_S:g}s; stderr: {tail}"]
    stderr = proc.stderr.decode(errors="replace")
    if verbose and stderr:
        (workdir.parent / f"{driver_input['case']}-{sdk}.stderr").write_text(stderr)
    try:
        return json.loads(proc.stdout), []
    except json.JSONDecodeError:
        return None, [f"the driver exited {proc.returncode} without a JSON result; stderr: {stderr[-2000:]}"]


def build_drivers(sdks: list[str]) -> list[str]:
    """Builds the drivers of these SDKs that need a build; the SDKs whose build failed."""
    failed = []
    for sdk in sdks:
        if sdk not in BUILDS:
            continue
        print(f"conformance: building the {sdk} driver: {' '.join(BUILDS[sdk])}", flush=True)
        if subprocess.run(BUILDS[sdk], cwd=ROOT).returncode != 0:
            failed.append(sdk)
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdk", action="append", choices=sorted(DRIVERS), help="this SDK only (repeatable; default: all)")
    ap.add_argument("--case", action="append", help="this case only (repeatable)")
    ap.add_argument("--verbose", action="store_true", help="print what the driver and servers saw for a failed case")
    args = ap.parse_args()
    sdks = args.sdk or sorted(DRIVERS)
    cases = load_cases()
    if args.case:
        unknown = set(args.case) - {c["name"] for c in cases}
        if unknown:
            print(f"conformance: no case named {sorted(unknown)}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c["name"] in args.case]
    unbuilt = build_drivers(sdks)
    if unbuilt:
        print(f"conformance: the driver of {', '.join(unbuilt)} did not build", file=sys.stderr)
        return 1
    results: dict[tuple[str, str], Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="conformance-pki-") as tmp, ExitStack() as stack:
        netns = None
        if any(r.get("host") == "remote" for c in cases for r in c.get("roles", {}).values()):
            netns = stack.enter_context(NetNs())  # roles on another host: never skipped, a failure here fails the run
        hosts = ("127.0.0.1", "localhost", *([netns.peer_ip] if netns else []))
        pkis = Pkis(Pki(Path(tmp), "ca"), Pki(Path(tmp), "unknown-ca"), hosts)
        pkis.client = pkis.trusted.client(CLIENT_SUBJECT, "worker")
        postgres = None
        if any(c.get("deployment") == "outbox" for c in cases):
            try:
                postgres = start_temp_postgres()  # the application's database: never skipped
            except FileNotFoundError as err:
                print(f"conformance: the outbox cases need PostgreSQL: {err}", file=sys.stderr)
                return 1
            stack.callback(postgres.cleanup)
        for case in cases:
            for sdk in sdks:
                try:
                    outcome = run_case(case, sdk, pkis, netns, postgres, args.verbose)
                except Exception as err:
                    outcome = Outcome(False, [f"the runner failed: {type(err).__name__}: {err}"], 0.0)
                results[(case["name"], sdk)] = outcome
                mark = "pass" if outcome.passed else "FAIL"
                print(f"  {case['area']}/{case['name']} [{sdk}] {mark} ({outcome.seconds:.1f}s)", flush=True)
    width = max(len(f"{c['area']}/{c['name']}") for c in cases)
    print()
    print(f"{'case':<{width}}  " + "  ".join(f"{s:<8}" for s in sdks))
    for case in cases:
        row = "  ".join(f"{'pass' if results[(case['name'], s)].passed else 'FAIL':<8}" for s in sdks)
        print(f"{case['area'] + '/' + case['name']:<{width}}  {row}")
    failed = [(k, o) for k, o in results.items() if not o.passed]
    for (name, sdk), outcome in failed:
        print(f"\n{name} [{sdk}]:")
        for problem in outcome.problems:
            print(f"  - {problem}")
    total = len(results)
    print(f"\nconformance: {total - len(failed)} of {total} passed ({len(cases)} cases x {len(sdks)} SDK(s))")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
