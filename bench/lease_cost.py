"""What one lease costs as the number of groups grows: --tasks tasks (100,000 by default) spread
in turns over 1, 100, 10,000 and 100,000 group keys, in a pool with max_running_per_group 1000
(the fair lease, the cap never reached); then, once the server has settled (5 s), this script,
as one worker, times LeaseTasks of --batch tasks (64) and finishes them (FinishTasks, not
timed), --leases times (300) after 10 untimed. Printed per
number of groups: the lease's p50/p99 and its p50 against the one-group case; and the same leases
in a plain pool (no groups) as the yardstick.

    python bench/lease_cost.py [--store postgres] [--tasks 100000] [--leases 300] [--batch 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import grpc
from _anchor_common import percentile
from _servers import BenchServer, add_store_arguments, bench_store

from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import task_service_pb2_grpc, worker_service_pb2_grpc
from cronoq.v1 import worker_service_pb2 as wpb

SUBMIT_BATCH = 1000
# The leases are timed once the submissions' aftermath is over (their events sequenced, the
# store's statistics caught up), after a few untimed ones.
SETTLE_S = 5.0
WARM_UP = 10
GROUPS = (1, 100, 10_000, 100_000)


async def timed_leases(endpoint: str, total: int, groups: int, leases: int, batch: int) -> dict[str, float]:
    """Submits total tasks over groups keys (0: none), then times leases of batch tasks."""
    async with grpc.aio.insecure_channel(endpoint.removeprefix("http://")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        workers = worker_service_pb2_grpc.WorkerServiceStub(channel)
        for done in range(0, total, SUBMIT_BATCH):
            specs = [
                tpb.SubmitTaskRequest(pool="default", group_key=f"g{(done + i) % groups}" if groups else "")
                for i in range(min(SUBMIT_BATCH, total - done))
            ]
            await tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=specs))
        worker = (await workers.RegisterWorker(wpb.RegisterWorkerRequest(name="bench", pools=["default"]))).worker_id
        await asyncio.sleep(SETTLE_S)
        took: list[float] = []
        for i in range(WARM_UP + leases):
            started = time.perf_counter()
            leased = (await workers.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker, max_tasks=batch))).tasks
            if i >= WARM_UP:
                took.append((time.perf_counter() - started) * 1000)
            outcomes = [wpb.TaskOutcome(task_id=t.id, attempt=t.attempt, success=wpb.TaskSuccess()) for t in leased]
            await workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=outcomes))
    return {"p50_ms": round(percentile(took, 50), 2), "p99_ms": round(percentile(took, 99), 2)}


def one_run(url: str | None, total: int, groups: int, leases: int, batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        pool = "max_running_per_group = 1000\n" if groups else ""
        server = BenchServer(Path(tmp), url, default_pool=pool)
        try:
            return asyncio.run(timed_leases(server.endpoint, total, groups, leases, batch))
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tasks", type=int, default=100_000)
    ap.add_argument("--leases", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_store_arguments(ap)
    args = ap.parse_args()
    result: dict[str, Any] = {"store": args.store, "tasks": args.tasks, "batch": args.batch}
    counts = sorted({min(g, args.tasks) for g in GROUPS})
    with bench_store(args.store, args.url) as url:
        result["plain"] = one_run(url, args.tasks, 0, args.leases, args.batch)
        for groups in counts:
            print(f"   {groups:,} group(s)", file=sys.stderr, flush=True)
            result[str(groups)] = one_run(url, args.tasks, groups, args.leases, args.batch)
    worst = max(result[str(g)]["p50_ms"] for g in counts)
    result["worst_vs_one_group"] = round(worst / result["1"]["p50_ms"], 2)
    if args.json:
        print(json.dumps(result))
        return
    shown = ", ".join(f"{g:,}: {result[str(g)]['p50_ms']}/{result[str(g)]['p99_ms']}" for g in counts)
    print(
        f"{args.store}: a lease of {args.batch} from {args.tasks:,} tasks, p50/p99 ms by number of groups: {shown} "
        f"(worst p50 {result['worst_vs_one_group']}× the one-group case); plain pool "
        f"{result['plain']['p50_ms']}/{result['plain']['p99_ms']}"
    )


if __name__ == "__main__":
    main()
