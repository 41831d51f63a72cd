"""The demo's worker, in its own process: `python examples/demo_worker.py ENDPOINT`."""

import asyncio
import signal
import sys

import cronoq


async def handle(task: cronoq.TaskContext) -> object:
    job = task.payload
    kind = job.get("kind")
    if kind == "flaky" and task.attempt < 3:
        raise cronoq.TaskError(f"flaky failure on attempt {task.attempt}", retry_after=0.2)
    if kind == "broken":
        raise cronoq.TaskError("broken input: will not retry", retryable=False)
    if kind == "slow":
        await asyncio.sleep(job.get("seconds", 1))
    return {"echo": job, "attempt": task.attempt}


async def main() -> None:
    worker = cronoq.Worker(sys.argv[1], "default", handle, concurrency=8, name="demo-worker")
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, worker.stop)
    await worker.run()
    print(f"worker: stopped after {worker.processed} outcome(s)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
