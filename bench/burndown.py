"""Burn-down: N no-op tasks submitted in batches, then drained by one worker process.

python bench/burndown.py [--tasks 20000] [--concurrency 64] [--prefetch 0] [--batch 500] [--resource-capacity N]
                         [--worker go] [--dashboard overview|live]

With --prefetch N, the worker holds up to N leased tasks beyond its concurrency (every SDK's worker).
With --resource-capacity, every task asks for one slot of a concurrency resource of that capacity.
With --groups N, the pool caps its groups (max_running_per_group --group-cap, 1000 by default)
and the tasks are spread over N group keys in turn.
With --worker go, ts or rust, the worker is the Go SDK's (bench/go-worker, built with the `go` on
PATH), the TypeScript SDK's (bench/ts-worker, run with the `node` on PATH) or the Rust SDK's
(sdk-rust's example bench_drain, built with the `cargo` on PATH).
With --dashboard, one dashboard page (the overview, which re-reads the snapshot every 5 s, or the
live view, which streams every event) is open in headless Chromium from before the submissions
to the end of the drain (bench/_dashboard_page.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _servers import BenchServer, add_store_arguments, bench_store, cpu_seconds, postgres_cpu_seconds

import cronoq

# run_worker's prefetch that leaves the SDK's default (every SDK's --prefetch -1 too).
SDK_PREFETCH = -1


def run_worker(
    endpoint: str,
    concurrency: int,
    prefetch: int,
    total: int,
    started_at: mp.Value,  # type: ignore[type-arg]
    done_at: mp.Value,  # type: ignore[type-arg]
    options: dict[str, Any],
    spent: Any = None,  # mp.Array("d", 2): the CPU seconds of the drain, the peak RSS in KiB
) -> None:
    # The SDK's modules loaded first (cronoq imports its worker on first use), as a Go or Rust
    # worker's code is loaded with its binary: the clock starts with the process ready to connect.
    worker_class = cronoq.Worker

    async def main() -> None:
        # The process is up and about to connect: where the anchors' workers start their clock.
        started_at.value = time.time()
        cpu_start = time.process_time()
        count = 0

        async def noop(task: cronoq.TaskContext) -> None:
            nonlocal count
            count += 1
            if count >= total:
                done_at.value = time.time()
                if spent is not None:
                    spent[0] = time.process_time() - cpu_start
                    spent[1] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                worker.stop()

        worker = worker_class(
            endpoint, "default", noop, concurrency=concurrency, prefetch=None if prefetch < 0 else prefetch, **options
        )
        await worker.run()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


GO_WORKER = Path(__file__).parent / "go-worker"


ROOT = Path(__file__).parent.parent


def run_sdk_worker(sdk: str, endpoint: str, concurrency: int, prefetch: int, total: int) -> tuple[float, float]:
    """Another SDK's worker drains the tasks (bench/go-worker, bench/ts-worker, sdk-rust's
    example bench_drain): (seconds from its start, from the spawn)."""
    flags = {"endpoint": endpoint, "tasks": str(total), "concurrency": str(concurrency)}
    if prefetch >= 0:  # else the SDK's default
        flags["prefetch"] = str(prefetch)
    if sdk == "rust":
        manifest = ROOT / "sdk-rust" / "Cargo.toml"
        build = [
            "cargo",
            "build",
            "--release",
            "--locked",
            "--manifest-path",
            str(manifest),
            "--example",
            "bench_drain",
        ]
        subprocess.run(build, check=True)
        cmd = [str(ROOT / "sdk-rust" / "target" / "release" / "examples" / "bench_drain"), *flags.values()]
    elif sdk == "go":
        subprocess.run(["go", "-C", str(GO_WORKER), "build", "-o", "go-worker", "."], check=True)
        cmd = [str(GO_WORKER / "go-worker"), *(x for k, v in flags.items() for x in (f"-{k}", v))]
    else:  # tsx is a dev dependency of sdk-ts
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=ROOT / "sdk-ts", check=True)
        main_ts = str(ROOT / "bench" / "ts-worker" / "main.ts")
        cmd = ["node", "--import", "tsx", main_ts, *(x for k, v in flags.items() for x in (f"--{k}", v))]
    spawned = time.time()
    out = subprocess.run(cmd, cwd=ROOT / "sdk-ts", check=True, stdout=subprocess.PIPE, text=True, timeout=600).stdout
    return json.loads(out)["drain_s"], time.time() - spawned


async def submit_all(
    endpoint: str,
    total: int,
    batch: int,
    options: dict[str, Any],
    resources: dict[str, int],
    pool: str = "default",
    groups: int = 0,
) -> float:
    started = time.perf_counter()
    async with cronoq.Client(endpoint, **options) as client:
        for i in range(0, total, batch):
            n = min(batch, total - i)
            specs = [
                cronoq.task_spec(pool, b"", resources=resources, group_key=f"g{(i + j) % groups}" if groups else "")
                for j in range(n)
            ]
            await client.submit_batch(specs)
            print(f"\rsubmitted {i + n}/{total} ({pool})", end="", file=sys.stderr)
    print(file=sys.stderr)
    return time.perf_counter() - started


async def wait_all_done(endpoint: str, total: int, options: dict[str, Any]) -> int:
    async with cronoq.Client(endpoint, **options) as client:
        n = 0
        async for _ in client.iter_tasks(state=cronoq.TaskState.Value("TASK_STATE_SUCCEEDED"), page_size=1000):
            n += 1
        return n


def open_page(http_url: str, view: str) -> subprocess.Popen[str]:
    page = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_dashboard_page.py")), http_url, view],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert page.stdout is not None
    if page.stdout.readline().strip() != "ready":
        page.kill()
        raise RuntimeError(f"the dashboard page ({view}) did not open")
    return page


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument(
        "--prefetch",
        type=int,
        default=SDK_PREFETCH,
        help="tasks the worker holds beyond its concurrency (-1: its SDK's default)",
    )
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--secure", action="store_true", help="TLS on both sides and a bearer token")
    ap.add_argument(
        "--resource-capacity", type=int, default=0, help="every task takes a slot of a resource of this capacity"
    )
    ap.add_argument(
        "--worker", choices=("python", "go", "ts", "rust"), default="python", help="the SDK whose worker drains"
    )
    ap.add_argument("--dashboard", choices=("overview", "live"), help="a dashboard page open meanwhile")
    ap.add_argument("--groups", type=int, default=0, help="spread the tasks over this many group keys")
    ap.add_argument("--group-cap", type=int, default=1000, help="the pool's max_running_per_group with --groups")
    add_store_arguments(ap)
    args = ap.parse_args()
    if args.worker != "python" and args.secure:
        ap.error(f"--worker {args.worker} runs without --secure")
    resources: dict[str, int] = {}
    extra = ""
    if args.resource_capacity:
        resources = {"slots": 1}
        extra = f'[[resources]]\nname = "slots"\nconcurrency = {args.resource_capacity}\n'
    with bench_store(args.store, args.url) as url, tempfile.TemporaryDirectory() as tmp:
        pool = f"max_running_per_group = {args.group_cap}\n" if args.groups else ""
        server = BenchServer(Path(tmp), url, secure=args.secure, extra_config=extra, default_pool=pool)
        options = server.client_options
        page = None
        try:
            if args.dashboard:
                page = open_page(server.http_url, args.dashboard)
            submit_s = asyncio.run(
                submit_all(server.endpoint, args.tasks, args.batch, options, resources, groups=args.groups)
            )
            cpu_us: dict[str, float] = {}
            worker_rss_mib = 0.0
            if args.worker != "python":
                drain_s, from_spawn = run_sdk_worker(
                    args.worker, server.endpoint, args.concurrency, args.prefetch, args.tasks
                )
            else:
                # A spawned process, not a fork: a child forked after this process used gRPC can
                # hang creating its channel (it did, once in a few runs).
                spawn = mp.get_context("spawn")
                started_at, done_at = spawn.Value("d", 0.0), spawn.Value("d", 0.0)
                spent = spawn.Array("d", 2)
                proc = spawn.Process(
                    target=run_worker,
                    args=(
                        server.endpoint,
                        args.concurrency,
                        args.prefetch,
                        args.tasks,
                        started_at,
                        done_at,
                        options,
                        spent,
                    ),
                )
                before = cpu_seconds(server.proc.pid), postgres_cpu_seconds(url) if url else None
                spawned_at = time.time()
                proc.start()
                proc.join(600)
                drain_s, from_spawn = done_at.value - started_at.value, done_at.value - spawned_at
                after = cpu_seconds(server.proc.pid), postgres_cpu_seconds(url) if url else None
                # CPU µs per task during the drain (from the worker's spawn to its end): what
                # the server, PostgreSQL and the worker each spent.
                per_task = {"server": (after[0] - before[0]) / args.tasks * 1e6, "worker": spent[0] / args.tasks * 1e6}
                if before[1] is not None and after[1] is not None:
                    per_task["postgres"] = (after[1] - before[1]) / args.tasks * 1e6
                cpu_us = {k: round(v, 1) for k, v in per_task.items()}
                worker_rss_mib = round(spent[1] / 1024, 1)
            succeeded = asyncio.run(wait_all_done(server.endpoint, args.tasks, options))
        finally:
            if page is not None:
                page.stdin.close()  # type: ignore[union-attr]
                page.wait(30)
            server.stop()
    result = {
        "store": args.store,
        "dashboard": args.dashboard or "",
        "worker": args.worker,
        "secure": args.secure,
        "resource_capacity": args.resource_capacity,
        "groups": args.groups,
        "tasks": args.tasks,
        "submit_tasks_per_s": round(args.tasks / submit_s),
        "drain_tasks_per_s": round(args.tasks / drain_s),
        "drain_s": round(drain_s, 2),
        "drain_s_from_spawn": round(from_spawn, 2),
        "succeeded": succeeded,
        "concurrency": args.concurrency,
        "prefetch": args.prefetch,
        "cpu_us_per_task": cpu_us,
        "worker_rss_mib": worker_rss_mib,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.store} burn-down: submitted {args.tasks} in {submit_s:.2f}s "
        f"({args.tasks / submit_s:,.0f} tasks/s, batches of {args.batch})"
    )
    print(
        f"{args.store} burn-down: drained {args.tasks} in {drain_s:.2f}s = {args.tasks / drain_s:,.0f} tasks/s "
        f"(one worker process, concurrency {args.concurrency},"
        f" prefetch {args.prefetch}, from the process's start as the anchors time it;"
        f" {from_spawn:.2f}s from the spawn; the {args.worker} SDK's worker); succeeded={succeeded}"
    )
    if cpu_us:
        spent_text = ", ".join(f"{k} {v} µs" for k, v in cpu_us.items())
        print(f"{args.store} burn-down: CPU per task during the drain: {spent_text}")
        print(f"{args.store} burn-down: the worker's peak RSS: {worker_rss_mib} MiB")


if __name__ == "__main__":
    main()
