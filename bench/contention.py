"""Submit latency while the server carries idle load: what waiting callers cost a submitter.

Each phase measures the p50 of single SubmitTask calls, one at a time, against one server:
  - quiet: nothing else connected;
  - 1,000 idle LeaseTasks long polls (on another pool: a submission must not wake them);
  - 2 stalled watchers (SSE and gRPC, with payloads) that never read;
  - --tasks tasks stored (300,000 by default), without and with /metrics scraped 10 times a second.

    python bench/contention.py [--store postgres] [--calls 500] [--tasks 300000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import grpc
from _anchor_common import percentile
from _servers import BenchServer, add_store_arguments, bench_store

from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import task_service_pb2_grpc, worker_service_pb2_grpc
from cronoq.v1 import worker_service_pb2 as wpb

PAYLOAD = b"x" * 1024


async def submit_p50(stub: Any, calls: int) -> float:
    """p50 in ms of `calls` single submissions, one at a time."""
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        await stub.SubmitTask(tpb.SubmitTaskRequest(pool="default", payload=PAYLOAD))
        took.append((time.perf_counter() - started) * 1000)
    return round(percentile(took, 50), 2)


async def fill(stub: Any, total: int) -> None:
    done = 0
    while done < total:
        n = min(1000, total - done)
        await stub.SubmitBatch(tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="stored")] * n))
        done += n
        if done % 50_000 == 0:
            print(f"   stored {done:,} tasks", file=sys.stderr, flush=True)


async def scrape_forever(url: str, per_second: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await loop.run_in_executor(None, lambda: urllib.request.urlopen(url, timeout=30).read())
        await asyncio.sleep(1 / per_second)


async def run(endpoint: str, http_url: str, http_port: int, calls: int, tasks: int) -> dict[str, Any]:
    target = endpoint.removeprefix("http://")
    result: dict[str, Any] = {"calls": calls}

    def step(text: str) -> None:
        print(f"== {text}", file=sys.stderr, flush=True)

    async with grpc.aio.insecure_channel(target) as channel:
        tasks_stub = task_service_pb2_grpc.TaskServiceStub(channel)
        workers_stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        await submit_p50(tasks_stub, 50)  # warm up
        step("quiet")
        result["quiet_p50_ms"] = await submit_p50(tasks_stub, calls)

        step("1,000 idle long polls")
        async with grpc.aio.insecure_channel(target) as poll_channel:
            poll_stub = worker_service_pb2_grpc.WorkerServiceStub(poll_channel)
            worker = await workers_stub.RegisterWorker(wpb.RegisterWorkerRequest(name="idle", pools=["idle"]))
            request = wpb.LeaseTasksRequest(worker_id=worker.worker_id, max_tasks=1, wait_ms=60_000)
            polls = [asyncio.ensure_future(poll_stub.LeaseTasks(request)) for _ in range(1000)]
            await asyncio.sleep(2.0)  # every poll is waiting
            result["idle_polls_p50_ms"] = await submit_p50(tasks_stub, calls)
            for p in polls:
                p.cancel()
            await asyncio.gather(*polls, return_exceptions=True)

        step("2 stalled watchers")
        sse = socket.create_connection(("127.0.0.1", http_port))
        sse.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sse.sendall(b"GET /v1/watch?include_payloads=true HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        stalled = tasks_stub.Watch(tpb.WatchRequest(include_payloads=True))  # never read
        await asyncio.sleep(0.5)
        result["stalled_watchers_p50_ms"] = await submit_p50(tasks_stub, calls)
        stalled.cancel()
        sse.close()

        step(f"storing {tasks:,} tasks")
        await fill(tasks_stub, tasks)
        await asyncio.sleep(1.0)
        result["stored_tasks"] = tasks
        step("submit p50 with the tasks stored")
        result["stored_p50_ms"] = await submit_p50(tasks_stub, calls)
        step("the same, /metrics scraped 10 times a second")
        scraper = asyncio.create_task(scrape_forever(f"{http_url}/metrics", 10))
        await asyncio.sleep(1.0)
        result["scraped_p50_ms"] = await submit_p50(tasks_stub, calls)
        scraper.cancel()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(ap)
    ap.add_argument("--calls", type=int, default=500, help="submissions per phase")
    ap.add_argument("--tasks", type=int, default=300_000, help="tasks stored for the scrape phase")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, bench_store(args.store, args.url) as url:
        server = BenchServer(Path(tmp), url, extra_pools=("idle", "stored"))
        try:
            http_url = f"http://127.0.0.1:{server.http_port}"
            result = asyncio.run(run(server.endpoint, http_url, server.http_port, args.calls, args.tasks))
        finally:
            server.stop()
    result["store"] = args.store
    if args.json:
        print(json.dumps(result), flush=True)
        return
    quiet = result["quiet_p50_ms"]
    print(f"cronoq {args.store}: single SubmitTask p50, one call at a time ({args.calls} calls a phase)")
    for name, key in (
        ("quiet", "quiet_p50_ms"),
        ("1,000 idle long polls", "idle_polls_p50_ms"),
        ("2 stalled watchers", "stalled_watchers_p50_ms"),
        (f"{result['stored_tasks']:,} tasks stored", "stored_p50_ms"),
        ("… and /metrics scraped 10/s", "scraped_p50_ms"),
    ):
        print(f"  {name:32} p50 {result[key]:7.2f} ms  ({result[key] / quiet:.2f}× quiet)")


if __name__ == "__main__":
    main()
