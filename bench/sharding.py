"""Sharding: what a call for another shard costs, and what a second shard adds, on loopback.

Two shards as on the sharding page: cpu (number 1) owns pool default, gpu (number 2) owns
pool llm; each is a cronoq-server process with its own store (an SQLite file, or a schema of
one PostgreSQL server).

  (a) GetTask of a cpu task, at cpu's server (direct) and at gpu's (forwarded to cpu);
  (b) SubmitTask into pool default, at cpu (direct) and at gpu (forwarded to cpu);
  (c) ListTasks at cpu, a page of 100 that straddles the shards (the last 50 of cpu's tasks,
      then gpu's first 50: both shards asked in parallel and merged) against a page of 100
      inside cpu's tasks marked `cronoq-forwarded: 1` (answered by cpu's shard alone); and
      the first page, which cpu's tasks fill (so gpu's answer is not waited for);
  (d) burn-down: --tasks no-op tasks, half in each shard, one worker process per shard
      (concurrency 64) at its shard's server; against one unsharded server holding all of
      them, drained by the same two worker processes. Drain time runs from the workers' go
      to the last task's start (worker start-up excluded); CPU use is of the servers and
      workers over the drain.

In (a) to (c) the two kinds of call alternate, one call at a time, so both see the same
machine. Calls go straight through grpc.aio stubs (no SDK retries in the figures).

    python bench/sharding.py [--store postgres] [--calls 1000] [--tasks 20000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import grpc
from _anchor_common import percentile
from _servers import SYNCHRONOUS, BenchServer, add_store_arguments, bench_store, free_port
from burndown import submit_all

import cronoq
from cronoq.v1 import task_pb2, task_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb

SHARDS = {"cpu": (1, "default"), "gpu": (2, "llm")}  # name: (number, its pool)
MARKED = (("cronoq-forwarded", "1"),)  # answered by the receiving shard only
LIST_PAGE = 100
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def log(text: str) -> None:
    print(f"== {text}", file=sys.stderr, flush=True)


def start_shards(workdir: Path, url: str | None, synchronous: str = SYNCHRONOUS) -> dict[str, BenchServer]:
    """One server per shard, every one reading the same [[shards]]."""
    ports = {name: (free_port(), free_port()) for name in SHARDS}
    shards = "".join(
        f'[[shards]]\nname = "{name}"\nnumber = {number}\npools = ["{pool}"]\n'
        f'endpoint = "http://127.0.0.1:{ports[name][0]}"\n'
        for name, (number, pool) in SHARDS.items()
    )
    servers: dict[str, BenchServer] = {}
    try:
        for name in SHARDS:
            servers[name] = BenchServer(
                workdir, url, ("llm",), extra_config=shards, shard=name, ports=ports[name], synchronous=synchronous
            )
    except BaseException:
        stop_all(servers.values())
        raise
    return servers


def stop_all(servers: Any) -> None:
    for server in servers:
        server.stop()


# -- (a) to (c): one call at a time, two kinds alternating ------------------------------


def summary(took_ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(took_ms, 50), 3), "p99_ms": round(percentile(took_ms, 99), 3)}


async def alternate(
    first: Callable[[], Awaitable[object]], second: Callable[[], Awaitable[object]], calls: int
) -> tuple[dict[str, float], dict[str, float]]:
    """p50 and p99 of `calls` calls of each; the order of the two flips every round."""
    for _ in range(min(100, calls)):  # warm up: channels, the peer channel, caches
        await first()
        await second()
    took: tuple[list[float], list[float]] = ([], [])
    for i in range(calls):
        order = ((first, took[0]), (second, took[1]))
        for call, out in order if i % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            await call()
            out.append((time.perf_counter() - started) * 1000)
    return summary(took[0]), summary(took[1])


async def tasks_by_shard(stub: Any, metadata: Sequence[tuple[str, str]] = ()) -> dict[int, int]:
    """How many tasks of each shard number a full ListTasks listing holds (page by page)."""
    counts: dict[int, int] = {}
    token = ""
    for _ in range(1000):
        resp = await stub.ListTasks(tpb.ListTasksRequest(page_size=1000, page_token=token), metadata=metadata)
        for task in resp.tasks:
            counts[task.id >> 56] = counts.get(task.id >> 56, 0) + 1
        token = resp.next_page_token
        if not token:
            break
    return counts


async def calls_across_shards(servers: dict[str, BenchServer], calls: int, stored: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{servers['cpu'].grpc_port}") as cpu_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{servers['gpu'].grpc_port}") as gpu_channel,
    ):
        cpu = task_service_pb2_grpc.TaskServiceStub(cpu_channel)
        gpu = task_service_pb2_grpc.TaskServiceStub(gpu_channel)
        log(f"storing {stored:,} tasks in each shard")
        for stub, (_, pool) in ((cpu, SHARDS["cpu"]), (gpu, SHARDS["gpu"])):
            for done in range(0, stored, 1000):
                n = min(1000, stored - done)
                await stub.SubmitBatch(tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool=pool)] * n))

        target = (await cpu.SubmitTask(tpb.SubmitTaskRequest(pool="default", payload=b"x" * 100))).task.id
        get = tpb.GetTaskRequest(task=task_pb2.TaskRef(id=target))
        log(f"(a) GetTask of a cpu task: at cpu (direct) and at gpu (forwarded), {calls} calls each")
        result["get_direct"], result["get_forwarded"] = await alternate(
            lambda: cpu.GetTask(get), lambda: gpu.GetTask(get), calls
        )

        submit = tpb.SubmitTaskRequest(pool="default", payload=b"x" * 100)
        log(f"(b) SubmitTask into pool default: at cpu (direct) and at gpu (forwarded), {calls} calls each")
        result["submit_direct"], result["submit_forwarded"] = await alternate(
            lambda: cpu.SubmitTask(submit), lambda: gpu.SubmitTask(submit), calls
        )

        seen = await tasks_by_shard(cpu)
        result["list_shards_seen"] = sorted(seen)
        # A page that straddles the shards: the last LIST_PAGE/2 of cpu's tasks, then gpu's
        # first; against a page of LIST_PAGE inside cpu's tasks, answered by cpu alone.
        straddle = tpb.ListTasksRequest(page_size=LIST_PAGE, page_token=await token_at(cpu, seen[1] - LIST_PAGE // 2))
        inside = tpb.ListTasksRequest(page_size=LIST_PAGE, page_token=await token_at(cpu, seen[1] // 2))
        page = await cpu.ListTasks(straddle)
        result["list_page_shards"] = sorted({t.id >> 56 for t in page.tasks})
        result["list_fanned_out"] = len(result["list_page_shards"]) > 1
        result["list_unavailable_shards"] = list(page.unavailable_shards)
        how = "fanned out to both shards" if result["list_fanned_out"] else "answered by cpu's shard only"
        log(f"(c) ListTasks at cpu, a page across both shards ({how}) and one inside cpu's, {calls // 2} calls each")
        result["list_client"], result["list_one_shard"] = await alternate(
            lambda: cpu.ListTasks(straddle), lambda: cpu.ListTasks(inside, metadata=MARKED), calls // 2
        )
        first = tpb.ListTasksRequest(page_size=LIST_PAGE)
        log(f"(c') ListTasks at cpu, the first page (cpu's tasks fill it: gpu is not waited for), {calls // 2} calls")
        result["list_first_page"], _ = await alternate(
            lambda: cpu.ListTasks(first), lambda: cpu.ListTasks(inside, metadata=MARKED), calls // 2
        )
    return result


async def token_at(stub: Any, position: int) -> str:
    """The page token after the first `position` tasks of the stub's own shard."""
    token, left = "", position
    while left > 0:
        size = min(left, 1000)
        page = await stub.ListTasks(tpb.ListTasksRequest(page_size=size, page_token=token), metadata=MARKED)
        token, left = page.next_page_token, left - size
    return token


