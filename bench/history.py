"""History, retention, bulk delete and debounce: what a store full of ended tasks costs the hot path.

    python bench/history.py drain    [--store postgres] [--pending 100000] [--history 1000000] [--rounds 1]
    python bench/history.py purge    [--store postgres] [--history 1000000]
    python bench/history.py delete   [--store sqlite]   [--tasks 20000] [--history 1000000] [--deletes 200]
    python bench/history.py debounce [--store postgres] [--calls 100000] [--keys 100] [--callers 8]

drain: --pending no-op tasks drained by one Python worker process at concurrency 64 (as
bench/burndown.py), on a store with no history, then on a fresh store holding --history
SUCCEEDED tasks (an attempt each, finished an hour ago) inserted with SQL while the server was
stopped; the two rates and their ratio (target ≥ 0.8); with --rounds, the medians.
purge: --history tasks that ended two days ago in a pool kept forever (retention "0"), then
the same server restarted with retention "1d": the retention service purges them at start-up.
Another caller's GetTask/SubmitTask one at a time (bench/bulk.py's probe) for 10 s before, and
until cronoq_tasks_purged_total (GET /metrics) reaches --history; the purge's time from the
restart and the p99 ratio (target ≤ 1.5).
delete (PostgreSQL unless --store): --tasks FAILED tasks, one RetryTasks of all of them timed,
failed again, one DeleteTasks of all of them timed (each repeated while it answers incomplete);
the ratio delete/retry (target ≤ 2). Then --history ended tasks are inserted and --deletes
FAILED tasks deleted one DeleteTask at a time: p50/p99 (target p99 ≤ 10 ms).
debounce: --calls SubmitTask calls with KEY_MODE_DEBOUNCE (debounce_ms 60000) over --keys keys
in turn from --callers concurrent callers on one channel; submits/s, p50/p99 a call, and the
tasks created (must be --keys).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import asyncpg
import grpc
from _anchor_common import percentile
from _servers import BenchServer, add_store_arguments, bench_store
from bulk import QUIET_S, figures, make_tasks, probe
from burndown import run_worker, submit_all

from cronoq.v1 import task_pb2, task_service_pb2_grpc, worker_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb

CONCURRENCY = 64  # the drain's worker, as burndown.py's default
SUBMIT_BATCH = 500  # as burndown.py's default
HOUR_S = 3600
DAY_S = 86400
FOREVER = 'retention = "0"\n'
ONE_DAY = 'retention = "1d"\n'
HISTORY_WORKER = "history"  # worker_id of the inserted rows: their attempts are found by it


def insert_history(server: BenchServer, n: int, ended_ago_s: int) -> float:
    """n SUCCEEDED tasks in pool "default" with one attempt each, the newest ended ended_ago_s
    ago, written straight into the store of the stopped server; seconds taken."""
    store = tomllib.loads(server.config.read_text())["store"]
    newest = time.time_ns() // 1000 - ended_ago_s * 1_000_000
    first = newest - n  # finished_at first + 1 .. newest, a µs apart
    columns = "pool, payload, run_at, max_attempts, state, attempt, worker_id, created_at, started_at, finished_at"
    started = time.perf_counter()
    if store.get("kind") == "postgres":
        s = store["schema"]

        async def insert() -> None:
            db = await asyncpg.connect(store["url"])
            try:
                await db.execute(
                    f"""WITH t AS (
                        INSERT INTO {s}.tasks ({columns})
                        SELECT 'default', '', e - 2000, 3, 4, 1, '{HISTORY_WORKER}', e - 2000, e - 1000, e
                        FROM (SELECT $1::bigint + g AS e FROM generate_series(1, $2::bigint) g) f
                        RETURNING seq, worker_id, started_at, finished_at)
                    INSERT INTO {s}.attempts (task_seq, attempt, worker_id, started_at, ended_at, outcome)
                    SELECT seq, 1, worker_id, started_at, finished_at, 2 FROM t""",
                    first,
                    n,
                )
                # As a store that has lived with these rows: statistics, and hint bits set.
                await db.execute(f"VACUUM ANALYZE {s}.tasks")
                await db.execute(f"VACUUM ANALYZE {s}.attempts")
                await db.execute("CHECKPOINT")  # its writes are not flushed while the probe is timed
            finally:
                await db.close()

        asyncio.run(insert())
    else:
        db = sqlite3.connect(store["path"], isolation_level=None)
        try:
            db.execute("BEGIN")
            db.execute(
                f"""WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < ?)
                INSERT INTO tasks ({columns})
                SELECT 'default', x'', e - 2000, 3, 4, 1, '{HISTORY_WORKER}', e - 2000, e - 1000, e
                FROM (SELECT ? + i AS e FROM g)""",
                (n, first),
            )
            db.execute(
                "INSERT INTO attempts (task_seq, attempt, worker_id, started_at, ended_at, outcome) "
                "SELECT seq, 1, worker_id, started_at, finished_at, 2 FROM tasks WHERE worker_id = ?",
                (HISTORY_WORKER,),
            )
            db.execute("COMMIT")
        finally:
            db.close()
    return time.perf_counter() - started


def restart(server: BenchServer, pool_was: str = "", pool_now: str = "") -> None:
    """The server stopped and started again on the same store (and config file, the pool
    "default"'s lines pool_was replaced by pool_now)."""
    server.stop()
    if pool_was != pool_now:
        text = server.config.read_text()
        server.config.write_text(text.replace(f'name = "default"\n{pool_was}', f'name = "default"\n{pool_now}', 1))
    server.proc = subprocess.Popen(server.proc.args, stdout=server.log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{server.http_url}/readyz", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("bench server did not become ready after its restart")


def with_history(workdir: Path, url: str | None, n: int, ended_ago_s: int, pool: str = "") -> BenchServer:
    """A server whose store holds n ended tasks (insert_history) besides what it makes itself."""
    workdir.mkdir()
    server = BenchServer(workdir, url, extra_pools=("probe",), default_pool=pool)
    server.stop()  # its schema is made: the rows go in while nothing else writes
    took = insert_history(server, n, ended_ago_s)
    print(f"   {n:,} ended tasks inserted in {took:.1f} s", file=sys.stderr, flush=True)
    restart(server)
    return server


def drain_rate(server: BenchServer, pending: int) -> float:
    """pending no-op tasks submitted, then drained by one worker process (burndown.py's): tasks/s
    from the worker process's start to its last task."""
    asyncio.run(submit_all(server.endpoint, pending, SUBMIT_BATCH, {}, {}))
    # A spawned process, not a fork, as burndown.py: a fork after gRPC was used can hang.
    spawn = mp.get_context("spawn")
    started_at, done_at = spawn.Value("d", 0.0), spawn.Value("d", 0.0)
    proc = spawn.Process(target=run_worker, args=(server.endpoint, CONCURRENCY, 0, pending, started_at, done_at, {}))
    proc.start()
    proc.join(1800)
    if not done_at.value:
        proc.kill()
        raise RuntimeError("the worker did not drain every task")
    return pending / (done_at.value - started_at.value)


def drain(url: str | None, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"empty": [], "history": []}
    for n in range(args.rounds):
        # Each round on fresh stores, which goes first alternating: the machine's drift falls on both.
        for kind in ("empty", "history") if n % 2 == 0 else ("history", "empty"):
            workdir = tmp / f"{kind}-{n}"
            if kind == "history":
                server = with_history(workdir, url, args.history, HOUR_S)
            else:
                workdir.mkdir()
                server = BenchServer(workdir, url)
            try:
                rates[kind].append(drain_rate(server, args.pending))
            finally:
                server.stop()
    empty, history = statistics.median(rates["empty"]), statistics.median(rates["history"])
    return {
        "pending": args.pending,
        "history": args.history,
        "concurrency": CONCURRENCY,
        "rounds": args.rounds,
        "empty_tasks_per_s": round(empty),
        "history_tasks_per_s": round(history),
        "ratio": round(history / empty, 2),
        "round_ratios": [round(h / e, 2) for e, h in zip(rates["empty"], rates["history"], strict=True)],
    }


def purged_total(http_url: str) -> float:
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("cronoq_tasks_purged_total "):
                return float(line.split()[1])
    return 0.0


async def probe_quiet(endpoint: str) -> list[float]:
    async with grpc.aio.insecure_channel(endpoint.removeprefix("http://")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        mine = (await tasks.SubmitTask(tpb.SubmitTaskRequest(pool="probe"))).task.id
        await probe(tasks, mine, 0.5)  # warm up
        return await probe(tasks, mine, QUIET_S)


async def probe_purge(server: BenchServer, n: int) -> tuple[list[float], float]:
    """The probe's calls while the retention service purges n tasks, and the seconds until
    cronoq_tasks_purged_total reaches n."""
    async with grpc.aio.insecure_channel(server.endpoint.removeprefix("http://")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        mine = (await tasks.SubmitTask(tpb.SubmitTaskRequest(pool="probe"))).task.id

        async def until_purged() -> float:
            while await asyncio.to_thread(purged_total, server.http_url) < n:
                await asyncio.sleep(0.2)
            return time.perf_counter()

        done = asyncio.ensure_future(until_purged())
        return await probe(tasks, mine, done), await done


def purge(url: str | None, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    server = with_history(tmp / "history", url, args.history, 2 * DAY_S, pool=FOREVER)
    try:
        quiet = asyncio.run(probe_quiet(server.endpoint))
        started = time.perf_counter()
        restart(server, FOREVER, ONE_DAY)  # the retention service runs at once on the leader
        during, ended = asyncio.run(probe_purge(server, args.history))
        purge_s = ended - started
    finally:
        server.stop()
    result = {
        "history": args.history,
        "purge_s": round(purge_s, 1),
        "rows_per_s": round(args.history / purge_s),
        "quiet": figures(quiet),
        "during": figures(during),
    }
    result["p99_ratio"] = round(result["during"]["p99_ms"] / result["quiet"]["p99_ms"], 2)
    return result


async def until_complete(bulk: Callable[[], Awaitable[Any]]) -> tuple[float, int, int]:
    """A bulk call repeated while it answers incomplete, as bulk.py: (seconds, calls, changed)."""
    started, calls, changed = time.perf_counter(), 0, 0
    while True:
        answer = await bulk()
        calls, changed = calls + 1, changed + answer.changed
        if not answer.incomplete:
            return time.perf_counter() - started, calls, changed


class _Submitted:
    """A TaskService whose SubmitBatch does nothing: make_tasks then only leases and fails
    tasks that exist already."""

    async def SubmitBatch(self, request: Any) -> None:
        return None


async def bulk_retry_delete(endpoint: str, total: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(endpoint.removeprefix("http://")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        workers = worker_service_pb2_grpc.WorkerServiceStub(channel)
        failed = tpb.TaskFilter(pool="default", states=[task_pb2.TASK_STATE_FAILED])
        await make_tasks(tasks, workers, total, fail=True)
        retry_s, retry_calls, retried = await until_complete(
            lambda: tasks.RetryTasks(tpb.RetryTasksRequest(filter=failed), timeout=600)
        )
        await make_tasks(_Submitted(), workers, total, fail=True)
        delete_s, delete_calls, deleted = await until_complete(
            lambda: tasks.DeleteTasks(tpb.DeleteTasksRequest(filter=failed), timeout=600)
        )
    return {
        "retry": {"s": round(retry_s, 2), "calls": retry_calls, "changed": retried},
        "delete": {"s": round(delete_s, 2), "calls": delete_calls, "changed": deleted},
        "ratio": round(delete_s / retry_s, 2),
    }


async def single_deletes(endpoint: str, n: int) -> list[float]:
    """ms of each DeleteTask of n FAILED tasks, one at a time."""
    async with grpc.aio.insecure_channel(endpoint.removeprefix("http://")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        await make_tasks(tasks, worker_service_pb2_grpc.WorkerServiceStub(channel), n, fail=True)
        failed = tpb.TaskFilter(pool="default", states=[task_pb2.TASK_STATE_FAILED])
        ids = [t.id for t in (await tasks.ListTasks(tpb.ListTasksRequest(filter=failed, page_size=n))).tasks]
        took = []
        for task_id in ids:
            started = time.perf_counter()
            await tasks.DeleteTask(tpb.DeleteTaskRequest(task=task_pb2.TaskRef(id=task_id)))
            took.append((time.perf_counter() - started) * 1000)
        return took


def delete(url: str | None, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    server = BenchServer(tmp, url)
    try:
        bulk = asyncio.run(bulk_retry_delete(server.endpoint, args.tasks))
        server.stop()
        took = insert_history(server, args.history, HOUR_S)
        print(f"   {args.history:,} ended tasks inserted in {took:.1f} s", file=sys.stderr, flush=True)
        restart(server)
        single = asyncio.run(single_deletes(server.endpoint, args.deletes))
    finally:
        server.stop()
    return {"tasks": args.tasks, **bulk, "history": args.history, "single": figures(single)}


async def debounce_calls(endpoint: str, calls: int, keys: int, callers: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(endpoint.removeprefix("http://")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        took: list[float] = []
        turns = iter(range(calls))  # shared: each caller takes the next call

        async def caller() -> None:
            for i in turns:
                request = tpb.SubmitTaskRequest(
                    pool="default", key=f"k{i % keys}", key_mode=task_pb2.KEY_MODE_DEBOUNCE, debounce_ms=60_000
                )
                started = time.perf_counter()
                await tasks.SubmitTask(request)
                took.append((time.perf_counter() - started) * 1000)

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        elapsed = time.perf_counter() - started
        created, token = 0, ""
        while True:
            page = await tasks.ListTasks(tpb.ListTasksRequest(pool="default", page_size=1000, page_token=token))
            created, token = created + len(page.tasks), page.next_page_token
            if not token:
                break
    return {
        "calls": calls,
        "keys": keys,
        "callers": callers,
        "submits_per_s": round(calls / elapsed),
        "p50_ms": round(percentile(took, 50), 2),
        "p99_ms": round(percentile(took, 99), 2),
        "tasks_created": created,
    }


def debounce(url: str | None, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    server = BenchServer(tmp, url)
    try:
        return asyncio.run(debounce_calls(server.endpoint, args.calls, args.keys, args.callers))
    finally:
        server.stop()


def text(r: dict[str, Any]) -> str:
    """The human line of a workload's result."""
    store, workload = r["store"], r["workload"]
    if workload == "drain":
        return (
            f"{store}: drain of {r['pending']:,} no-op tasks (1 worker process, concurrency {r['concurrency']}): "
            f"{r['empty_tasks_per_s']:,} tasks/s with no history, {r['history_tasks_per_s']:,} tasks/s beside "
            f"{r['history']:,} ended tasks = {r['ratio']}× (target ≥ 0.8; median of {r['rounds']})"
        )
    if workload == "purge":
        q, d = r["quiet"], r["during"]
        return (
            f"{store}: purge of {r['history']:,} ended tasks past retention in {r['purge_s']} s from the restart "
            f"({r['rows_per_s']:,} rows/s); another caller's GetTask/SubmitTask p50 {q['p50_ms']} → {d['p50_ms']} ms, "
            f"p99 {q['p99_ms']} → {d['p99_ms']} ms ({r['p99_ratio']}× quiet, target ≤ 1.5)"
        )
    if workload == "delete":
        s = r["single"]
        return (
            f"{store}: {r['tasks']:,} FAILED tasks: RetryTasks {r['retry']['s']} s ({r['retry']['calls']} call(s)), "
            f"DeleteTasks {r['delete']['s']} s ({r['delete']['calls']} call(s)) = {r['ratio']}× (target ≤ 2); "
            f"DeleteTask beside {r['history']:,} ended tasks p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms "
            f"({s['calls']} calls, target p99 ≤ 10 ms)"
        )
    return (
        f"{store}: {r['calls']:,} debounced SubmitTask over {r['keys']} keys from {r['callers']} callers: "
        f"{r['submits_per_s']:,} submits/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms; "
        f"{r['tasks_created']} task(s) created (expected {r['keys']})"
    )


WORKLOADS = {"drain": drain, "purge": purge, "delete": delete, "debounce": debounce}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="workload", required=True)
    parsers = {name: sub.add_parser(name) for name in WORKLOADS}
    for name, p in parsers.items():
        add_store_arguments(p)
        p.add_argument("--json", action="store_true", help="print one JSON line")
        if name != "debounce":
            p.add_argument("--history", type=int, default=1_000_000, help="ended tasks inserted in the store")
    parsers["drain"].add_argument("--pending", type=int, default=100_000)
    parsers["drain"].add_argument("--rounds", type=int, default=1, help="medians of rounds on fresh stores")
    parsers["delete"].set_defaults(store="postgres")
    parsers["delete"].add_argument("--tasks", type=int, default=20_000, help="FAILED tasks retried, then deleted")
    parsers["delete"].add_argument("--deletes", type=int, default=200, help="tasks deleted one DeleteTask each")
    parsers["debounce"].add_argument("--calls", type=int, default=100_000)
    parsers["debounce"].add_argument("--keys", type=int, default=100)
    parsers["debounce"].add_argument("--callers", type=int, default=8)
    args = ap.parse_args()
    with bench_store(args.store, args.url) as url, tempfile.TemporaryDirectory() as tmp:
        result = {"workload": args.workload, "store": args.store, **WORKLOADS[args.workload](url, args, Path(tmp))}
    print(json.dumps(result) if args.json else text(result))


if __name__ == "__main__":
    main()
