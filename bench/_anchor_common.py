"""Shared, standard-library-only plumbing of the anchor benchmarks (anchor_pgqueuer.py,
anchor_procrastinate.py): argument parsing, the worker subprocess, rate-paced enqueue,
percentiles and the result line (latency.py uses the same latency_result for cronoq).
It imports no queue library, so it runs under any Python.

Protocol between a bench script and its worker process (the same script, run as
`SCRIPT _worker ...`): the worker writes `ready.json` ({"t_start": ...}) in a scratch
directory once its imports are done, and `result.json` when it has seen `--total` jobs
start (or was stopped). Every wait on it has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")


def log(msg: str, end: str = "\n") -> None:
    print(msg, end=end, file=sys.stderr, flush=True)


def build_parser(description: str | None, system_options: Callable[[argparse.ArgumentParser], None]) -> Any:
    """`SCRIPT burndown|latency [options]`, and the internal `SCRIPT _worker ...`."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", required=True, help="PostgreSQL server URL; each run creates its own database on it")
        p.add_argument("--keep-db", action="store_true", help="do not drop the run's database afterwards")
        p.add_argument("--json", action="store_true", help="print one JSON line on stdout")
        p.add_argument("--timeout", type=float, default=600.0, help="deadline (s) for the worker to see every job")
        system_options(p)

    b = sub.add_parser("burndown", help="enqueue --tasks no-op jobs in batches, then drain them with one worker")
    b.add_argument("--tasks", type=int, default=20_000)
    b.add_argument("--batch", type=int, default=500, help="jobs per enqueue call while filling the queue")
    b.add_argument(
        "--analyze",
        action="store_true",
        help="run ANALYZE after filling the queue (default: leave it to autovacuum, as deployed)",
    )
    common(b)

    lat = sub.add_parser("latency", help="enqueue at --rate jobs/s for --seconds while one worker runs")
    lat.add_argument("--rate", type=int, default=1000)
    lat.add_argument("--seconds", type=float, default=5.0)
    lat.add_argument("--batch", type=int, default=1, help="jobs per enqueue call (1: one single-job call per job)")
    common(lat)

    w = sub.add_parser("_worker", help=argparse.SUPPRESS)
    w.add_argument("--url", required=True)
    w.add_argument("--mode", choices=["burndown", "latency"], required=True)
    w.add_argument("--total", type=int, required=True)
    w.add_argument("--dir", required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    system_options(w)
    return ap


# ---- databases -------------------------------------------------------------------------------


def fresh_db_name(system: str, kind: str) -> str:
    return f"anchor_{system}_{kind}_{os.getpid()}_{secrets.token_hex(3)}"


def with_database(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


# ---- the worker process ----------------------------------------------------------------------


class WorkerProcess:
    """`SCRIPT _worker ...` in its own process; stopped (TERM, then KILL) by stop()."""

    def __init__(self, script: str, url: str, mode: str, total: int, timeout: float, extra: list[str]):
        self.dir = Path(tempfile.mkdtemp(prefix="anchor-worker-"))
        cmd = [
            sys.executable,
            script,
            "_worker",
            "--url",
            url,
            "--mode",
            mode,
            "--total",
            str(total),
            "--dir",
            str(self.dir),
            "--timeout",
            str(timeout),
            *extra,
        ]
        self.spawned_at = time.time()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr)

    def _wait_file(self, name: str, timeout: float) -> dict[str, Any]:
        path = self.dir / name
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return json.loads(path.read_text())
            if self.proc.poll() is not None:
                if path.exists():
                    return json.loads(path.read_text())
                raise RuntimeError(f"worker exited with {self.proc.returncode} before writing {name}")
            time.sleep(0.005)
        raise TimeoutError(f"worker did not write {name} within {timeout:.0f}s")

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        return self._wait_file("ready.json", timeout)

    def wait_result(self, timeout: float) -> dict[str, Any]:
        return self._wait_file("result.json", timeout)

    def join(self, timeout: float = 30.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in self.dir.iterdir():
            f.unlink()
        self.dir.rmdir()


class WorkerState:
    """Inside the worker process: counts job starts, records latencies, writes the files."""

    def __init__(self, args: Any):
        self.dir = Path(args.dir)
        self.mode = args.mode
        self.total = args.total
        self.count = 0
        self.latencies: list[float] = []
        self.t_start = time.time()
        self.t_first = 0.0
        self.t_done = 0.0
        self.done = asyncio.Event()
        self._report_every = max(self.total // 10, 1)

    def ready(self) -> None:
        self._write("ready.json", {"t_start": self.t_start})

    def job_started(self, enqueued_at: float | None) -> None:
        """Call first thing in the job handler (enqueued_at: the payload's time, for latency)."""
        now = time.time()
        self.count += 1
        if self.count == 1:
            self.t_first = now
        if enqueued_at is not None:
            self.latencies.append(now - enqueued_at)
        if self.mode == "burndown" and self.count % self._report_every == 0:
            log(f"\rdrained {self.count}/{self.total}", end="")
        if self.count == self.total:
            self.t_done = now
            if self.mode == "burndown":
                log("")
            self.done.set()

    def write_result(self, **extra: Any) -> None:
        self._write(
            "result.json",
            {
                "t_start": self.t_start,
                "t_first": self.t_first,
                "t_done": self.t_done,
                "count": self.count,
                "latencies": self.latencies,
                **extra,
            },
        )

    def _write(self, name: str, data: dict[str, Any]) -> None:
        tmp = self.dir / (name + ".tmp")
        tmp.write_text(json.dumps(data))
        tmp.rename(self.dir / name)


def install_stop_signals(stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


# ---- enqueueing ------------------------------------------------------------------------------


async def enqueue_all(submit_batch: Callable[[int], Awaitable[object]], total: int, batch: int) -> float:
    """Enqueues total jobs in calls of batch; returns the seconds it took."""
    started = time.perf_counter()
    for i in range(0, total, batch):
        n = min(batch, total - i)
        await submit_batch(n)
        if (i // batch) % 4 == 0 or i + n == total:
            log(f"\renqueued {i + n}/{total}", end="")
    log("")
    return time.perf_counter() - started


async def submit_at_rate(
    submit_one: Callable[[float], Awaitable[object]],
    submit_batch: Callable[[int, float], Awaitable[object]],
    rate: int,
    seconds: float,
    batch: int,
) -> tuple[int, float]:
    """Like bench/latency.py: one warm-up job, then every batch/rate seconds one call with batch
    jobs (submit_one when batch == 1), not waiting for earlier calls. Returns (jobs, achieved/s)."""
    calls = int(rate * seconds / batch)
    await submit_one(time.time())  # warm-up, counted like bench/latency.py does
    loop = asyncio.get_running_loop()
    start = loop.time()
    pending: set[asyncio.Task[object]] = set()
    for i in range(calls):
        delay = start + i * batch / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        call = submit_one(time.time()) if batch == 1 else submit_batch(batch, time.time())
        t = asyncio.ensure_future(call)
        pending.add(t)
        t.add_done_callback(pending.discard)
        if i % max(rate // batch, 1) == 0:
            log(f"\renqueued {i * batch}/{calls * batch}", end="")
    await asyncio.wait_for(asyncio.gather(*pending), timeout=60)
    achieved = calls * batch / (loop.time() - start)
    log(f"\renqueued {calls * batch}/{calls * batch}")
    return calls * batch + 1, achieved


def latency_total(rate: int, seconds: float, batch: int) -> int:
    return int(rate * seconds / batch) * batch + 1


# ---- results ---------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * p / 100), len(ordered) - 1)]


def burndown_result(system: str, tasks: int, enqueue_s: float, drain_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "system": system,
        "tasks": tasks,
        "enqueue_per_s": round(tasks / enqueue_s),
        "drain_per_s": round(tasks / drain_s),
        "drain_s": round(drain_s, 2),
        **extra,
    }


def latency_result(
    system: str, rate: int, batch: int, achieved: float, latencies: list[float], **extra: Any
) -> dict[str, Any]:
    ms = [x * 1000 for x in latencies]
    return {
        "system": system,
        "rate": rate,
        "batch": batch,
        "achieved_rate": round(achieved),
        "tasks": len(ms),
        "p50_ms": round(percentile(ms, 50), 2),
        "p90_ms": round(percentile(ms, 90), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2),
        **extra,
    }


def cronoq_latency(
    rate: int, batch: int, achieved: float, latencies: list[float], store: str, as_json: bool, what: str, counted: str
) -> dict[str, Any]:
    """A cronoq latency run's result, printed: one JSON line, or `what` (e.g. "sqlite
    submit→start at 1000/s in calls of 10") with the achieved rate and percentiles."""
    result = latency_result(
        "cronoq", rate, batch, achieved, latencies, store=store, mean_ms=round(statistics.mean(latencies) * 1000, 2)
    )
    if as_json:
        print(json.dumps(result))
    else:
        print(
            f"{what} (achieved {achieved:,.0f}/s, {result['tasks']} {counted}): "
            f"p50 {result['p50_ms']} ms, p90 {result['p90_ms']} ms, p99 {result['p99_ms']} ms, "
            f"max {result['max_ms']} ms"
        )
    return result


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
        return
    if "drain_per_s" in result:
        print(
            f"{result['system']} burn-down: enqueued {result['tasks']} at {result['enqueue_per_s']:,} jobs/s; "
            f"drained in {result['drain_s']} s = {result['drain_per_s']:,} jobs/s (one worker process)"
        )
    else:
        print(
            f"{result['system']} submit→start at {result['rate']}/s in calls of {result['batch']} "
            f"(achieved {result['achieved_rate']:,}/s, {result['tasks']} jobs): p50 {result['p50_ms']} ms, "
            f"p90 {result['p90_ms']} ms, p99 {result['p99_ms']} ms, max {result['max_ms']} ms"
        )


def run_bench(
    system: str,
    script: str,
    args: Any,
    *,
    create_db: Callable[[str], None],
    drop_db: Callable[[str], None],
    install_schema: Callable[[str], None],
    enqueue_burndown: Callable[[str, int, int], float],
    enqueue_latency: Callable[[str, int, float, int], tuple[int, float]],
    verify: Callable[[str], dict[str, Any]],
    analyze: Callable[[str], None],
    worker_extra: list[str],
) -> dict[str, Any]:
    """The shared driver of one run: fresh database, schema, worker, enqueueing, cleanup.

    create_db/drop_db(name) act on args.url's server; install_schema(db_url) sets the system
    up in the new database; the enqueue_* callables are synchronous wrappers around the
    system's own client; verify(db_url) returns extra result fields read from the database
    once the worker has stopped; analyze(db_url) runs ANALYZE (burndown --analyze)."""
    # A TERM (e.g. bench/anchors.py's timeout) unwinds through the finally below, which
    # stops the worker and drops the database.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    dbname = fresh_db_name(system, args.kind)
    db_url = with_database(args.url, dbname)
    worker: WorkerProcess | None = None
    created = False
    try:
        log(f"[{system}] database {dbname}")
        create_db(dbname)
        created = True
        install_schema(db_url)
        if args.kind == "burndown":
            log(f"[{system}] enqueueing {args.tasks} no-op jobs in batches of {args.batch}")
            enqueue_s = enqueue_burndown(db_url, args.tasks, args.batch)
            if args.analyze:
                log(f"[{system}] ANALYZE")
                analyze(db_url)
            log(f"[{system}] starting one worker process")
            worker = WorkerProcess(script, db_url, "burndown", args.tasks, args.timeout, worker_extra)
            ready = worker.wait_ready()
            res = worker.wait_result(args.timeout + 30)
            if res["count"] < args.tasks:
                raise RuntimeError(f"worker saw only {res['count']}/{args.tasks} jobs")
            if worker.join(30) is None:
                raise TimeoutError("worker did not exit after its last job")
            drain_s = res["t_done"] - ready["t_start"]
            return burndown_result(
                system,
                args.tasks,
                enqueue_s,
                drain_s,
                drain_s_from_spawn=round(res["t_done"] - worker.spawned_at, 2),
                **verify(db_url),
            )
        total = latency_total(args.rate, args.seconds, args.batch)
        worker = WorkerProcess(script, db_url, "latency", total, args.timeout, worker_extra)
        worker.wait_ready()
        time.sleep(1.0)  # as bench/latency.py: the worker connects and starts listening
        log(f"[{system}] enqueueing {args.rate}/s for {args.seconds:g}s in calls of {args.batch}")
        _, achieved = enqueue_latency(db_url, args.rate, args.seconds, args.batch)
        res = worker.wait_result(args.timeout + 30)
        if res["count"] < total:
            raise RuntimeError(f"worker saw only {res['count']}/{total} jobs")
        if worker.join(30) is None:
            raise TimeoutError("worker did not exit after its last job")
        # How fast the worker started jobs while they arrived: below achieved_rate means it fell
        # behind and the latencies measure a growing backlog rather than pickup delay.
        started_per_s = (total - 1) / max(res["t_done"] - res["t_first"], 1e-9)
        return latency_result(
            system,
            args.rate,
            args.batch,
            achieved,
            res["latencies"],
            started_per_s=round(started_per_s),
            **verify(db_url),
        )
    finally:
        if worker is not None:
            worker.stop()
        if created and not args.keep_db:
            try:
                drop_db(dbname)
            except Exception as exc:  # cleanup must not hide the run's own error
                log(f"[{system}] could not drop {dbname}: {exc!r}")


def run_loop(loop: str, coro: Coroutine[Any, Any, T]) -> T:
    """Runs coro on uvloop or plain asyncio (uvloop is imported only when asked for)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)
