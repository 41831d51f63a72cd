"""The outbox (transactional enqueue): one PostgreSQL server is the application's database (the
outbox in its own schema) and cronoq's store (another schema); one cronoq-server relays it.

- Enqueue throughput through cronoq.outbox (asyncpg), the relay running and no worker: one
  transaction of --tasks tasks (enqueue_many), then --tasks transactions of one (enqueue), as the
  application's tasks/s (building the tasks to the last commit), and the time from the last commit
  until the relay has emptied the outbox (every row relayed, none refused: the dead table stays
  empty). The median of --rounds.
- Commit → start: a worker process (cronoq.Worker, concurrency 64) records when each task starts;
  the application commits one task a transaction at --rate per second for --seconds, the time of
  each transaction's insert (sent just before its commit) in the payload. Once with notify = true
  (the server's default poll_interval, 1 s), once with notify = false and poll_interval 100 ms
  (a second server).
- River (bench/river --workload outbox, built with the `go` on PATH; --no-river skips it): the
  same workloads with InsertManyTx / InsertTx in pgx transactions on the same server (its own
  database), and its commit → start with a started client (MaxWorkers 64, River's bench fetch
  settings); cronoq's figure / River's.

    python bench/outbox.py [--url URL] [--tasks 1000] [--rounds 3] [--rate 50] [--seconds 10] [--quick]
                           [--no-river] [--py-spy FILE] [--json]

--py-spy FILE records the server's relay (py-spy, the bench venv's) during the throughput runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import anchors
import asyncpg
from _anchor_common import latency_result, log
from _servers import BenchServer, bench_store
from latency import run_worker

import cronoq
import cronoq.outbox
from cronoq.outbox_schema import ddl, quoted

CONCURRENCY = 64
# The relay's polling when notify = false, in the second server's config.
POLL_INTERVAL = "100ms"


def outbox_config(url: str, schema: str, notify: bool) -> str:
    config = f'[[outboxes]]\nurl = "{url}"\nschema = "{schema}"\npools = ["default"]\nnotify = {str(notify).lower()}\n'
    return config if notify else config + f'poll_interval = "{POLL_INTERVAL}"\n'


async def install(url: str, schema: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for statement in ddl(schema):
            await conn.execute(statement)
    finally:
        await conn.close()


async def wait_relayed(conn: asyncpg.Connection, schema: str, timeout: float = 300.0) -> float:
    """Waits until the outbox is empty; returns when (perf_counter). Raises if a row was refused."""
    deadline = time.perf_counter() + timeout
    while await conn.fetchval(f"SELECT EXISTS (SELECT 1 FROM {quoted(schema)}.cronoq_outbox)"):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the outbox was not empty {timeout:.0f} s after the last commit")
        await asyncio.sleep(0.002)
    emptied = time.perf_counter()
    dead = await conn.fetchval(f"SELECT count(*) FROM {quoted(schema)}.cronoq_outbox_dead")
    if dead:
        raise RuntimeError(f"{dead} row(s) refused by the server (see {schema}.cronoq_outbox_dead)")
    return emptied


async def throughput(url: str, schema: str, tasks: int, rounds: int) -> dict[str, Any]:
    """The application's enqueue rate and the relay's time to empty the outbox, median of rounds."""
    conn = await asyncpg.connect(url)
    one_tx: list[tuple[float, float]] = []
    each_tx: list[tuple[float, float]] = []
    try:
        for r in range(rounds):
            log(f"[cronoq] round {r + 1}: one transaction of {tasks:,} tasks (enqueue_many)")
            start = time.perf_counter()
            specs = [cronoq.task_spec("default", {"i": i}) for i in range(tasks)]
            async with conn.transaction():
                await cronoq.outbox.enqueue_many(conn, specs, schema=schema)
            committed = time.perf_counter()
            one_tx.append((tasks / (committed - start), await wait_relayed(conn, schema) - committed))
            log(f"[cronoq] round {r + 1}: {tasks:,} transactions of one task (enqueue)")
            start = time.perf_counter()
            for i in range(tasks):
                async with conn.transaction():
                    await cronoq.outbox.enqueue(conn, "default", {"i": i}, schema=schema)
            committed = time.perf_counter()
            each_tx.append((tasks / (committed - start), await wait_relayed(conn, schema) - committed))
    finally:
        await conn.close()

    def median(runs: list[tuple[float, float]]) -> dict[str, Any]:
        return {
            "tasks_per_s": round(statistics.median(rate for rate, _ in runs)),
            "relayed_after_s": round(statistics.median(after for _, after in runs), 3),
        }

    return {"one_tx": median(one_tx), "each_tx": median(each_tx)}


async def commit_at_rate(url: str, schema: str, rate: int, seconds: float) -> float:
    """Commits rate transactions of one task per second (one after the other, on one connection);
    returns the rate achieved."""
    conn = await asyncpg.connect(url)
    try:
        total = int(rate * seconds)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(total):
            delay = start + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            async with conn.transaction():
                await cronoq.outbox.enqueue(conn, "default", {"t": time.time()}, schema=schema)
        return total / (loop.time() - start)
    finally:
        await conn.close()


def commit_to_start(server: BenchServer, url: str, schema: str, rate: int, seconds: float) -> dict[str, Any]:
    total = int(rate * seconds)
    ready, out, stop = mp.Event(), mp.Queue(), mp.Event()
    proc = mp.Process(target=run_worker, args=(server.endpoint, CONCURRENCY, total, ready, out, stop))
    proc.start()
    try:
        ready.wait(30)
        time.sleep(1.0)  # the worker registers and starts its long poll
        achieved = asyncio.run(commit_at_rate(url, schema, rate, seconds))
        try:  # every task started, or a run stopped after a bounded wait
            latencies = out.get(timeout=60)
        except queue.Empty:
            stop.set()
            latencies = out.get(timeout=60)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if len(latencies) < total:
        raise RuntimeError(f"the worker saw only {len(latencies)}/{total} tasks start")
    return latency_result("cronoq", rate, 1, achieved, latencies)


def profiled(server: BenchServer, out: str | None) -> subprocess.Popen[bytes] | None:
    """py-spy recording the server until stopped (SIGINT), or None."""
    if out is None:
        return None
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cmd = [py_spy, "record", "--pid", str(server.proc.pid), "--output", out, "--format", "speedscope"]
    if out.endswith(".svg"):
        cmd[-2:] = ["--format", "flamegraph"]
    proc = subprocess.Popen([*cmd, "--rate", "200", "--idle"], stdout=sys.stderr, stderr=sys.stderr)
    time.sleep(1.0)  # py-spy attaches
    return proc


def run_cronoq(url: str, args: argparse.Namespace) -> dict[str, Any]:
    schema = f"ob_{uuid.uuid4().hex[:10]}"
    asyncio.run(install(url, schema))
    result: dict[str, Any] = {"schema": schema}
    with tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp), url, extra_config=outbox_config(url, schema, notify=True))
        try:
            log(f"[cronoq] commit → start, NOTIFY: {args.rate}/s for {args.seconds:g} s")
            result["notify"] = commit_to_start(server, url, schema, args.rate, args.seconds)
            spy = profiled(server, args.py_spy)
            try:
                result.update(asyncio.run(throughput(url, schema, args.tasks, args.rounds)))
            finally:
                if spy is not None:
                    spy.send_signal(2)
                    spy.wait(60)
        finally:
            server.stop()
    with tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp), url, extra_config=outbox_config(url, schema, notify=False))
        try:
            log(f"[cronoq] commit → start, polling every {POLL_INTERVAL}: {args.rate}/s for {args.seconds:g} s")
            result["poll"] = commit_to_start(server, url, schema, args.rate, args.seconds)
        finally:
            server.stop()
    return result


def run_river(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """River's figures ({"skipped": why} when it could not run)."""
    try:
        river = anchors.run_river(
            url, jobs=args.tasks, max_workers=CONCURRENCY, workload="outbox",
            rate=args.rate, seconds=args.seconds, rounds=args.rounds,
        )  # fmt: skip
    except (subprocess.SubprocessError, RuntimeError, OSError) as exc:  # e.g. go build without modules
        return {"skipped": f"failed: {str(exc)[-200:]}"}
    if river is None:
        return {"skipped": "no `go` on PATH"}
    latencies = river.pop("latencies")
    river["latency"] = latency_result("river", args.rate, 1, river.pop("achieved_rate"), latencies)
    return river


