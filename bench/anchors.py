"""Anchor benchmarks: PgQueuer, procrastinate and River on the same PostgreSQL and the
same workloads as cronoq's bench (burn-down of N no-op jobs by one worker process;
enqueue→start latency at a fixed rate; River: burn-down only).

The anchors are the bench's own business, never cronoq's dependencies: they live in a
separate virtualenv, bench/.venv-anchors (created once by ensure_venv(), with pinned
versions), and the code importing them is in bench/anchor_pgqueuer.py and
bench/anchor_procrastinate.py, run with that virtualenv's python. River is Go: its
anchor is the module bench/river (go.mod pins River), built by build_river() with the
`go` on PATH into bench/river/river-bench (Go's build cache makes rebuilds cheap); without
Go it is skipped. This module imports no anchor library and works from cronoq's own
environment.

    python bench/anchors.py [--url URL] [--only pgqueuer|procrastinate|river] [--tasks N]

Without --url a throwaway PostgreSQL is started (tests/pgserver.py). Every run creates
and drops its own database on the server. From code:

    import anchors
    anchors.run_anchor("pgqueuer", "burndown", url, tasks=20000)
    anchors.run_anchor("procrastinate", "latency", url, rate=1000, batch=10)
    anchors.run_river(url, jobs=20000, max_workers=64)  # None when Go is missing
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VENV = HERE / ".venv-anchors"
RIVER_DIR = HERE / "river"
RIVER_BIN = RIVER_DIR / "river-bench"

SYSTEMS = ("pgqueuer", "procrastinate")
KINDS = ("burndown", "latency")

# What the anchors run on. typer<0.20: pgqueuer 1.6.0's `pgq` CLI fails with newer typer.
PINS = [
    "pgqueuer==1.6.0",
    "typer==0.19.2",
    "asyncpg==0.32.0",
    "uvloop==0.23.0",
    "procrastinate==3.10.0",
    "psycopg==3.3.9",
    "psycopg-binary==3.3.9",
    "psycopg-pool==3.3.3",
]
# Their dependencies, as resolved when the pins above were tested (keeps the venv reproducible).
LOCK = [
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "asgiref==3.13.0",
    "attrs==26.1.0",
    "click==8.5.1",
    "croniter==7.0.0",
    "idna==3.20",
    "markdown-it-py==4.3.0",
    "mdurl==0.1.2",
    "packaging==26.4",
    "pydantic==2.14.4",
    "pydantic-settings==2.16.3",
    "pydantic_core==2.50.5",
    "Pygments==2.21.0",
    "python-dateutil==4.0.0",
    "python-dotenv==1.2.4",
    "rich==15.0.0",
    "shellingham==1.5.4",
    "tabulate==0.10.0",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    "tzdata==2026.6",
]

# River's burn-downs: (title, MaxWorkers). Both with River's own benchmark's fetch settings
# (FetchCooldown 2 ms, FetchPollInterval 20 ms; bench/river/main.go's defaults): the
# issue's workload (one client, MaxWorkers 64, cronoq's worker concurrency), and the
# MaxWorkers of `river bench` itself.
RIVER_RUNS = [
    ("burn-down, {tasks:,} no-op jobs, one client, MaxWorkers 64", 64),
    ("the same, River's bench settings (MaxWorkers 2000)", 2000),
]

# (title, kind, options) of `main()`'s runs, the same workloads as bench/run_all.py.
RUNS = [
    ("burn-down, {tasks:,} no-op jobs, 1 worker process", "burndown", {}),
    ("enqueue→start at 1,000 jobs/s, 100 calls/s of 10 jobs", "latency", {"batch": 10}),
    ("enqueue→start at 1,000 jobs/s, one call per job", "latency", {"batch": 1}),
    ("enqueue→start at 300 jobs/s, one call per job", "latency", {"rate": 300}),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_venv() -> Path:
    """Creates bench/.venv-anchors with the pinned anchors (once; again when the pins change).
    Returns its python."""
    python = venv_python()
    stamp = VENV / ".anchors-pins"
    wanted = "\n".join(PINS + LOCK) + "\n"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    log(f"creating {VENV} ({', '.join(PINS)})")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True, timeout=300)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-q", *PINS, *LOCK],
        check=True,
        timeout=1200,
        stdout=sys.stderr,
    )
    subprocess.run(
        [str(python), "-c", "import pgqueuer, procrastinate, asyncpg, psycopg, uvloop"], check=True, timeout=120
    )
    stamp.write_text(wanted)
    return python


def run_anchor(name: str, kind: str, url: str, timeout: float = 1200.0, **opts: Any) -> dict[str, Any]:
    """Runs bench/anchor_<name>.py <kind> against the server at url; returns its --json dict.

    opts become the script's flags (tasks=20000 → --tasks 20000; True → a bare flag).
    The script and its worker run in their own process group, which is terminated (then
    killed) if they outlive timeout seconds."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown anchor {name!r}; one of {SYSTEMS}")
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    cmd = [str(ensure_venv()), str(HERE / f"anchor_{name}.py"), kind, "--url", url, "--json"]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value not in (False, None):
            cmd += [flag, str(value)]
    return _run_json(cmd, timeout, f"{name} {kind}")


