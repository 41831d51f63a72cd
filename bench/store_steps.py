"""What a task's Work steps cost PostgreSQL, the store alone: no server, no gRPC, no worker.

--tasks plain tasks (20,000) are submitted in batches of 500 to a fresh schema; then this process,
as one worker, drains them through the store as a Work step does: finish what it holds and lease
--step more (32, about what a step of a worker at concurrency 64 carries), in one statement, one
after the other. Printed: PostgreSQL's CPU µs per task during the drain (postmaster, backends and
background processes, from /proc) and the drain's wall µs per task. The quietest figure of what
the store's statements cost: the end-to-end burn-down moves with the server's and the worker's
share of the machine.

    python bench/store_steps.py [--tasks 20000] [--step 32] [--url postgresql://…]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _servers import bench_store, postgres_cpu_seconds

from cronoq_server.store.base import NewTask, Outcome, OutcomeKind, StoreSettings
from cronoq_server.store.postgres import PostgresStore

T0 = 1_700_000_000_000_000
POOL = "default"


async def drain(url: str, tasks: int, step: int) -> dict[str, float]:
    settings = StoreSettings(
        shard_name="unsharded",
        shard_number=0,
        lease_ttl_us={POOL: 60_000_000},
        retention_us={POOL: 3_600_000_000},
        retry_at=lambda pool, attempt, now, after_ms: now + 1_000_000,
    )
    store = PostgresStore(url, f"steps_{uuid.uuid4().hex[:10]}", settings)
    await store.open()
    try:
        for first in range(0, tasks, 500):
            batch = [NewTask(POOL, None, b"", "", 0, None, 3) for _ in range(min(500, tasks - first))]
            await store.submit(batch, T0)
        await store.expire_leases(T0)  # the sweep has run: successes take the fast path
        await asyncio.sleep(0.5)  # the background writer and the WAL writer settle
        cpu, started = postgres_cpu_seconds(url), time.perf_counter()
        held, _ = await store.lease("w1", [POOL], step, T0)
        n = 0
        while held:
            n += 1
            outcomes = [Outcome(t.seq, t.attempt, OutcomeKind.SUCCESS) for t in held]
            _, _, held, _ = await store.finish_and_lease("w1", outcomes, [POOL], step, T0 + n)
        wall, cpu_after = time.perf_counter() - started, postgres_cpu_seconds(url)
        assert cpu is not None and cpu_after is not None, "PostgreSQL's CPU is read from /proc: a local server"
        return {
            "postgres_cpu_us_per_task": round((cpu_after - cpu) / tasks * 1e6, 1),
            "wall_us_per_task": round(wall / tasks * 1e6, 1),
            "steps": n,
        }
    finally:
        await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=20000)
    ap.add_argument("--step", type=int, default=32, help="tasks a step finishes and leases")
    ap.add_argument("--url", help="PostgreSQL URL (default: a throwaway server started for the run)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    with bench_store("postgres", args.url) as url:
        assert url is not None
        out = asyncio.run(drain(url, args.tasks, args.step))
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"store alone, {args.tasks} tasks in steps of {args.step}: PostgreSQL {out['postgres_cpu_us_per_task']} µs"
            f" of CPU a task, {out['wall_us_per_task']} µs of wall a task ({out['steps']} steps)"
        )


if __name__ == "__main__":
    main()
