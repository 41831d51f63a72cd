"""A workflow's fan-out and join: one root task whose handler spawns --children tasks (10,000 by
default) and a join that depends on all of them, run by one worker process (concurrency 64). Each
child returns its number; the join returns the sum of its dependency results. Printed: the time
from the root's submission to the join's end, the children per second, and the join's lease (its
dependency results) checked against the expected sum.

    python bench/workflow.py [--store postgres] [--children 10000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _servers import BenchServer, add_store_arguments, bench_store

import cronoq


def run_worker(endpoint: str) -> None:
    async def handle(task: cronoq.TaskContext) -> Any:
        job = task.payload
        if "fan_out" in job:
            keys = [f"{job['run']}-{i}" for i in range(job["fan_out"])]
            for i, key in enumerate(keys):
                task.spawn("default", {"n": i}, key=key)
            task.spawn("default", {"join": True}, key=f"{job['run']}-join", depends_on=keys)
            return None
        if "join" in job:
            return sum(task.dependency_results.values())
        return job["n"]

    async def main() -> None:
        await cronoq.Worker(endpoint, "default", handle, concurrency=64).run()

    asyncio.run(main())


async def one_round(endpoint: str, children: int) -> float:
    run = uuid.uuid4().hex[:8]
    async with cronoq.Client(endpoint) as client:
        started = time.perf_counter()
        root = await client.submit("default", {"fan_out": children, "run": run})
        await client.wait(root.task.id, timeout=600)  # the join exists once the root succeeded
        done = await client.wait(f"{run}-join", timeout=600)
        elapsed = time.perf_counter() - started
    expected = children * (children - 1) // 2
    if json.loads(done.task.result) != expected:
        raise SystemExit(f"the join returned {done.task.result!r}, not {expected}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--children", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_store_arguments(ap)
    args = ap.parse_args()
    with bench_store(args.store, args.url) as url, tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp), url, max_batch_size=args.children + 1)
        worker = mp.get_context("spawn").Process(target=run_worker, args=(server.endpoint,), daemon=True)
        worker.start()
        try:
            times = [asyncio.run(one_round(server.endpoint, args.children)) for _ in range(args.rounds)]
        finally:
            worker.terminate()
            worker.join(10)
            server.stop()
    median = statistics.median(times)
    result = {
        "store": args.store,
        "children": args.children,
        "rounds": args.rounds,
        "seconds": [round(t, 2) for t in times],
        "median_s": round(median, 2),
        "children_per_s": round(args.children / median),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.store}: a fan-out of {args.children:,} children and a join, submit to the join's end:"
        f" median {result['median_s']} s of {args.rounds} ({result['children_per_s']:,} children/s)"
    )


if __name__ == "__main__":
    main()
