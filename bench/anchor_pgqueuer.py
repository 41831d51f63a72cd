"""PgQueuer anchor: the burn-down and latency workloads of bench/burndown.py and
bench/latency.py, run against PgQueuer on a PostgreSQL server. Runs with the
bench's own virtualenv (bench/anchors.py creates it); never imported by cronoq.

    bench/.venv-anchors/bin/python bench/anchor_pgqueuer.py burndown --url URL [--tasks 20000] [--json]
    bench/.venv-anchors/bin/python bench/anchor_pgqueuer.py latency --url URL [--rate 1000] [--batch 1] [--json]

Set up as PgQueuer's docs recommend for throughput (docs/guides/performance-tuning.md):
`pgq install` then `pgq autovac` (the CLI, pointed at the run's own database with
--pg-dsn); the worker is what `pgq run` runs (`pgqueuer.run(factory, batch_size=25)`,
on uvloop as the CLI does) over one dedicated asyncpg connection, with one in-process
async entrypoint that does nothing; producers use an asyncpg pool (AsyncpgPoolDriver).
Tables keep the default durability ("durable", logged) unless --durability says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).parent))

import asyncpg
import pgqueuer
from _anchor_common import (
    WorkerState,
    build_parser,
    emit,
    enqueue_all,
    install_stop_signals,
    log,
    run_bench,
    run_loop,
    submit_at_rate,
)
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgPoolDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries

SYSTEM = "pgqueuer"
ENTRYPOINT = "noop"
PGQ = Path(sys.executable).with_name("pgq")  # the CLI installed next to this interpreter
T = TypeVar("T")


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=25, help="worker dequeue batch size (pgq run --batch-size)")
    p.add_argument(
        "--durability",
        choices=["durable", "balanced", "volatile"],
        default="durable",
        help="pgq install --durability (balanced/volatile make tables UNLOGGED)",
    )
    p.add_argument(
        "--loop",
        choices=["uvloop", "asyncio"],
        default="uvloop",
        help="event loop of worker and producer (the pgq CLI uses uvloop)",
    )


# ---- the worker process ------------------------------------------------------------------------


async def worker_main(args: Any) -> None:
    state = WorkerState(args)
    shutdown = asyncio.Event()
    install_stop_signals(shutdown.set)

    @contextlib.asynccontextmanager
    async def factory() -> AsyncIterator[PgQueuer]:
        # What a `pgq run module:factory` factory looks like: a dedicated connection for the
        # QueueManager (docs: "Use a direct asyncpg connection (not a pool) for the QueueManager").
        connection = await asyncpg.connect(args.url)
        try:
            pgq = PgQueuer.from_asyncpg_connection(connection)

            if args.mode == "latency":

                @pgq.entrypoint(ENTRYPOINT)
                async def record(job: Job) -> None:
                    state.job_started(json.loads(job.payload or b"{}")["t"])
            else:

                @pgq.entrypoint(ENTRYPOINT)
                async def noop(job: Job) -> None:
                    state.job_started(None)

            yield pgq
        finally:
            await connection.close(timeout=10)

    async def stop_when_done() -> None:
        await state.done.wait()
        shutdown.set()

    stopper = asyncio.create_task(stop_when_done())
    state.ready()
    try:
        await asyncio.wait_for(pgqueuer.run(factory, batch_size=args.batch_size, shutdown=shutdown), args.timeout)
    except TimeoutError:
        log(f"[{SYSTEM} worker] timed out after {args.timeout:.0f}s with {state.count}/{state.total} jobs")
    finally:
        stopper.cancel()
        state.write_result()


# ---- the bench side -----------------------------------------------------------------------------


def make_hooks(args: Any) -> dict[str, Any]:
    async def admin(sql: str, url: str = args.url) -> None:
        conn = await asyncpg.connect(url, timeout=30)
        try:
            await conn.execute(sql, timeout=60)
        finally:
            await conn.close(timeout=10)

    def create_db(name: str) -> None:
        asyncio.run(admin(f'CREATE DATABASE "{name}"'))

    def drop_db(name: str) -> None:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    def analyze(db_url: str) -> None:
        asyncio.run(admin("ANALYZE", db_url))

    def pgq_cli(db_url: str, *cmd: str) -> None:
        log(f"[{SYSTEM}] pgq {' '.join(cmd)}")
        subprocess.run([str(PGQ), "--pg-dsn", db_url, *cmd], check=True, timeout=120, stdout=sys.stderr)

    def install_schema(db_url: str) -> None:
        pgq_cli(db_url, "install", "--durability", args.durability)
        pgq_cli(db_url, "autovac")

    @contextlib.asynccontextmanager
    async def producer(db_url: str) -> AsyncIterator[Queries]:
        # docs/guides/performance-tuning.md: "Use AsyncpgPoolDriver for producers"
        async with asyncpg.create_pool(db_url, min_size=5, max_size=20) as pool:
            yield Queries(AsyncpgPoolDriver(pool))

    def enqueue_burndown(db_url: str, total: int, batch: int) -> float:
        async def go() -> float:
            async with producer(db_url) as q:

                async def submit_batch(n: int) -> None:
                    await q.enqueue([ENTRYPOINT] * n, [b""] * n, [0] * n)

                return await asyncio.wait_for(enqueue_all(submit_batch, total, batch), 600)

        return run_loop(args.loop, go())

    def enqueue_latency(db_url: str, rate: int, seconds: float, batch: int) -> tuple[int, float]:
        async def go() -> tuple[int, float]:
            async with producer(db_url) as q:

                async def submit_one(t: float) -> None:
                    await q.enqueue(ENTRYPOINT, json.dumps({"t": t}).encode())

                async def submit_batch(n: int, t: float) -> None:
                    payload = json.dumps({"t": t}).encode()
                    await q.enqueue([ENTRYPOINT] * n, [payload] * n, [0] * n)

                return await asyncio.wait_for(
                    submit_at_rate(submit_one, submit_batch, rate, seconds, batch), seconds * 3 + 60
                )

        return run_loop(args.loop, go())

    def verify(db_url: str) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            conn = await asyncpg.connect(db_url, timeout=30)
            try:
                left = await conn.fetchval("SELECT count(*) FROM pgqueuer", timeout=30)
                done = await conn.fetchval("SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'", timeout=30)
            finally:
                await conn.close(timeout=10)
            return {"succeeded": done, "left_in_queue": left}

        return asyncio.run(go())

    return {
        "create_db": create_db,
        "drop_db": drop_db,
        "install_schema": install_schema,
        "enqueue_burndown": enqueue_burndown,
        "enqueue_latency": enqueue_latency,
        "verify": verify,
        "analyze": analyze,
    }


def main() -> None:
    args = build_parser(__doc__, options).parse_args()
    if args.kind == "_worker":
        run_loop(args.loop, worker_main(args))
        return
    extra = ["--batch-size", str(args.batch_size), "--loop", args.loop]
    started = time.monotonic()
    result = run_bench(SYSTEM, __file__, args, worker_extra=extra, **make_hooks(args))
    result["version"] = pgqueuer.__version__
    log(f"[{SYSTEM}] {args.kind} done in {time.monotonic() - started:.1f}s")
    emit(result, args.json)


if __name__ == "__main__":
    main()
