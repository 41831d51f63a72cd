"""Concurrent submissions, as group commit joins them: each call keeps its own answer and
error, and later calls of a group see what earlier ones wrote (keys, limits, request_ids)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import make_settings, open_postgres
from test_store import T0, new

from cronoq_server.errors import ApiError
from cronoq_server.store.base import State, Store
from cronoq_server.store.postgres import PostgresStore

N = 40


async def all_rows(store: Store) -> list[Any]:
    return await store.list_tasks(None, None, 0, 10_000)


async def test_one_failing_call_fails_alone(store: Store) -> None:
    await store.submit([new(key="dep")], T0)
    calls = []
    for i in range(N):
        if i == N // 2:
            calls.append(store.submit([new(key="bad", dep_keys=["missing"])], T0))
        elif i % 3 == 0:
            calls.append(store.submit([new(key=f"k{i}", dep_keys=["dep"])], T0))
        elif i % 3 == 1:
            calls.append(store.submit([new(key=f"k{i}")], T0, request_id=f"r{i}"))
        else:
            calls.append(store.submit([new(), new()], T0, request_id=f"r{i}"))
    results = await asyncio.gather(*calls, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == 1 and isinstance(results[N // 2], ApiError)
    assert results[N // 2].code == grpc.StatusCode.NOT_FOUND  # type: ignore[union-attr]
    created = [s.row for r in results if not isinstance(r, BaseException) for s in r[0]]
    assert all(not s.deduplicated for r in results if not isinstance(r, BaseException) for s in r[0])
    rows = {r.seq: r for r in await all_rows(store)}
    assert len({r.seq for r in created}) == len(created) == len(rows) - 1  # each once, plus dep
    for row in created:
        assert rows[row.seq].key == row.key and rows[row.seq].state == row.state
        assert row.state == (State.BLOCKED if row.depends_on else State.PENDING)
    assert await store.get_by_key("bad") is None


async def test_pending_limit_counts_earlier_calls_of_the_group(open_store: Any) -> None:
    store: Store = await open_store(max_pending_total=10)
    results = await asyncio.gather(*[store.submit([new(key=f"k{i}")], T0) for i in range(25)], return_exceptions=True)
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(ok) == 10 and len(refused) == 15
    assert all(isinstance(e, ApiError) and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    rows = await all_rows(store)
    assert sorted(r.key or "" for r in rows) == sorted(r[0][0].row.key or "" for r in ok)


async def test_concurrent_calls_with_one_key_create_one_task(store: Store) -> None:
    results = await asyncio.gather(*[store.submit([new(key="same")], T0) for _ in range(N)])
    seqs = {subs[0].row.seq for subs, _ in results}
    assert len(seqs) == 1
    assert sum(not subs[0].deduplicated for subs, _ in results) == 1
    assert len(await all_rows(store)) == 1


@pytest.mark.parametrize("keyed", [False, True])
async def test_concurrent_repeats_of_a_request_id_create_once(store: Store, keyed: bool) -> None:
    def batch() -> list[Any]:
        return [new(key="a" if keyed else None), new()]

    calls = []
    for i in range(N):
        calls.append(store.submit(batch(), T0, request_id="rep"))
        calls.append(store.submit([new()], T0, request_id=f"other-{i}"))
    results = await asyncio.gather(*calls)
    repeats = [subs for subs, _ in results[0::2]]
    assert len({tuple(s.row.seq for s in subs) for subs in repeats}) == 1
    assert sum(bool(changes) for _, changes in results[0::2]) == 1  # only the first created
    assert len(await all_rows(store)) == 2 + N


async def test_concurrent_submissions_share_transactions(tmp_path: Path, postgres: Any) -> None:
    """On PostgreSQL, calls made while a group commits go together in the next one."""
    store = await open_postgres(tmp_path, make_settings(), postgres.url)
    assert isinstance(store, PostgresStore)
    try:
        await _share_transactions(store)
    finally:
        await store.close()


async def _share_transactions(store: PostgresStore) -> None:
    groups: list[int] = []
    commit = store._commit_group

    async def counted(group: Any) -> None:
        groups.append(len(group))
        await commit(group)

    store._commit_group = counted  # type: ignore[method-assign]
    await asyncio.gather(*[store.submit([new(key=f"k{i}")], T0) for i in range(N)])
    assert sum(groups) == N and len(groups) < N
    groups.clear()
    await store.submit([new()], T0)  # alone: committed at once, in a group of its own
    assert groups == [1]
