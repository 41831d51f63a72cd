"""Submit→start latency at a fixed rate below saturation: one client submits single
tasks at --rate per second; one worker process records when each handler starts.

    python bench/latency.py [--rate 1000] [--seconds 5] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import queue
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _anchor_common import cronoq_latency
from _servers import BenchServer, add_store_arguments, bench_store

import cronoq


def run_worker(endpoint: str, concurrency: int, total: int, ready: mp.Event, out: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        latencies: list[float] = []

        async def stop_when_told() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.2)
            worker.stop()

        async def record(task: cronoq.TaskContext) -> None:
            latencies.append(time.time() - task.payload["t"])
            if len(latencies) >= total:
                worker.stop()

        worker = cronoq.Worker(endpoint, "default", record, concurrency=concurrency)
        ready.set()
        watcher = asyncio.create_task(stop_when_told())
        await worker.run()
        watcher.cancel()
        out.put(latencies)

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


async def submit_at_rate(endpoint: str, rate: int, seconds: float, batch: int) -> tuple[int, float]:
    """Submits rate tasks per second: every batch/rate seconds, one call with batch tasks."""
    calls = int(rate * seconds / batch)
    async with cronoq.Client(endpoint) as client:
        await client.submit("default", {"t": time.time()})  # warm the channel
        loop = asyncio.get_running_loop()
        start = loop.time()
        calls_made: list[asyncio.Task[object]] = []
        for i in range(calls):
            delay = start + i * batch / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if batch == 1:
                call = client.submit("default", {"t": time.time()})
            else:
                now = time.time()
                call = client.submit_batch([cronoq.task_spec("default", {"t": now}) for _ in range(batch)])
            calls_made.append(asyncio.create_task(call))
            if i % max(rate // batch, 1) == 0:
                print(f"\rsubmitted {i * batch}/{calls * batch}", end="", file=sys.stderr)
        results = await asyncio.gather(*calls_made, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            print(f"\n{len(failed)} submit call(s) failed, e.g. {failed[0]}", file=sys.stderr)
        achieved = calls * batch / (loop.time() - start)
    print(file=sys.stderr)
    return calls * batch + 1, achieved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="tasks per submit call (1: one SubmitTask per task)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_store_arguments(ap)
    args = ap.parse_args()
    total = int(args.rate * args.seconds / args.batch) * args.batch + 1
    with bench_store(args.store, args.url) as url, tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp), url)
        try:
            ready, out, stop = mp.Event(), mp.Queue(), mp.Event()
            proc = mp.Process(target=run_worker, args=(server.endpoint, args.concurrency, total, ready, out, stop))
            proc.start()
            ready.wait(30)
            time.sleep(1.0)  # the worker registers and starts its long poll
            _, achieved = asyncio.run(submit_at_rate(server.endpoint, args.rate, args.seconds, args.batch))
            try:  # every task started, or a saturated run stopped after a bounded drain
                latencies = out.get(timeout=60)
            except queue.Empty:
                stop.set()
                latencies = out.get(timeout=60)
            proc.join(30)
        finally:
            server.stop()
    cronoq_latency(
        args.rate, args.batch, achieved, latencies, args.store, args.json,
        f"{args.store} submit→start at {args.rate}/s in calls of {args.batch}", "tasks",
    )  # fmt: skip


if __name__ == "__main__":
    main()