def ratios(ours: dict[str, Any], river: dict[str, Any]) -> dict[str, float]:
    """cronoq's figure / River's (throughput: ≥ 1 is cronoq faster; latency: ≤ 1 is)."""
    return {
        "one_tx": round(ours["one_tx"]["tasks_per_s"] / river["one_tx_tasks_per_s"], 2),
        "each_tx": round(ours["each_tx"]["tasks_per_s"] / river["each_tx_tasks_per_s"], 2),
        "p50_notify": round(ours["notify"]["p50_ms"] / max(river["latency"]["p50_ms"], 0.01), 2),
        "p99_notify": round(ours["notify"]["p99_ms"] / max(river["latency"]["p99_ms"], 0.01), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="PostgreSQL URL (default: a throwaway server started for the run)")
    ap.add_argument("--tasks", type=int, default=1000, help="tasks of the throughput runs")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the throughput runs (the median)")
    ap.add_argument("--rate", type=int, default=50, help="commits per second in the commit → start runs")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="500 tasks, 1 round, 4 s commit → start runs")
    ap.add_argument("--no-river", action="store_true")
    ap.add_argument("--py-spy", metavar="FILE", help="profile the server in the throughput runs (.svg: a flame graph)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    if args.quick:
        args.tasks, args.rounds, args.seconds = 500, 1, 4.0
    with bench_store("postgres", args.url) as url:
        assert url is not None  # bench_store("postgres") yields a server's URL
        result = run_cronoq(url, args)
        result.update(
            tasks=args.tasks, rounds=args.rounds, rate=args.rate, seconds=args.seconds, poll_interval=POLL_INTERVAL
        )
        river = {"skipped": "--no-river"} if args.no_river else run_river(url, args)
    result["river"] = river
    if "skipped" not in river:
        result["ratios"] = ratios(result, river)
    if args.json:
        print(json.dumps(result))
        return
    one, each, notify, poll = result["one_tx"], result["each_tx"], result["notify"], result["poll"]
    line = (
        f"cronoq outbox: one transaction of {args.tasks:,} {one['tasks_per_s']:,} tasks/s (relayed "
        f"{one['relayed_after_s']} s after the commit), {args.tasks:,} transactions of one {each['tasks_per_s']:,} "
        f"tasks/s (relayed {each['relayed_after_s']} s after the last); commit → start p50/p99 "
        f"{notify['p50_ms']}/{notify['p99_ms']} ms with NOTIFY, {poll['p50_ms']}/{poll['p99_ms']} ms polling "
        f"every {POLL_INTERVAL}"
    )
    if "skipped" in river:
        line += f"; River skipped: {river['skipped']}"
    else:
        r = result["ratios"]
        line += (
            f"; River {river['version']}: {river['one_tx_tasks_per_s']:,} / {river['each_tx_tasks_per_s']:,} tasks/s, "
            f"p50/p99 {river['latency']['p50_ms']}/{river['latency']['p99_ms']} ms; cronoq / River "
            f"{r['one_tx']}× / {r['each_tx']}×, p99 {r['p99_notify']}×"
        )
    print(line)


if __name__ == "__main__":
    main()
