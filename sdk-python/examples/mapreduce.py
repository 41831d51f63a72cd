"""A map-reduce workflow: a root task's handler spawns 100 map tasks, each returning a number,
and a join that depends on them all and returns their sum. This script submits the root, runs
a worker until the join has ended, prints the sum, and exits 0 (1 if the workflow failed).

    python examples/mapreduce.py --endpoint http://127.0.0.1:7070 --pool default

The endpoint and token also come from CRONOQ_ENDPOINT and CRONOQ_TOKEN.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import uuid

import cronoq

MAP_TASKS = 100


async def handle(ctx: cronoq.TaskContext) -> object:
    step = ctx.payload["step"]
    if step == "root":
        # Spawned with the root's success, in one transaction; keys let the join name the maps.
        maps = [f"{ctx.key}-map-{i}" for i in range(1, MAP_TASKS + 1)]
        for i, key in enumerate(maps, start=1):
            ctx.spawn(ctx.pool, {"step": "map", "n": i}, key=key)
        ctx.spawn(ctx.pool, {"step": "join"}, key=f"{ctx.key}-join", depends_on=maps)
        return {"maps": len(maps)}
    if step == "map":
        return ctx.payload["n"]
    return sum(ctx.dependency_results.values())  # the join: every map's result, by task id


async def wait_ended(client: cronoq.Client, ref: int | str) -> cronoq.Task:
    while True:
        waited = await client.wait(ref, timeout=30)
        if waited.done:
            return waited.task


async def main(endpoint: str, pool: str) -> int:
    token = os.environ.get("CRONOQ_TOKEN")
    root_key = f"mapreduce-{uuid.uuid4().hex[:12]}"
    async with cronoq.Client(endpoint, token=token) as client:
        root = (await client.submit(pool, {"step": "root"}, key=root_key)).task
        print(f"submitted task {root.id} ({root_key}): {MAP_TASKS} map tasks and a join")
        worker = cronoq.Worker(endpoint, pool, handle, concurrency=32, token=token)
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, worker.stop)
        running = asyncio.create_task(worker.run())
        try:
            ended = await wait_ended(client, root.id)
            if ended.state == cronoq.TaskState.TASK_STATE_SUCCEEDED:
                ended = await wait_ended(client, f"{root_key}-join")  # spawned: it exists now
        finally:
            worker.stop()  # a graceful stop: running tasks finish, the others are given back
            await running
    if ended.state != cronoq.TaskState.TASK_STATE_SUCCEEDED:
        print(f"task {ended.id} ended {cronoq.TaskState.Name(ended.state)}: {ended.error}", file=sys.stderr)
        return 1
    print(f"sum of {MAP_TASKS} children: {cronoq.result_of(ended)}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", default=os.environ.get("CRONOQ_ENDPOINT", "http://127.0.0.1:7070"))
    ap.add_argument("--pool", default="default")
    args = ap.parse_args()
    sys.exit(asyncio.run(main(args.endpoint, args.pool)))
