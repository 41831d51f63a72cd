"""The submit path: cronoq's SubmitBatch and SubmitTask alone (no worker), and River's inserts
beside them on the same PostgreSQL server. Each cronoq part runs on a fresh server (pool
"default"):

- batch: --tasks empty tasks in SubmitBatch calls of 1,000 from one cronoq.Client (the specs
  built before the clock starts; one untimed batch first): tasks/s, and the CPU µs a task
  costs the client (this process), the server and PostgreSQL.
- HTTP batch: the same tasks POSTed as JSON to /v1/batches, 1,000 a request, from one aiohttp
  session: tasks/s.
- single submits, open loop: for each rate R of --rates, for --seconds, call i is due at
  t0 + i/R and is made by client i % C of C cronoq.Client objects (C = --clients, each its own
  channel and TCP connection, unless --one-connection; a client makes its calls one after
  another), one SubmitTask of an empty task; its latency runs from its due time to its answer,
  so a call that starts late behind a saturated server counts its wait (no coordinated
  omission). p50/p90/p99 and the rate answered; the ramp stops after the first rate whose p99
  exceeds 200 ms. The calls are made by a spawned process; by two (each half of the clients)
  once one process spends most of a core (--processes auto).
- River (with --store postgres, unless --no-river): bench/river --workload insert on the same
  server (its own database): InsertMany of --tasks jobs in calls of 1,000, and single
  Client.Insert calls at the same rates from C goroutines by the same due-time rule; its pgx
  pool holds 8 connections, the size of the cronoq server's PostgreSQL pool.

    python bench/submit.py [--store sqlite|postgres] [--url URL] [--tasks 20000]
                           [--rates 500,1000,2000,3000,4000] [--seconds 5] [--clients 64]
                           [--processes auto|1|2] [--one-connection] [--quick] [--no-river] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).parent))

import aiohttp
import anchors
import grpc
from _anchor_common import latency_result, log, percentile
from _servers import BenchServer, add_store_arguments, bench_store, cpu_seconds, postgres_cpu_seconds

import cronoq

T = TypeVar("T")

BATCH = 1000
# The ramp stops after the first rate whose p99 exceeds this.
STOP_P99_MS = 200.0
# The latency a rate must keep to count as sustained.
TARGET_P99_MS = 50.0
# A generator process using this much of a core is the bottleneck itself (--processes auto).
BUSY_CORE = 0.8
# The River client's pgx pool: the cronoq server's PostgreSQL pool_size.
RIVER_MAX_CONNS = 8


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def cpu_now(server: BenchServer, url: str | None) -> dict[str, float]:
    """CPU seconds so far of this process (the client), the server and PostgreSQL (when on it)."""
    spent = {"client": time.process_time(), "server": cpu_seconds(server.proc.pid)}
    postgres = postgres_cpu_seconds(url) if url else None
    if postgres is not None:
        spent["postgres"] = postgres
    return spent


def cpu_us_per(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {k: round((after[k] - before[k]) / n * 1e6, 1) for k in before if k in after}


async def batch_grpc(server: BenchServer, url: str | None, tasks: int) -> dict[str, Any]:
    """tasks empty tasks in SubmitBatch calls of BATCH, after one untimed batch: tasks/s, and
    the CPU µs a task of the timed calls."""
    specs = [cronoq.task_spec("default", b"") for _ in range(BATCH)]
    sizes = [min(BATCH, tasks - done) for done in range(0, tasks, BATCH)]
    async with cronoq.Client(server.endpoint) as client:
        await client.submit_batch(specs)
        before = cpu_now(server, url)
        started = time.perf_counter()
        for n in sizes:
            await client.submit_batch(specs[:n])
        seconds = time.perf_counter() - started
        after = cpu_now(server, url)
    return {"tasks_per_s": round(tasks / seconds), "cpu_us_per_task": cpu_us_per(before, after, tasks)}


async def batch_http(http_url: str, tasks: int) -> float:
    """Seconds for tasks empty tasks POSTed to /v1/batches BATCH a request, after one untimed request."""
    bodies = {n: json.dumps({"tasks": [{"pool": "default"}] * n}).encode() for n in {BATCH, tasks % BATCH or BATCH}}
    sizes = [min(BATCH, tasks - done) for done in range(0, tasks, BATCH)]
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(f"{http_url}/") as session:

        async def post(n: int) -> None:
            async with session.post("v1/batches", data=bodies[n], headers=headers) as resp:
                answer = await resp.json()
                if resp.status != 200 or len(answer["tasks"]) != n:
                    raise RuntimeError(f"POST /v1/batches: {resp.status} {str(answer)[:300]}")

        await post(BATCH)
        started = time.perf_counter()
        for n in sizes:
            await post(n)
        return time.perf_counter() - started


def own_connections() -> None:
    """Every channel this process opens from now on gets a TCP connection of its own: gRPC
    otherwise shares one among the channels of a process that have the same target and options."""
    shared = grpc.aio.insecure_channel

    def insecure_channel(target: str, options: Any = None, *args: Any, **kwargs: Any) -> grpc.aio.Channel:
        return shared(target, [*(options or []), ("grpc.use_local_subchannel_pool", 1)], *args, **kwargs)

    grpc.aio.insecure_channel = insecure_channel


def generate(
    endpoint: str, rate: int, seconds: float, clients: int, part: int, parts: int, shared: bool, conn: Connection
) -> None:
    """A generator process: clients part, part + parts, ... of the open loop (see the module's
    docstring). Sends "ready" once its clients are connected, receives t0 (time.time()), and
    sends back its latencies (s), failures, CPU seconds and the time of its last answer."""
    if not shared:
        own_connections()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        total = int(rate * seconds)
        mine = [cronoq.Client(endpoint) for _ in range(part, clients, parts)]
        await asyncio.gather(*(c.submit("default", b"") for c in mine))  # connects every channel
        conn.send("ready")
        t0_wall = await loop.run_in_executor(None, conn.recv)
        # perf_counter, not loop.time(): uvloop's is libuv's cached clock, in whole milliseconds
        start = time.perf_counter() + (t0_wall - time.time())
        latencies: list[float] = []
        woke_late: list[float] = []  # how late a sleeping caller started: the timer's share of a latency
        failures: list[str] = []

        async def caller(client: cronoq.Client, g: int) -> None:
            for i in range(g, total, clients):
                due = start + i / rate
                if (delay := due - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                    woke_late.append(time.perf_counter() - due)
                try:
                    await client.submit("default", b"")
                except Exception as exc:  # counted and named in the result; the run goes on
                    failures.append(str(exc)[:200])
                latencies.append(time.perf_counter() - due)

        cpu = time.process_time()
        await asyncio.gather(*(caller(c, g) for c, g in zip(mine, range(part, clients, parts), strict=True)))
        ended = time.perf_counter()
        cpu = time.process_time() - cpu
        await asyncio.gather(*(c.close() for c in mine))
        conn.send(
            {
                "latencies": latencies,
                "woke_late": woke_late,
                "failures": failures,
                "cpu_s": cpu,
                "ended_after_s": ended - start,
            }
        )

    run_loop(main())


def open_loop(endpoint: str, rate: int, seconds: float, clients: int, parts: int, shared: bool) -> dict[str, Any]:
    """One rate of the open loop, its calls made by parts spawned processes."""
    spawn = mp.get_context("spawn")  # not a fork: a forked child of a gRPC user can hang
    pipes, procs = [], []
    for part in range(parts):
        ours, theirs = spawn.Pipe()
        proc = spawn.Process(target=generate, args=(endpoint, rate, seconds, clients, part, parts, shared, theirs))
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    try:
        for pipe in pipes:
            if not pipe.poll(120) or pipe.recv() != "ready":
                raise RuntimeError("a generator process did not connect its clients")
        t0 = time.time() + 0.1
        for pipe in pipes:
            pipe.send(t0)
        done = []
        for pipe in pipes:
            if not pipe.poll(seconds + 300):
                raise RuntimeError(f"a generator process did not finish its calls at {rate}/s")
            done.append(pipe.recv())
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    latencies = [x for d in done for x in d["latencies"]]
    failures = [x for d in done for x in d["failures"]]
    if failures:
        log(f"   {len(failures)} call(s) failed at {rate}/s, e.g. {failures[0]}")
    elapsed = max(d["ended_after_s"] for d in done)
    result = latency_result("cronoq", rate, 1, len(latencies) / elapsed, latencies, processes=parts)
    result["failed"] = len(failures)
    woke_late = [x for d in done for x in d["woke_late"]]
    result["woke_late_p50_ms"] = round(percentile(woke_late, 50) * 1000, 2) if woke_late else 0.0
    # The busiest generator's share of a core while it ran.
    result["client_core"] = round(max(d["cpu_s"] / d["ended_after_s"] for d in done), 2)
    return result


def ramp(server: BenchServer, url: str | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The open loop at each rate in turn, until a p99 past STOP_P99_MS."""
    results: list[dict[str, Any]] = []
    parts = 2 if args.processes == "2" else 1
    for rate in args.rates:
        log(f"== cronoq {args.store}: single submits, open loop, {rate}/s for {args.seconds:g} s")
        before = cpu_now(server, url)
        result = open_loop(server.endpoint, rate, args.seconds, args.clients, parts, args.one_connection)
        if args.processes == "auto" and parts == 1 and result["client_core"] >= BUSY_CORE:
            log(f"   one process used {result['client_core']} of a core: again with 2 processes")
            single = result
            before = cpu_now(server, url)
            parts = 2
            result = open_loop(server.endpoint, rate, args.seconds, args.clients, parts, args.one_connection)
            result["one_process"] = {k: single[k] for k in ("achieved_rate", "p50_ms", "p99_ms", "client_core")}
        # the calls are made by the generator processes: this process's CPU is not theirs
        spent = cpu_us_per(before, cpu_now(server, url), result["tasks"])
        result["server_cpu_us"] = spent["server"]
        if "postgres" in spent:
            result["postgres_cpu_us"] = spent["postgres"]
        log(f"   {single_text(result)}")
        results.append(result)
        if result["p99_ms"] > STOP_P99_MS:
            break
    return results


