"""Interleavings only PostgreSQL allows (its transactions overlap), forced deterministically
by holding a table lock from another connection while a store call is mid-transaction."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import asyncpg
from conftest import make_settings, open_postgres

from cronoq_server.store.base import NewTask, Outcome, OutcomeKind, State
from cronoq_server.store.postgres import PostgresStore

T0 = 1_700_000_000_000_000


def new(dep_seqs: list[int] | None = None) -> NewTask:
    return NewTask("default", None, b"", "", 0, None, 3, dep_seqs=list(dep_seqs or []))


async def _wait_until_blocked(conn: asyncpg.Connection, timeout: float = 10.0) -> None:
    """Until some backend waits on a lock (the store call is parked mid-transaction)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted)"):
        assert loop.time() < deadline, "the submission never reached the lock"
        await asyncio.sleep(0.01)


async def test_sweep_during_a_dependent_submission_does_not_strand_it(tmp_path: Path, postgres: Any) -> None:
    """The sweep checks for BLOCKED tasks while a dependent's submission has inserted it but not
    committed: the check sees none. The dependency's success must still release the dependent."""
    store = await open_postgres(tmp_path, make_settings(), postgres.url)
    assert isinstance(store, PostgresStore)
    holder = await asyncpg.connect(postgres.url)
    try:
        (dep,), _ = await store.submit([new()], T0)
        (leased,), _ = await store.lease("w1", ["default"], 1, T0)
        await holder.execute("BEGIN")
        await holder.execute(f"LOCK TABLE {store._s}.deps IN EXCLUSIVE MODE")
        submitting = asyncio.create_task(store.submit([new(dep_seqs=[dep.row.seq])], T0 + 1))
        await _wait_until_blocked(holder)  # the dependent is inserted, its deps row waits
        await store.expire_leases(T0 + 2)  # the leader's sweep runs in that window
        await holder.execute("ROLLBACK")
        (dependent,), _ = await submitting
        assert dependent.row.state == State.BLOCKED
        results, _ = await store.finish("w1", [Outcome(leased.seq, leased.attempt, OutcomeKind.SUCCESS)], T0 + 3)
        assert results[0].accepted
        assert (await store.get(dependent.row.seq)).state == State.PENDING  # type: ignore[union-attr]
    finally:
        await holder.close()
        await store.close()


async def test_success_racing_a_dependent_submission_releases_it(tmp_path: Path, postgres: Any) -> None:
    """The dependency's success is reported while the dependent's submission
    holds its dependency row under a share lock: the success waits for that commit, then sees
    and releases the dependent."""
    store = await open_postgres(tmp_path, make_settings(), postgres.url)
    assert isinstance(store, PostgresStore)
    holder = await asyncpg.connect(postgres.url)
    try:
        (dep,), _ = await store.submit([new()], T0)
        (leased,), _ = await store.lease("w1", ["default"], 1, T0)
        await store.expire_leases(T0)  # nothing BLOCKED: successes may take the fast path
        await holder.execute("BEGIN")
        await holder.execute(f"LOCK TABLE {store._s}.deps IN EXCLUSIVE MODE")
        submitting = asyncio.create_task(store.submit([new(dep_seqs=[dep.row.seq])], T0 + 1))
        await _wait_until_blocked(holder)
        finishing = asyncio.create_task(
            store.finish("w1", [Outcome(leased.seq, leased.attempt, OutcomeKind.SUCCESS)], T0 + 2)
        )
        await asyncio.sleep(0.2)  # the success is now waiting for the dependency row's share lock
        await holder.execute("ROLLBACK")
        (dependent,), _ = await submitting
        results, _ = await finishing
        assert results[0].accepted
        assert (await store.get(dependent.row.seq)).state == State.PENDING  # type: ignore[union-attr]
    finally:
        await holder.close()
        await store.close()
