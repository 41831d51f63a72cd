"""What one lease costs as the number of keys of a keyed resource grows: --per-key tasks (10) of
each of 50, 1,000 and 10,000 keys, submitted key by key, of a keyed resource with one slot per
key (per_key, concurrency 1). One worker takes a task of every key and holds it, so that every
key is at its limit; then this script times --leases (100) leases of --batch (64) that find
nothing (every key's backlog waits); then the holder finishes, and it times as many leases
that each take up to --batch tasks (finished, not timed), every key having room. Printed per
number of keys: both leases' p50/p99.

    python bench/keyed_lease_cost.py [--store postgres] [--per-key 10] [--leases 100] [--batch 64]
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
from lease_cost import SETTLE_S, SUBMIT_BATCH, WARM_UP

from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import task_service_pb2_grpc, worker_service_pb2_grpc
from cronoq.v1 import worker_service_pb2 as wpb

KEYS = (50, 1_000, 10_000)
CONFIG = '[[resources]]\nname = "conn"\nconcurrency = 1\nper_key = true\n'


async def timed(keys: int, per_key: int, leases: int, batch: int, endpoint: str) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(endpoint.removeprefix("http://")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        workers = worker_service_pb2_grpc.WorkerServiceStub(channel)
        specs = [
            tpb.SubmitTaskRequest(pool="default", resources={f"conn:k{k:06d}": 1})
            for k in range(keys)
            for _ in range(per_key)
        ]
        for i in range(0, len(specs), SUBMIT_BATCH):
            await tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=specs[i : i + SUBMIT_BATCH]))

        async def register(name: str) -> str:
            reply = await workers.RegisterWorker(wpb.RegisterWorkerRequest(name=name, pools=["default"]))
            return str(reply.worker_id)

        async def lease(worker: str, n: int) -> list[Any]:
            return list((await workers.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker, max_tasks=n))).tasks)

        async def finish(worker: str, leased: list[Any]) -> None:
            done = [wpb.TaskOutcome(task_id=t.id, attempt=t.attempt, success=wpb.TaskSuccess()) for t in leased]
            await workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=done))

        holder, timer = await register("holder"), await register("timer")
        held: list[Any] = []
        while len(held) < keys:  # one task of each key: every key at its limit
            held += await lease(holder, 1000)
        await asyncio.sleep(SETTLE_S)
        result: dict[str, Any] = {}
        for case in ("at_limit", "with_room"):
            took: list[float] = []
            for i in range(WARM_UP + leases):
                started = time.perf_counter()
                leased = await lease(timer, batch)
                if i >= WARM_UP:
                    took.append((time.perf_counter() - started) * 1000)
                assert case == "with_room" or not leased, f"a key at its limit gave {len(leased)} task(s)"
                await finish(timer, leased)
            result[case] = {"p50_ms": round(percentile(took, 50), 2), "p99_ms": round(percentile(took, 99), 2)}
            await finish(holder, held)  # every key has room again
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--per-key", type=int, default=10)
    ap.add_argument("--leases", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_store_arguments(ap)
    args = ap.parse_args()
    result: dict[str, Any] = {"store": args.store, "per_key": args.per_key, "batch": args.batch}
    with bench_store(args.store, args.url) as url:
        for keys in KEYS:
            print(f"   {keys:,} keys", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                server = BenchServer(Path(tmp), url, extra_config=CONFIG, default_pool='lease_ttl = "10m"\n')
                try:
                    result[str(keys)] = asyncio.run(timed(keys, args.per_key, args.leases, args.batch, server.endpoint))
                finally:
                    server.stop()
    if args.json:
        print(json.dumps(result))
        return
    print(keyed_lease_text(result))


def keyed_lease_text(r: dict[str, Any]) -> str:
    """Per number of keys: a lease while every key is at its limit, and one of batch tasks."""
    shown = []
    for keys in KEYS:
        at, room = r[str(keys)]["at_limit"], r[str(keys)]["with_room"]
        shown.append(f"{keys:,}: {at['p50_ms']}/{at['p99_ms']} and {room['p50_ms']}/{room['p99_ms']}")
    return (
        f"{r['store']}: keys with {r['per_key']} tasks each, p50/p99 ms of a lease while every key is at its "
        f"limit and of a lease of {r['batch']} while every key has room: " + "; ".join(shown)
    )


if __name__ == "__main__":
    main()