def run_cronoq(url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        log(f"== cronoq {args.store}: SubmitBatch of {BATCH:,}, {args.tasks:,} tasks")
        server = BenchServer(Path(tmp), url)
        try:
            out["batch"] = run_loop(batch_grpc(server, url, args.tasks))
        finally:
            server.stop()
    with tempfile.TemporaryDirectory() as tmp:
        log(f"== cronoq {args.store}: POST /v1/batches of {BATCH:,}, {args.tasks:,} tasks")
        server = BenchServer(Path(tmp), url)
        try:
            out["http_batch"] = {"tasks_per_s": round(args.tasks / run_loop(batch_http(server.http_url, args.tasks)))}
        finally:
            server.stop()
    with tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp), url)
        try:
            out["single"] = ramp(server, url, args)
        finally:
            server.stop()
    return out


def run_river(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """River's figures ({"skipped": why} when it could not run)."""
    log("== River on the same PostgreSQL: InsertMany, single Inserts open loop")
    try:
        river = anchors.run_river(
            url, jobs=args.tasks, max_workers=args.clients, workload="insert", batch=BATCH,
            rates=",".join(map(str, args.rates)), seconds=args.seconds, clients=args.clients,
            stop_p99=f"{STOP_P99_MS:g}ms", max_conns=RIVER_MAX_CONNS,
        )  # fmt: skip
    except (subprocess.SubprocessError, RuntimeError, OSError) as exc:  # e.g. go build without modules
        return {"skipped": f"failed: {str(exc)[-200:]}"}
    if river is None:
        return {"skipped": "no `go` on PATH"}
    river["single"] = [
        {**latency_result("river", r["rate"], 1, r["achieved_rate"], r.pop("latencies")), "failed": r["failed"]}
        for r in river["single"]
    ]
    return river


def sustained(single: list[dict[str, Any]]) -> int:
    """The highest rate of the ramp with p99 within TARGET_P99_MS (0: none)."""
    return max((r["rate"] for r in single if r["p99_ms"] <= TARGET_P99_MS), default=0)


def single_text(r: dict[str, Any]) -> str:
    text = f"p50 {r['p50_ms']} ms, p90 {r['p90_ms']} ms, p99 {r['p99_ms']} ms (achieved {r['achieved_rate']:,}/s" + (
        f", {r['failed']} failed" if r.get("failed") else ""
    )
    if "client_core" in r:
        generator = "one generator process" if r["processes"] == 1 else "2 generator processes, the busier"
        text += f"; {generator} at {r['client_core']} of a core"
    if "one_process" in r:
        one = r["one_process"]
        text += (
            f"; one process alone: achieved {one['achieved_rate']:,}/s, p99 {one['p99_ms']} ms"
            f" at {one['client_core']} of a core"
        )
    if "server_cpu_us" in r:
        text += f"; CPU µs a call: server {r['server_cpu_us']:.0f}"
        if "postgres_cpu_us" in r:
            text += f", PostgreSQL {r['postgres_cpu_us']:.0f}"
    return text + ")"


def rows(store: str, result: dict[str, Any]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The table's rows and ratios of one store's run (bench/run_all.py prints them too)."""
    batch, single = result["batch"], result["single"]
    cpu = batch["cpu_us_per_task"]
    names = {"client": "client", "server": "server", "postgres": "PostgreSQL"}
    cpu_text = ", ".join(f"{names[k]} {v:.1f}" for k, v in cpu.items()) + f" = {sum(cpu.values()):.1f} µs"
    n = f"{result['tasks']:,}"
    out = [
        (f"cronoq {store}: SubmitBatch of {BATCH:,}, {n} tasks, one client", f"{batch['tasks_per_s']:,} tasks/s"),
        (f"cronoq {store}: CPU µs a task in SubmitBatch of {BATCH:,}", cpu_text),
        (
            f"cronoq {store}: POST /v1/batches of {BATCH:,} (JSON), {n} tasks, one aiohttp session",
            f"{result['http_batch']['tasks_per_s']:,} tasks/s",
        ),
    ]
    clients = result["clients"]
    for r in single:
        out.append((f"cronoq {store}: SubmitTask open loop at {r['rate']:,}/s, {clients} clients", single_text(r)))
    at_1000 = next((r for r in single if r["rate"] == 1000), None)
    ratios = [
        (
            f"cronoq {store}: the highest rate with SubmitTask p99 ≤ {TARGET_P99_MS:g} ms",
            f"{sustained(single):,}/s"
            + (f"; p99 at 1,000/s {at_1000['p99_ms']} ms (≤ 20 ms: {at_1000['p99_ms'] <= 20})" if at_1000 else ""),
        )
    ]
    river = result.get("river")
    if river is None:
        return out, ratios
    if "skipped" in river:
        return [*out, ("River: InsertMany, single Inserts", river["skipped"])], ratios
    version = river["version"]
    out.append(
        (
            f"River {version}: InsertMany of {BATCH:,}, {river['jobs']:,} jobs, one client",
            f"{river['batch_jobs_per_s']:,.0f} jobs/s (the client's CPU {river['batch_client_cpu_us']} µs a job)",
        )
    )
    for r in river["single"]:
        out.append(
            (
                f"River {version}: Client.Insert open loop at {r['rate']:,}/s, {river['clients']} goroutines,"
                f" {river['max_conns']} connections",
                single_text(r),
            )
        )
    ratios += [
        (
            f"cronoq {store} SubmitBatch / River InsertMany, calls of {BATCH:,} (target ≥ 0.5×)",
            f"{batch['tasks_per_s'] / river['batch_jobs_per_s']:.2f}×",
        ),
        (
            f"the highest rate with p99 ≤ {TARGET_P99_MS:g} ms, cronoq {store} / River",
            f"{sustained(single):,}/s / {sustained(river['single']):,}/s",
        ),
    ]
    return out, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(ap)
    ap.add_argument("--tasks", type=int, default=20_000, help="tasks of the batch runs")
    ap.add_argument("--rates", default="500,1000,2000,3000,4000", help="rates (calls/s) of the open loop, in order")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of each rate")
    ap.add_argument("--clients", type=int, default=64, help="clients (and River's goroutines) of the open loop")
    ap.add_argument(
        "--processes", choices=("auto", "1", "2"), default="auto", help="generator processes of the open loop"
    )
    ap.add_argument(
        "--one-connection",
        action="store_true",
        help="the open loop's clients of a process share one connection (gRPC's way) rather than one each",
    )
    ap.add_argument("--quick", action="store_true", help="5,000 tasks, rates 500,1000,2000 for 2 s")
    ap.add_argument("--no-river", action="store_true")
    ap.add_argument("--json", action="store_true", help="also print one JSON line")
    args = ap.parse_args()
    if args.quick:
        args.tasks, args.rates, args.seconds = 5000, "500,1000,2000", 2.0
    try:
        args.rates = [int(r) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates: {args.rates!r} is not a comma-separated list of integers")
    if args.tasks <= 0 or args.clients <= 0 or args.seconds <= 0 or min(args.rates) <= 0:
        ap.error("--tasks, --clients, --seconds and every rate must be positive")
    with bench_store(args.store, args.url) as url:
        result: dict[str, Any] = {
            "store": args.store,
            "tasks": args.tasks,
            "clients": args.clients,
            "connections": "shared" if args.one_connection else "one per client",
        }
        result.update(run_cronoq(url, args))
        if url is not None and not args.no_river:
            result["river"] = run_river(url, args)
    out, ratios = rows(args.store, result)
    print("\n| run | result |\n|---|---|")
    for title, text in out + ratios:
        print(f"| {title} | {text} |")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
