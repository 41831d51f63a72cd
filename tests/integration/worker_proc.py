"""A real worker process for the integration tests.

    python worker_proc.py ENDPOINT POOL[,POOL...] LOGFILE [--concurrency N] [--token T]

Each execution appends "start|done task_id attempt pid unix_time" to LOGFILE. A payload
{"sleep": s} sleeps first, {"sleep_first": s} only on attempt 1; {"fail_until": n} fails attempts below n.
{"pages": n, "page_s": s} works through n pages of s seconds each from its checkpoint (the next
page, as text), saving a checkpoint and reporting progress after each, and appends
"page task_id page pid" per page. {"spawn": n} spawns n tasks of its pool with its success,
each with payload {"child": i, "parent_attempt": attempt}. SIGTERM stops it gracefully.
"""

import argparse
import asyncio
import os
import signal
import time

import cronoq


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("pool")
    ap.add_argument("logfile")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--token")
    args = ap.parse_args()
    log = open(args.logfile, "a", buffering=1)

    async def handle(task: cronoq.TaskContext) -> dict:
        job = task.payload if isinstance(task.payload, dict) else {}
        log.write(f"start {task.id} {task.attempt} {os.getpid()} {time.time():.6f}\n")
        if job.get("sleep"):
            await asyncio.sleep(job["sleep"])
        if job.get("sleep_first") and task.attempt == 1:
            await asyncio.sleep(job["sleep_first"])
        if job.get("pages"):
            first = int(task.checkpoint or b"0")
            for page in range(first, job["pages"]):
                await asyncio.sleep(job["page_s"])
                log.write(f"page {task.id} {page} {os.getpid()} {time.time():.6f}\n")
                task.save_checkpoint(str(page + 1).encode())
                task.report_progress((page + 1) / job["pages"], f"page {page + 1} of {job['pages']}")
        if task.attempt < job.get("fail_until", 0):
            raise cronoq.TaskError(f"planned failure on attempt {task.attempt}")
        for i in range(job.get("spawn", 0)):
            task.spawn(task.pool, {"child": i, "parent_attempt": task.attempt})
        log.write(f"done {task.id} {task.attempt} {os.getpid()} {time.time():.6f}\n")
        return {"pid": os.getpid(), "attempt": task.attempt}

    worker = cronoq.Worker(args.endpoint, args.pool.split(","), handle, concurrency=args.concurrency, token=args.token)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    await worker.run()
    log.write(f"stopped {os.getpid()}\n")


if __name__ == "__main__":
    asyncio.run(main())
