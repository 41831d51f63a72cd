"""The demo's worker, in its own process: `python examples/demo_worker.py ENDPOINT [--pool POOL] [--verbose]`.

--verbose prints the SDK's log lines (a redirect to another shard, the registration) and a
line `registered at ENDPOINT` once the worker has registered, on stdout.
"""

import argparse
import asyncio
import logging
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


async def report_registration(worker: cronoq.Worker) -> None:
    while not worker.worker_id:
        await asyncio.sleep(0.02)
    print(f"registered at {worker.endpoint}", flush=True)


async def main(args: argparse.Namespace) -> int:
    worker = cronoq.Worker(args.endpoint, args.pool, handle, concurrency=8, name=args.name)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, worker.stop)
    reporter = asyncio.create_task(report_registration(worker)) if args.verbose else None
    try:
        await worker.run()
    except cronoq.CronoqError as err:  # e.g. the server refused the registration
        print(f"worker: stopped: {err}", flush=True)
        return 1
    finally:
        if reporter:
            reporter.cancel()
    print(f"worker: stopped after {worker.processed} outcome(s)", flush=True)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("endpoint")
    ap.add_argument("--pool", default="default")
    ap.add_argument("--name", default="demo-worker")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
        logging.getLogger("cronoq").setLevel(logging.INFO)
    sys.exit(asyncio.run(main(args)))
