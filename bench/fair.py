"""Noisy neighbour: tenant A submits --tasks no-op tasks, one worker process (concurrency 64)
starts draining them, then tenant B submits --late tasks. B's start latency (started_at -
created_at, as the server stored them) and the whole drain rate, in a plain pool and in a pool
with max_running_per_group (--cap) where A and B submit with their group keys; --rounds runs
of each, in turns, and of each the run of the median drain rate is shown.

    python bench/fair.py [--store postgres] [--tasks 20000] [--late 20] [--cap 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _anchor_common import percentile
from _servers import BenchServer, add_store_arguments, bench_store
from burndown import SDK_PREFETCH, run_worker

import cronoq

CONCURRENCY = 64
BATCH = 500


async def submit(endpoint: str, n: int, group: str) -> list[int]:
    ids: list[int] = []
    async with cronoq.Client(endpoint) as client:
        for i in range(0, n, BATCH):
            specs = [cronoq.task_spec("default", b"", group_key=group) for _ in range(min(BATCH, n - i))]
            ids += [t.id for t in (await client.submit_batch(specs)).tasks]
    return ids


async def start_latencies_ms(endpoint: str, ids: list[int]) -> list[float]:
    async with cronoq.Client(endpoint) as client:
        tasks = [await client.get(i) for i in ids]
    return [(t.started_at.ToMicroseconds() - t.created_at.ToMicroseconds()) / 1000 for t in tasks]


def one_run(store_url: str | None, tasks: int, late: int, cap: int) -> dict[str, Any]:
    """cap 0: a plain pool, no group keys."""
    with tempfile.TemporaryDirectory() as tmp:
        pool = f"max_running_per_group = {cap}\n" if cap else ""
        server = BenchServer(Path(tmp), store_url, default_pool=pool)
        try:
            asyncio.run(submit(server.endpoint, tasks, "tenant-a" if cap else ""))
            spawn = mp.get_context("spawn")
            started_at, done_at = spawn.Value("d", 0.0), spawn.Value("d", 0.0)
            worker = spawn.Process(
                target=run_worker,
                args=(server.endpoint, CONCURRENCY, SDK_PREFETCH, tasks + late, started_at, done_at, {}),
            )
            worker.start()
            while not started_at.value:
                time.sleep(0.01)
            time.sleep(0.5)  # A's backlog is being drained
            late_ids = asyncio.run(submit(server.endpoint, late, "tenant-b" if cap else ""))
            worker.join(600)
            drain_s = done_at.value - started_at.value
            latencies = asyncio.run(start_latencies_ms(server.endpoint, late_ids))
        finally:
            server.stop()
    return {
        "b_start_p50_ms": round(percentile(latencies, 50), 1),
        "b_start_p99_ms": round(percentile(latencies, 99), 1),
        "drain_tasks_per_s": round((tasks + late) / drain_s),
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of the median drain rate."""
    return sorted(runs, key=lambda r: r["drain_tasks_per_s"])[len(runs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--late", type=int, default=20)
    ap.add_argument("--cap", type=int, default=CONCURRENCY, help="max_running_per_group of the fair run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, in turns; the median is shown")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_store_arguments(ap)
    args = ap.parse_args()
    runs: dict[int, list[dict[str, Any]]] = {0: [], args.cap: []}
    with bench_store(args.store, args.url) as url:
        for _ in range(args.rounds):  # in turns: the machine's drift falls on both alike
            for cap in runs:
                runs[cap].append(one_run(url, args.tasks, args.late, cap))
    plain, fair = (median_run(runs[cap]) for cap in runs)
    result = {
        "store": args.store,
        "tasks": args.tasks,
        "late": args.late,
        "cap": args.cap,
        "rounds": args.rounds,
        "plain": plain,
        "groups": fair,
        "drain_ratio": round(fair["drain_tasks_per_s"] / plain["drain_tasks_per_s"], 2),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.store}: B's {args.late} tasks behind A's {args.tasks:,}: start p50/p99 "
        f"{plain['b_start_p50_ms']}/{plain['b_start_p99_ms']} ms in a plain pool, "
        f"{fair['b_start_p50_ms']}/{fair['b_start_p99_ms']} ms with group keys (max_running_per_group {args.cap}); "
        f"drain {plain['drain_tasks_per_s']:,} → {fair['drain_tasks_per_s']:,} tasks/s ({result['drain_ratio']}×, "
        f"median of {args.rounds})"
    )


if __name__ == "__main__":
    main()
