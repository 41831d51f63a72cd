"""procrastinate anchor: the burn-down and latency workloads of bench/burndown.py and
bench/latency.py, run against procrastinate on a PostgreSQL server. Runs with the
bench's own virtualenv (bench/anchors.py creates it); never imported by cronoq.

    bench/.venv-anchors/bin/python bench/anchor_procrastinate.py burndown --url URL [--tasks 20000] [--json]
    bench/.venv-anchors/bin/python bench/anchor_procrastinate.py latency --url URL [--rate 1000] [--batch 1] [--json]

Set up as procrastinate's docs recommend for throughput: schema applied as
`procrastinate schema --apply` does (SchemaManager.apply_schema_async), an async no-op
task, one worker process running `app.run_worker_async(concurrency=30, listen_notify=True)`
(what `procrastinate worker --concurrency=30` runs), with the PsycopgConnector pool sized
concurrency + 1 ("the shorter your average job execution time, the more your pool will
need to contain as many connections as your concurrency (plus one)", docs/discussions.md),
and logging at WARNING (the CLI's default INFO logs two lines per job). Jobs are deferred
with `defer_async` (one job per call) or `batch_defer_async`; finished jobs are kept
(delete_jobs="never", the default) unless --delete-jobs says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).parent))

import procrastinate
import psycopg
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

SYSTEM = "procrastinate"
TASK = "noop"
T = TypeVar("T")


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=30, help="worker concurrency (sub-workers)")
    p.add_argument(
        "--delete-jobs",
        choices=["never", "successful", "always"],
        default="never",
        help="worker delete_jobs (default: keep finished jobs, procrastinate's default)",
    )
    p.add_argument(
        "--loop",
        choices=["asyncio", "uvloop"],
        default="asyncio",
        help="event loop of worker and producer (the procrastinate CLI uses asyncio.run)",
    )


def make_app(db_url: str, pool_size: int, state: WorkerState | None = None) -> procrastinate.App:
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=db_url, min_size=pool_size, max_size=pool_size)
    )

    @app.task(name=TASK)
    async def noop(t: float | None = None) -> None:
        if state is not None:
            state.job_started(t)

    return app


# ---- the worker process ------------------------------------------------------------------------


async def worker_main(args: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    state = WorkerState(args)
    stop = asyncio.Event()
    install_stop_signals(stop.set)
    state.ready()
    app = make_app(args.url, args.concurrency + 1, state)
    try:
        async with app.open_async():
            # docs/howto/basics/worker.md: run the worker as a task, cancel it to stop gracefully.
            worker = asyncio.create_task(
                app.run_worker_async(
                    concurrency=args.concurrency,
                    listen_notify=True,
                    delete_jobs=args.delete_jobs,
                    install_signal_handlers=False,
                )
            )
            done = asyncio.create_task(state.done.wait())
            stopped = asyncio.create_task(stop.wait())
            finished, _ = await asyncio.wait(
                {worker, done, stopped}, timeout=args.timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not finished:
                log(f"[{SYSTEM} worker] timed out after {args.timeout:.0f}s with {state.count}/{state.total} jobs")
            for t in (done, stopped):
                t.cancel()
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(worker, 30)
    finally:
        state.write_result()


# ---- the bench side -----------------------------------------------------------------------------


def make_hooks(args: Any) -> dict[str, Any]:
    def admin(sql: str, url: str = args.url) -> None:
        with psycopg.connect(url, autocommit=True, connect_timeout=30) as conn:
            conn.execute(sql)

    def create_db(name: str) -> None:
        admin(f'CREATE DATABASE "{name}"')

    def drop_db(name: str) -> None:
        admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def analyze(db_url: str) -> None:
        admin("ANALYZE", db_url)

    def install_schema(db_url: str) -> None:
        async def go() -> None:
            async with make_app(db_url, 1).open_async() as app:
                await asyncio.wait_for(app.schema_manager.apply_schema_async(), 120)

        log(f"[{SYSTEM}] applying schema")
        asyncio.run(go())

    @contextlib.asynccontextmanager
    async def producer(db_url: str) -> AsyncIterator[Any]:
        async with make_app(db_url, 20).open_async() as app:
            yield app.tasks[TASK]

    def enqueue_burndown(db_url: str, total: int, batch: int) -> float:
        async def go() -> float:
            async with producer(db_url) as task:

                async def submit_batch(n: int) -> None:
                    await task.batch_defer_async(*({} for _ in range(n)))

                return await asyncio.wait_for(enqueue_all(submit_batch, total, batch), 600)

        return run_loop(args.loop, go())

    def enqueue_latency(db_url: str, rate: int, seconds: float, batch: int) -> tuple[int, float]:
        async def go() -> tuple[int, float]:
            async with producer(db_url) as task:

                async def submit_one(t: float) -> None:
                    await task.defer_async(t=t)

                async def submit_batch(n: int, t: float) -> None:
                    await task.batch_defer_async(*({"t": t} for _ in range(n)))

                return await asyncio.wait_for(
                    submit_at_rate(submit_one, submit_batch, rate, seconds, batch), seconds * 3 + 60
                )

        return run_loop(args.loop, go())

    def verify(db_url: str) -> dict[str, Any]:
        with psycopg.connect(db_url, connect_timeout=30) as conn:
            rows = dict(conn.execute("SELECT status::text, count(*) FROM procrastinate_jobs GROUP BY 1").fetchall())
        return {"succeeded": rows.get("succeeded", 0), "left_in_queue": rows.get("todo", 0) + rows.get("doing", 0)}

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
    extra = ["--concurrency", str(args.concurrency), "--delete-jobs", args.delete_jobs, "--loop", args.loop]
    started = time.monotonic()
    result = run_bench(SYSTEM, __file__, args, worker_extra=extra, **make_hooks(args))
    result["version"] = procrastinate.__version__
    log(f"[{SYSTEM}] {args.kind} done in {time.monotonic() - started:.1f}s")
    emit(result, args.json)


if __name__ == "__main__":
    # Run from the module, not __main__: procrastinate warns about (and its docs advise against)
    # an App created in the __main__ module (docs/discussions.md, "top-level-app").
    import anchor_procrastinate

    anchor_procrastinate.main()
