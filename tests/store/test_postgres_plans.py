"""The statements of Work steps on PostgreSQL (the plain lease, the finish, both in one) run on
the step pool's connections with the generic plan: planned once a connection, not per call."""

from __future__ import annotations

import uuid
from typing import Any

from conftest import make_settings

from cronoq_server.store.base import NewTask, Outcome, OutcomeKind
from cronoq_server.store.postgres import PostgresStore

T0 = 1_700_000_000_000_000

# What pg_prepared_statements says of the step statements a connection prepared.
PLANS = (
    "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0), count(*)"
    " FROM pg_prepared_statements WHERE (statement LIKE '%leased AS%' OR statement LIKE '%ended AS%')"
    " AND statement NOT LIKE '%pg_prepared_statements%'"
)


async def test_work_steps_keep_one_generic_plan_on_the_step_pool(postgres: Any) -> None:
    store = PostgresStore(postgres.url, f"plans_{uuid.uuid4().hex[:10]}", make_settings(), 8, 1)
    await store.open()
    try:
        await store.submit([NewTask("default", None, b"", "", 0, None, 3) for _ in range(40)], T0)
        await store.expire_leases(T0)  # the sweep sees no BLOCKED task: successes take the fast path
        held, _ = await store.lease("w1", ["default"], 2, T0)
        for step in range(12):  # finish what is held and lease as many again, as a Work step does
            outcomes = [Outcome(t.seq, t.attempt, OutcomeKind.SUCCESS) for t in held]
            results, _, held, _ = await store.finish_and_lease("w1", outcomes, ["default"], 2, T0 + step + 1)
            assert all(r.accepted for r in results) and len(held) == 2
        await store.finish("w1", [Outcome(t.seq, t.attempt, OutcomeKind.SUCCESS) for t in held], T0 + 20)
        assert store._step_pool is not None
        async with store._step_pool.acquire() as conn:
            generic, custom, statements = await conn.fetchrow(PLANS)
        assert (statements, custom) == (3, 0)  # the lease, the step, the finish: none planned per call
        assert generic == 14  # every execution ran the one generic plan
        async with store.pool.acquire() as conn:
            assert (await conn.fetchrow(PLANS))[2] == 0  # none ran on the other pool's connections
    finally:
        await store.close()


async def test_without_a_step_pool_steps_run_on_the_pool(postgres: Any) -> None:
    store = PostgresStore(postgres.url, f"plans_{uuid.uuid4().hex[:10]}", make_settings(), 1, 0)
    await store.open()
    try:
        await store.submit([NewTask("default", None, b"", "", 0, None, 3)], T0)
        await store.expire_leases(T0)
        (task,), _ = await store.lease("w1", ["default"], 1, T0)
        results, _, _, _ = await store.finish_and_lease(
            "w1", [Outcome(task.seq, task.attempt, OutcomeKind.SUCCESS)], ["default"], 1, T0 + 1
        )
        assert results[0].accepted and store._step_pool is None
        async with store.pool.acquire() as conn:
            assert (await conn.fetchrow(PLANS))[2] == 2
    finally:
        await store.close()


async def test_only_tasks_with_a_key_have_an_entry_in_the_unique_index_of_keys(postgres: Any) -> None:
    """A task's row is inserted again into every index on each lease and end (never HOT: `state`
    is in the partial indexes' predicates); the index of keys spares the tasks without one, and
    is still what finds a key and refuses a second task with it."""
    store = PostgresStore(postgres.url, f"plans_{uuid.uuid4().hex[:10]}", make_settings(), 2, 0)
    await store.open()
    try:
        await store.submit([NewTask("default", None, b"", "", 0, None, 3) for _ in range(30)], T0)
        (keyed,), _ = await store.submit([NewTask("default", "k-1", b"", "", 0, None, 3)], T0)
        (again,), _ = await store.submit([NewTask("default", "k-1", b"", "", 0, None, 3)], T0)
        assert again.deduplicated and again.row.seq == keyed.row.seq
        async with store.pool.acquire() as conn:
            await conn.execute(store._sql("ANALYZE {s}.tasks"))
            definition = await conn.fetchval(
                "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'tasks_key'", store.schema
            )
            assert definition.endswith("WHERE (key IS NOT NULL)") and "UNIQUE" in definition
            assert await conn.fetchval(
                "SELECT reltuples FROM pg_class WHERE oid = $1::regclass", f'"{store.schema}".tasks_key'
            ) == 1
            await conn.execute("SET enable_seqscan = off")  # 31 rows: is the index usable at all
            for lookup, arg in (("key = $1", "k-1"), ("key = ANY($1::text[])", ["k-1"])):
                sql = store._sql(f"EXPLAIN SELECT seq FROM {{s}}.tasks WHERE {lookup} AND key IS NOT NULL")
                plan = "\n".join(r[0] for r in await conn.fetch(sql, arg))
                assert "tasks_key" in plan, plan
        assert (await store.get_by_key("k-1")).seq == keyed.row.seq  # type: ignore[union-attr]
    finally:
        await store.close()
