"""A bulk action on many tasks while another caller works: what the bulk call costs that caller.

--tasks tasks (50,000 by default) are made FAILED (submitted in batches with max_attempts 1,
leased and failed in batches of 1,000 by this script acting as a worker), or left PENDING for
--action cancel. Then another caller's GetTask and SubmitTask, one at a time, are timed while
nothing else runs (quiet), and again while one RetryTasks (or CancelTasks) call acts on every
one of those tasks (repeated while it answers incomplete). Printed: the bulk's time, and the
caller's p50/p99 quiet and during the bulk, with the p99 ratio.

    python bench/bulk.py [--store postgres] [--tasks 50000] [--action retry|cancel]
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

from cronoq.v1 import task_pb2, task_service_pb2_grpc, worker_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

BATCH = 1000
QUIET_S = 10.0  # the quiet p99 is the yardstick: long enough to be steady


async def make_tasks(tasks: Any, workers: Any, total: int, fail: bool) -> None:
    """total tasks in pool default: PENDING, or (fail) FAILED after their one attempt."""
    for done in range(0, total, BATCH):
        n = min(BATCH, total - done)
        await tasks.SubmitBatch(
            tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="default", max_attempts=1)] * n)
        )
    if not fail:
        return
    worker = (await workers.RegisterWorker(wpb.RegisterWorkerRequest(name="bench", pools=["default"]))).worker_id
    failed = 0
    while failed < total:
        leased = (await workers.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker, max_tasks=BATCH))).tasks
        outcomes = [
            wpb.TaskOutcome(task_id=t.id, attempt=t.attempt, failure=wpb.TaskFailure(error="downstream API down"))
            for t in leased
        ]
        await workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=outcomes))
        failed += len(leased)
    await workers.DeregisterWorker(wpb.DeregisterWorkerRequest(worker_id=worker))


async def probe(tasks: Any, task_id: int, until: asyncio.Future[Any] | float) -> list[float]:
    """ms of GetTask and SubmitTask calls, alternately, one at a time: for `until` seconds, or
    until that future is done."""
    took: list[float] = []
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + until if isinstance(until, float) else None
    get = tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task_id))
    submit = tpb.SubmitTaskRequest(pool="probe", payload=b"x" * 256)
    while (loop.time() < stop_at) if stop_at is not None else not until.done():  # type: ignore[union-attr]
        for call, req in ((tasks.GetTask, get), (tasks.SubmitTask, submit)):
            started = time.perf_counter()
            await call(req)
            took.append((time.perf_counter() - started) * 1000)
    return took


def figures(took: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(took, 50), 2), "p99_ms": round(percentile(took, 99), 2), "calls": len(took)}


async def run(endpoint: str, total: int, action: str) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(endpoint.removeprefix("http://")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        workers = worker_service_pb2_grpc.WorkerServiceStub(channel)
        started = time.perf_counter()
        await make_tasks(tasks, workers, total, fail=action == "retry")
        made_s = time.perf_counter() - started
        print(f"   {total:,} tasks made in {made_s:.1f} s", file=sys.stderr, flush=True)
        mine = (await tasks.SubmitTask(tpb.SubmitTaskRequest(pool="probe"))).task.id
        await probe(tasks, mine, 0.5)  # warm up
        quiet = await probe(tasks, mine, QUIET_S)
        states = [task_pb2.TASK_STATE_FAILED] if action == "retry" else [task_pb2.TASK_STATE_PENDING]
        f = tpb.TaskFilter(pool="default", states=states)

        async def bulk_until_complete() -> tuple[int, int, int]:
            """The bulk call, repeated while it answers incomplete: (calls, matched first, changed)."""
            calls, first, changed = 0, -1, 0
            while True:
                if action == "retry":
                    answer = await tasks.RetryTasks(tpb.RetryTasksRequest(filter=f), timeout=600)
                else:
                    answer = await tasks.CancelTasks(tpb.CancelTasksRequest(filter=f), timeout=600)
                calls, changed = calls + 1, changed + answer.changed
                first = answer.matched if first < 0 else first
                if not answer.incomplete:
                    return calls, first, changed

        started = time.perf_counter()
        bulk = asyncio.ensure_future(bulk_until_complete())
        during = await probe(tasks, mine, bulk)
        calls, _, changed = await bulk
        bulk_s = time.perf_counter() - started
    result = {
        "action": action,
        "tasks": total,
        "calls": calls,
        "changed": changed,
        "bulk_s": round(bulk_s, 2),
        "quiet": figures(quiet),
        "during": figures(during),
    }
    result["p99_ratio"] = round(result["during"]["p99_ms"] / result["quiet"]["p99_ms"], 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tasks", type=int, default=50_000)
    ap.add_argument("--action", choices=["retry", "cancel"], default="retry")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_store_arguments(ap)
    args = ap.parse_args()
    with bench_store(args.store, args.url) as url, tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp), url, extra_pools=("probe",))
        try:
            result = asyncio.run(run(server.endpoint, args.tasks, args.action))
        finally:
            server.stop()
    result["store"] = args.store
    if args.json:
        print(json.dumps(result))
        return
    q, d = result["quiet"], result["during"]
    print(
        f"{args.store}: {args.action} of {result['changed']:,} tasks in {result['bulk_s']} s "
        f"({result['calls']} call(s)); "
        f"another caller's GetTask/SubmitTask p50 {q['p50_ms']} → {d['p50_ms']} ms, "
        f"p99 {q['p99_ms']} → {d['p99_ms']} ms ({result['p99_ratio']}× quiet)"
    )


if __name__ == "__main__":
    main()
