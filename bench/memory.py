"""Server memory (VmRSS) per client connection and per open Watch stream, for sizing.

    python bench/memory.py [--store sqlite|postgres] [--connections 200] [--watches 200] [--json]

Opens --connections gRPC channels (each makes one GetServerInfo call and stays open), then
--watches Watch streams (each on a channel of its own, each given its first event); reads
the server's VmRSS from /proc/PID/status before and after each step. The figures are the
growth divided by the count. A PostgreSQL connection's memory is the database server's, not
cronoq's: each of the server's pool connections is one PostgreSQL backend process.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import grpc
from _servers import BenchServer, add_store_arguments, bench_store

from cronoq.v1 import admin_service_pb2 as apb
from cronoq.v1 import admin_service_pb2_grpc, task_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def settled_rss(pid: int) -> int:
    """VmRSS once the server has handled what was just sent (two equal readings in a row)."""
    last = -1
    for _ in range(50):
        time.sleep(0.2)
        now = rss_kib(pid)
        if now == last:
            return now
        last = now
    return last


def run(args: argparse.Namespace, url: str | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp), url)
        target = f"127.0.0.1:{server.grpc_port}"
        pid = server.proc.pid
        channels: list[grpc.Channel] = []
        streams = []
        try:
            base = settled_rss(pid)
            for _ in range(args.connections):
                channel = grpc.insecure_channel(target)
                admin_service_pb2_grpc.AdminServiceStub(channel).GetServerInfo(apb.GetServerInfoRequest(), timeout=30)
                channels.append(channel)
            with_connections = settled_rss(pid)
            tasks = task_service_pb2_grpc.TaskServiceStub(grpc.insecure_channel(target))
            for _ in range(args.watches):
                channel = grpc.insecure_channel(target)
                stream = task_service_pb2_grpc.TaskServiceStub(channel).Watch(tpb.WatchRequest(), timeout=600)
                channels.append(channel)
                streams.append(stream)
            tasks.SubmitTask(tpb.SubmitTaskRequest(pool="default", payload=b"x"), timeout=30)
            for stream in streams:
                next(stream)  # each stream is open and has delivered an event
            with_watches = settled_rss(pid)
        finally:
            for stream in streams:
                stream.cancel()
            for channel in channels:
                channel.close()
            server.stop()
    return {
        "base_rss_mib": round(base / 1024, 1),
        "kib_per_connection": round((with_connections - base) / max(args.connections, 1), 1),
        "kib_per_watch_stream": round((with_watches - with_connections) / max(args.watches, 1), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(ap)
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--watches", type=int, default=200)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    with bench_store(args.store, args.url) as url:
        result = {"store": args.store, "connections": args.connections, "watches": args.watches, **run(args, url)}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