def build_river() -> Path | None:
    """Builds bench/river (River's burn-down) with the `go` on PATH; None when there is no Go.
    A build failure (e.g. no module proxy and an empty module cache) raises."""
    go = shutil.which("go")
    if go is None:
        return None
    log(f"building {RIVER_BIN.relative_to(REPO)} (go build)")
    subprocess.run([go, "build", "-o", str(RIVER_BIN), "."], cwd=RIVER_DIR, check=True, timeout=600, stdout=sys.stderr)
    return RIVER_BIN


def run_river(url: str, jobs: int, max_workers: int, timeout: float = 1200.0, **opts: Any) -> dict[str, Any] | None:
    """River's burn-down of jobs no-op jobs (bench/river/main.go) on the server at url, one
    client with max_workers; its JSON result ({"jobs_per_s", "seconds", ...}), or None when
    Go is missing. opts become further flags (fetch_cooldown="100ms" → --fetch-cooldown 100ms)."""
    binary = build_river()
    if binary is None:
        return None
    cmd = [str(binary), "--url", url, "--jobs", str(jobs), "--max-workers", str(max_workers)]
    cmd += [f"--{key.replace('_', '-')}={value}" for key, value in opts.items()]
    return _run_json(cmd, timeout, f"river, MaxWorkers {max_workers}")


def _run_json(cmd: list[str], timeout: float, what: str) -> dict[str, Any]:
    """Runs cmd in its own process group (terminated, then killed, if it outlives timeout
    seconds) and returns the last JSON line of its stdout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:  # the timeout, or an interrupt of the caller: leave no process behind
        _stop_group(proc)
        raise
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out)
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{what}: no JSON result on stdout: {out[-500:]!r}")
    return json.loads(lines[-1])


def _stop_group(proc: subprocess.Popen[str]) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def describe(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"failed: {result['error']}"
    if "jobs_per_s" in result:  # River
        return f"{result['jobs_per_s']:,.0f} jobs/s drained in {result['seconds']} s"
    if "drain_per_s" in result:
        return (
            f"{result['drain_per_s']:,} jobs/s drained in {result['drain_s']} s "
            f"({result['enqueue_per_s']:,} jobs/s enqueued)"
        )
    text = (
        f"p50 {result['p50_ms']} ms, p90 {result['p90_ms']} ms, p99 {result['p99_ms']} ms, "
        f"max {result['max_ms']} ms (achieved {result['achieved_rate']:,}/s"
    )
    if result.get("started_per_s", result["achieved_rate"]) < 0.95 * result["achieved_rate"]:
        text += f"; worker kept up with only {result['started_per_s']:,}/s"
    return text + ")"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="PostgreSQL server URL (default: start a throwaway one)")
    ap.add_argument("--only", choices=(*SYSTEMS, "river"), help="run one anchor only")
    ap.add_argument("--tasks", type=int, default=20_000, help="burn-down size")
    ap.add_argument("--json", action="store_true", help="also print every result as a JSON line")
    args = ap.parse_args()

    if args.only != "river":
        ensure_venv()
    pg = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(REPO / "tests"))
        from pgserver import start_temp_postgres

        pg = start_temp_postgres()
        url = pg.url
        log(f"started a throwaway PostgreSQL at {url}")
    rows: list[tuple[str, str, dict[str, Any]]] = []
    try:
        for name in [args.only] if args.only else SYSTEMS:
            if name == "river":
                continue
            for title, kind, opts in RUNS:
                title = title.format(tasks=args.tasks)
                log(f"== {name}: {title}")
                run_opts = {"tasks": args.tasks} if kind == "burndown" else {}
                try:
                    result = run_anchor(name, kind, url, **run_opts, **opts)
                except (subprocess.SubprocessError, RuntimeError, OSError, ValueError) as exc:
                    result = {"system": name, "error": str(exc)[-300:]}
                rows.append((name, title, result))
                if args.json:
                    print(json.dumps(result), flush=True)
        for title, max_workers in RIVER_RUNS if args.only in (None, "river") else []:
            title = title.format(tasks=args.tasks)
            log(f"== river: {title}")
            try:
                river = run_river(url, args.tasks, max_workers)
            except (subprocess.SubprocessError, RuntimeError, OSError, ValueError) as exc:
                river = {"system": "river", "error": str(exc)[-300:]}
            if river is None:
                log("river skipped: no `go` on PATH")
                break
            rows.append(("river", title, river))
            if args.json:
                print(json.dumps(river), flush=True)
    finally:
        if pg is not None:
            pg.cleanup()
    print("\n| anchor | run | result |\n|---|---|---|")
    for name, title, result in rows:
        version = result.get("version", "")
        print(f"| {name} {version} | {title} | {describe(result)} |")


if __name__ == "__main__":
    main()
