"""A Python worker and client against a cronoq server: it submits a few tasks to a pool, runs a
worker for them, waits for each and prints how it ended; Ctrl-C stops it gracefully.

    python examples/worker.py --endpoint http://127.0.0.1:7070 --pool default

The endpoint and token also come from CRONOQ_ENDPOINT and CRONOQ_TOKEN.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

import cronoq


async def handle(task: cronoq.TaskContext) -> object:
    """Doubles n; "broken" fails for good, "flaky" fails its first two attempts."""
    job = task.payload
    if job["kind"] == "broken":
        raise cronoq.TaskError("broken input: will not retry", retryable=False)
    if job["kind"] == "flaky" and task.attempt < 3:
        raise cronoq.TaskError(f"flaky failure on attempt {task.attempt}", retry_after=0.2)
    await asyncio.sleep(0.05)  # some work; a cancellation of the task cancels it here
    return {"doubled": job["n"] * 2}


async def main(endpoint: str, pool: str) -> None:
    token = os.environ.get("CRONOQ_TOKEN")
    async with cronoq.Client(endpoint, token=token) as client:
        ids = []
        for kind, n in (("double", 21), ("flaky", 4), ("broken", 0)):
            submitted = await client.submit(pool, {"kind": kind, "n": n}, max_attempts=5)
            print(f"submitted task {submitted.task.id} ({kind})")
            ids.append(submitted.task.id)

        worker = cronoq.Worker(endpoint, pool, handle, concurrency=8, token=token)
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, worker.stop)
        running = asyncio.create_task(worker.run())
        for task_id in ids:
            task = (await client.wait(task_id, timeout=30)).task
            state = cronoq.TaskState.Name(task.state).removeprefix("TASK_STATE_")
            if task.state == cronoq.TaskState.TASK_STATE_SUCCEEDED:
                print(f"task {task_id}: {state} after {task.attempt} attempt(s): {cronoq.result_of(task)}")
            else:
                print(f"task {task_id}: {state} after {task.attempt} attempt(s): {task.error}")
        worker.stop()  # a graceful stop: running tasks finish, the others are given back
        await running


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", default=os.environ.get("CRONOQ_ENDPOINT", "http://127.0.0.1:7070"))
    ap.add_argument("--pool", default="default")
    args = ap.parse_args()
    asyncio.run(main(args.endpoint, args.pool))