# -- (d) burn-down ------------------------------------------------------------------


def drain_worker(
    endpoint: str,
    pool: str,
    concurrency: int,
    total: int,
    counter: Any,  # mp.Value("i"): tasks started by every worker of this pool
    done_at: Any,  # mp.Value("d"): when the pool's last task started
    ready: Any,  # mp.Semaphore: released once this process is up
    go: Any,  # mp.Event: set when every worker is up
) -> None:
    async def main() -> None:
        async def noop(task: cronoq.TaskContext) -> None:
            with counter.get_lock():
                counter.value += 1
                if counter.value == total:
                    done_at.value = time.time()

        async def stop_when_done() -> None:
            while counter.value < total:
                await asyncio.sleep(0.02)
            worker.stop()

        worker = cronoq.Worker(endpoint, pool, noop, concurrency=concurrency)
        stopper = asyncio.create_task(stop_when_done())
        await worker.run()
        stopper.cancel()

    ready.release()
    go.wait(60)
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of processes (running, or ended and not yet reaped), from /proc."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def machine_ticks() -> tuple[int, int, int]:
    """All CPUs' busy, iowait and total ticks since boot, from /proc/stat (every process on the machine)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle, iowait = ticks[3], ticks[4]
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest time is in user)
    return total - idle - iowait, iowait, total


def drain(
    groups: list[tuple[str, int, list[str]]], server_pids: list[int], concurrency: int, timeout: float
) -> dict[str, Any]:
    """Drains each group (pool, its task count, one endpoint per worker process) at once; a
    pool's workers share its count. Per pool: tasks/s to its last start; in total: to the last.
    CPU: of the servers and of the workers, from the go to the last start."""
    # spawn, not fork: this process has used gRPC, and a forked child can hang in it
    ctx = mp.get_context("spawn")
    ready, go = ctx.Semaphore(0), ctx.Event()
    procs, done, counters = [], {}, {}
    for pool, total, endpoints in groups:
        counters[pool], done[pool] = ctx.Value("i", 0), ctx.Value("d", 0.0)
        for endpoint in endpoints:
            args = (endpoint, pool, concurrency, total, counters[pool], done[pool], ready, go)
            procs.append(ctx.Process(target=drain_worker, args=args))
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=60):
                raise RuntimeError("a worker process did not start")
        worker_pids = [p.pid for p in procs if p.pid is not None]
        servers_before, workers_before = cpu_seconds(server_pids), cpu_seconds(worker_pids)
        machine_before = machine_ticks()
        started = time.time()
        go.set()
        while not all(d.value for d in done.values()):  # no is_alive() here: it would reap them
            if time.time() > started + timeout:
                counts = ", ".join(f"{pool} {counters[pool].value:,}/{total:,}" for pool, total, _ in groups)
                raise RuntimeError(f"the burn-down did not end within {timeout:.0f} s (tasks started: {counts})")
            time.sleep(0.002)
        last = max(d.value for d in done.values())
        servers_cpu = cpu_seconds(server_pids) - servers_before
        workers_cpu = cpu_seconds(worker_pids) - workers_before
        busy, iowait, total = (after - before for after, before in zip(machine_ticks(), machine_before, strict=True))
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    wall = last - started
    return {
        "tasks_per_s": round(sum(total for _, total, _ in groups) / wall),
        "per_pool_tasks_per_s": {pool: round(total / (done[pool].value - started)) for pool, total, _ in groups},
        "drain_s": round(wall, 2),
        "workers": len(procs),
        "cores_busy": round((servers_cpu + workers_cpu) / wall, 2),
        "servers_cores_busy": round(servers_cpu / wall, 2),
        "machine_busy": round(busy / max(total, 1), 2),  # of every core, by anything on the machine
        "machine_iowait": round(iowait / max(total, 1), 2),
    }


async def count_succeeded(endpoint: str, pool: str) -> int:
    async with cronoq.Client(endpoint) as client:
        n = 0
        async for _ in client.iter_tasks(
            pool=pool, state=cronoq.TaskState.Value("TASK_STATE_SUCCEEDED"), page_size=1000
        ):
            n += 1
        return n


def burn_down(
    workdir: Path, url: str | None, setup: str, tasks: int, concurrency: int, synchronous: str
) -> dict[str, Any]:
    """setup: "1x1" one unsharded server and 1 worker process, "1x2" with 2, "2x1" two shards
    with 1 worker process each (half of the tasks in each shard)."""
    if setup == "2x1":
        servers = start_shards(workdir, url, synchronous)
        shares = {"cpu": tasks // 2, "gpu": tasks - tasks // 2}
        groups = [(pool, shares[name], [servers[name].endpoint]) for name, (_, pool) in SHARDS.items()]
    else:
        servers = {"unsharded": BenchServer(workdir, url, synchronous=synchronous)}
        groups = [("default", tasks, [servers["unsharded"].endpoint] * int(setup[-1]))]
    try:
        for server, (pool, total, _) in zip(servers.values(), groups, strict=True):
            asyncio.run(submit_all(server.endpoint, total, 500, {}, {}, pool))
        result = drain(groups, [s.proc.pid for s in servers.values()], concurrency, 120)
        result["succeeded"] = sum(
            asyncio.run(count_succeeded(server.endpoint, pool))
            for server, (pool, _, _) in zip(servers.values(), groups, strict=True)
        )
    finally:
        stop_all(servers.values())
    return result


# -- the run -----------------------------------------------------------------------

SETUPS = {
    "1x1": "one unsharded server, 1 worker process",
    "2x1": "2 shards (half of the tasks in each), 1 worker process per shard",
    "1x2": "one unsharded server, 2 worker processes",
}


def burn_downs(
    url: str | None, setups: list[str], rounds: int, args: argparse.Namespace, synchronous: str
) -> dict[str, Any]:
    """Each setup `rounds` times, the order flipping every round; per setup the median round
    (with every round's tasks/s), and the median of the rounds' 2x1 / 1x1 ratios."""
    runs: dict[str, list[dict[str, Any]]] = {setup: [] for setup in setups}
    for i in range(rounds):
        for setup in setups if i % 2 == 0 else setups[::-1]:
            log(f"(d) burn-down of {args.tasks:,} tasks, {SETUPS[setup]}, synchronous {synchronous}, round {i + 1}")
            with tempfile.TemporaryDirectory() as tmp:
                runs[setup].append(burn_down(Path(tmp), url, setup, args.tasks, args.concurrency, synchronous))
    result: dict[str, Any] = {}
    for setup, done in runs.items():
        median = sorted(done, key=lambda run: run["tasks_per_s"])[len(done) // 2]
        result[setup] = {**median, "rounds_tasks_per_s": [run["tasks_per_s"] for run in done]}
    if "1x1" in runs and "2x1" in runs:
        ratios = sorted(
            two["tasks_per_s"] / one["tasks_per_s"] for one, two in zip(runs["1x1"], runs["2x1"], strict=True)
        )
        result["ratio"] = round(ratios[len(ratios) // 2], 2)
        result["rounds_ratio"] = [round(x, 2) for x in ratios]
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"store": args.store, "calls": args.calls, "tasks": args.tasks, "cores": os.cpu_count()}
    result["load_before"] = round(os.getloadavg()[0], 1)
    with bench_store(args.store, args.url) as url:
        with tempfile.TemporaryDirectory() as tmp:
            log(f"two shards on {args.store}")
            servers = start_shards(Path(tmp), url)
            try:
                result.update(asyncio.run(calls_across_shards(servers, args.calls, args.stored)))
            finally:
                stop_all(servers.values())
        sync = SYNCHRONOUS if args.store == "sqlite" else "(postgres)"
        burn = burn_downs(url, ["1x1", "2x1"], args.rounds, args, SYNCHRONOUS)
        burn.update(burn_downs(url, ["1x2"], 1, args, SYNCHRONOUS))
        burn["ratio_vs_1x2"] = round(burn["2x1"]["tasks_per_s"] / burn["1x2"]["tasks_per_s"], 2)
        result["burn_down"] = {"synchronous": sync, **burn}
        if args.store == "sqlite" and SYNCHRONOUS != "normal":  # where the ceiling is: no fsync per commit
            result["burn_down_normal"] = {
                "synchronous": "normal",
                **burn_downs(url, ["1x1", "2x1"], 1, args, "normal"),
            }
    for kind in ("get", "submit"):
        direct, forwarded = result[f"{kind}_direct"], result[f"{kind}_forwarded"]
        result[f"{kind}_forward_cost_p50_ms"] = round(forwarded["p50_ms"] - direct["p50_ms"], 3)
    result["list_ratio_p50"] = round(result["list_client"]["p50_ms"] / result["list_one_shard"]["p50_ms"], 2)
    result["load_after"] = round(os.getloadavg()[0], 1)
    return result


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(r: dict[str, Any]) -> None:
    def lat(x: dict[str, float]) -> str:
        return f"p50 {x['p50_ms']:.2f} ms, p99 {x['p99_ms']:.2f} ms"

    def burn(x: dict[str, Any]) -> str:
        return (
            f"{x['tasks_per_s']:>6,} tasks/s (rounds {x['rounds_tasks_per_s']}; its processes kept "
            f"{x['cores_busy']} of {r['cores']} cores busy, the servers {x['servers_cores_busy']}; the machine "
            f"{x['machine_busy']:.0%} busy, {x['machine_iowait']:.0%} iowait; succeeded {x['succeeded']:,})"
        )

    print(f"cronoq {r['store']}, 2 shards on loopback, {r['calls']} calls of each kind, one at a time:")
    for kind, name in (("get", "GetTask"), ("submit", "SubmitTask")):
        cost = r[f"{kind}_forward_cost_p50_ms"]
        print(
            f"  {name:10} direct {lat(r[f'{kind}_direct'])}; forwarded {lat(r[f'{kind}_forwarded'])}; "
            f"forwarding adds {cost:+.2f} ms p50 (target ≤ 1 ms: {verdict(cost <= 1)})"
        )
    ratio = r["list_ratio_p50"]
    if r["list_fanned_out"]:
        what, judged = f"fanned out to shards {r['list_shards_seen']}", f"target ≤ 1.3×: {verdict(ratio <= 1.3)}"
    else:
        what, judged = "NOT fanned out (answered from cpu's shard only)", "no fan-out to judge"
    print(
        f"  ListTasks  page of {LIST_PAGE} across both shards at cpu, {what}: {lat(r['list_client'])}; "
        f"a page of cpu's shard alone {lat(r['list_one_shard'])}; {ratio:.2f}× ({judged})"
    )
    print(f"  ListTasks  first page at cpu (filled by cpu's tasks, gpu not waited for): {lat(r['list_first_page'])}")

    def per_shard(x: dict[str, Any]) -> str:
        return "per shard " + ", ".join(f"{pool} {n:,}" for pool, n in x["per_pool_tasks_per_s"].items())

    for key in ("burn_down", "burn_down_normal"):
        if key not in r:
            continue
        b = r[key]
        sync = f", SQLite synchronous = {b['synchronous']}" if r["store"] == "sqlite" else ""
        rounds = len(b["2x1"]["rounds_tasks_per_s"])
        print(f"  burn-down of {r['tasks']:,} no-op tasks, workers at concurrency 64{sync}; median of {rounds}:")
        print(f"    one server, 1 worker:      {burn(b['1x1'])}")
        print(f"    2 shards, 1 worker each:   {burn(b['2x1'])}; {per_shard(b['2x1'])}")
        if "1x2" in b:
            print(f"    one server, 2 workers:     {burn(b['1x2'])}")
        line = f"    2 shards / one server, the same worker per shard: {b['ratio']:.2f}× (rounds {b['rounds_ratio']})"
        if key == "burn_down":
            line += f", target ≥ 1.5×: {verdict(b['ratio'] >= 1.5)}; with the same 2 workers: {b['ratio_vs_1x2']:.2f}×"
        print(line)
    print(f"  load average before / after: {r['load_before']} / {r['load_after']} ({r['cores']} cores)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(ap)
    ap.add_argument("--calls", type=int, default=1000, help="calls of each kind in (a) and (b); half in (c)")
    ap.add_argument("--stored", type=int, default=2000, help="tasks stored in each shard before (a) to (c)")
    ap.add_argument("--tasks", type=int, default=20_000, help="burn-down size")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="burn-down rounds of one server and of 2 shards")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)


if __name__ == "__main__":
    main()
