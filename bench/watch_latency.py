"""Watch delivery latency: one client submits single tasks at --rate per second; a Watch stream
in another process records when each task's first event (PENDING) arrives.

    python bench/watch_latency.py [--store sqlite|postgres] [--rate 500] [--seconds 5]

Latency is from just before the SubmitTask call to the event's arrival (the payload carries
the send time; both processes read the same clock).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import grpc
from _anchor_common import cronoq_latency
from _servers import BenchServer, add_store_arguments, bench_store

import cronoq
from cronoq.v1 import task_pb2, task_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb

PENDING = task_pb2.TaskState.Value("TASK_STATE_PENDING")


def run_watcher(target: str, total: int, ready: mp.Event, out: mp.Queue) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        latencies: list[float] = []
        async with grpc.aio.insecure_channel(target) as channel:
            stream = task_service_pb2_grpc.TaskServiceStub(channel).Watch(
                tpb.WatchRequest(pool="default", include_payloads=True)
            )
            await stream.wait_for_connection()
            ready.set()
            async for response in stream:
                if response.event.task.state == PENDING:
                    latencies.append(time.time() - json.loads(response.event.task.payload)["t"])
                    if len(latencies) >= total:
                        stream.cancel()
                        break
        out.put(latencies)

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


async def submit_at_rate(endpoint: str, rate: int, seconds: float) -> float:
    calls = int(rate * seconds)
    async with cronoq.Client(endpoint) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        made: list[asyncio.Task[object]] = []
        for i in range(calls):
            delay = start + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            made.append(asyncio.create_task(client.submit("default", {"t": time.time()})))
            if i % rate == 0:
                print(f"\rsubmitted {i}/{calls}", end="", file=sys.stderr)
        await asyncio.gather(*made)
        achieved = calls / (loop.time() - start)
    print(file=sys.stderr)
    return achieved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_store_arguments(ap)
    args = ap.parse_args()
    total = int(args.rate * args.seconds) + 1
    with bench_store(args.store, args.url) as url, tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp), url)
        try:
            ready, out = mp.Event(), mp.Queue()
            proc = mp.Process(target=run_watcher, args=(f"127.0.0.1:{server.grpc_port}", total, ready, out))
            proc.start()
            ready.wait(30)
            time.sleep(0.5)  # the stream is registered on the server

            async def warm_then_submit() -> float:
                async with cronoq.Client(server.endpoint) as client:
                    await client.submit("default", {"t": time.time()})
                return await submit_at_rate(server.endpoint, args.rate, args.seconds)

            achieved = asyncio.run(warm_then_submit())
            latencies = out.get(timeout=60)
            proc.join(30)
        finally:
            server.stop()
    cronoq_latency(
        args.rate, 1, achieved, latencies, args.store, args.json,
        f"{args.store} submit→Watch event at {args.rate}/s, one SubmitTask per task", "events",
    )  # fmt: skip


if __name__ == "__main__":
    main()
