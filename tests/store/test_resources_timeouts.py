"""Leases that admit tasks by resources, and execution timeouts, on every backend."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from test_store import SEC, T0, failure, finish_ok, new

from cronoq_server.store.base import Held, Store, StoreSettings


def with_resources(resources: dict[str, int], **kw) -> object:
    return dataclasses.replace(new(**kw), resources=resources)


async def test_tasks_that_do_not_fit_are_skipped_without_blocking_those_behind(store: Store) -> None:
    subs, _ = await store.submit(
        [
            with_resources({"gpu": 1}, priority=9),
            with_resources({"gpu": 1}, priority=8),
            new(priority=1),
            new(priority=0),
        ],  # type: ignore[list-item]
        T0,
    )
    gpu_a, gpu_b, plain_a, plain_b = (s.row.seq for s in subs)
    rows, _ = await store.lease("w1", ["default"], 10, T0, free={"gpu": 1})
    assert [r.seq for r in rows] == [gpu_a, plain_a, plain_b]  # the second gpu task waits, plain ones run
    assert (await store.get(gpu_b)).state.name == "PENDING"  # type: ignore[union-attr]
    rows, _ = await store.lease("w1", ["default"], 10, T0, free={})  # gpu used up: not looked at
    assert rows == []


async def test_resources_used_up_are_skipped_and_free_is_never_exceeded(store: Store) -> None:
    subs, _ = await store.submit(
        [
            with_resources({"gpu": 2}),  # more than is free alone: skipped
            with_resources({"gpu": 1, "api": 1}),
            with_resources({"api": 1}),
            with_resources({"api": 1}),  # api would then be over: skipped
            with_resources({"disk": 1}),  # not available at all
            new(),
        ],  # type: ignore[list-item]
        T0,
    )
    seqs = [s.row.seq for s in subs]
    rows, _ = await store.lease("w1", ["default"], 10, T0, free={"gpu": 1, "api": 2})
    assert sorted(r.seq for r in rows) == [seqs[1], seqs[2], seqs[5]]
    rows, _ = await store.lease("w1", ["default"], 10, T0, free={"gpu": 2, "api": 1, "disk": 1})
    assert sorted(r.seq for r in rows) == [seqs[0], seqs[3], seqs[4]]


async def test_resource_lease_respects_limit_and_bytes(store: Store) -> None:
    subs, _ = await store.submit([with_resources({"gpu": 1}, payload=b"x" * 1000) for _ in range(5)], T0)  # type: ignore[misc]
    rows, _ = await store.lease("w1", ["default"], 3, T0, free={"gpu": 10})
    assert [r.seq for r in rows] == [s.row.seq for s in subs[:3]]
    rows, _ = await store.lease("w1", ["default"], 10, T0, max_bytes=1500, free={"gpu": 10})
    assert [r.seq for r in rows] == [subs[3].row.seq]  # the first always; the second does not fit


async def test_running_resources_lists_running_tasks_that_name_resources(store: Store) -> None:
    subs, _ = await store.submit([with_resources({"gpu": 2}), new(), with_resources({"api": 1})], T0)  # type: ignore[list-item]
    rows, _ = await store.lease("w1", ["default"], 2, T0, free={"gpu": 2, "api": 1})
    assert len(rows) == 2
    assert await store.running_resources() == [("w1", Held(subs[0].row.seq, 1, {"gpu": 2}, "default", ""))]


async def test_expiry_reports_the_attempts_it_ended(store: Store, settings: StoreSettings) -> None:
    (sub,), _ = await store.submit([with_resources({"gpu": 1})], T0)  # type: ignore[list-item]
    await store.lease("w1", ["default"], 1, T0, free={"gpu": 1})
    _changes, ended = await store.expire_leases(T0 + settings.lease_ttl_us["default"] + 1)
    assert ended == [(sub.row.seq, 1)]
    assert await store.running_resources() == []


async def test_lease_never_outlives_the_attempts_deadline(store: Store, settings: StoreSettings) -> None:
    ttl = settings.lease_ttl_us["default"]
    short = dataclasses.replace(new(), timeout_ms=2000)  # 2 s, well under the 10 s lease TTL
    long = dataclasses.replace(new(), timeout_ms=60_000)
    subs, _ = await store.submit([short, long], T0)
    assert [s.row.timeout_ms for s in subs] == [2000, 60_000]
    rows, _ = await store.lease("w1", ["default"], 2, T0)
    expiry = {r.seq: r.lease_expires_at for r in rows}
    assert expiry[subs[0].row.seq] == T0 + 2 * SEC
    assert expiry[subs[1].row.seq] == T0 + ttl
    # Heartbeats extend the lease, but never past started_at + timeout.
    attempts = [(r.seq, r.attempt) for r in rows]
    cancelled, lost = await store.heartbeat("w1", attempts, T0 + 1 * SEC)
    assert (cancelled, lost) == ([], [])
    assert (await store.get(subs[0].row.seq)).lease_expires_at == T0 + 2 * SEC  # type: ignore[union-attr]
    assert (await store.get(subs[1].row.seq)).lease_expires_at == T0 + 1 * SEC + ttl  # type: ignore[union-attr]
    # A worker that hangs loses the task at its deadline: the lease expires then.
    _changes, ended = await store.expire_leases(T0 + 2 * SEC + 1)
    assert ended == [(subs[0].row.seq, 1)]
    task = await store.get(subs[0].row.seq)
    assert task is not None and task.state.name == "PENDING" and task.error == "lease expired"


async def test_timeout_is_kept_across_retries(store: Store) -> None:
    (_sub,), _ = await store.submit([dataclasses.replace(new(), timeout_ms=1500)], T0)
    rows, _ = await store.lease("w1", ["default"], 1, T0)
    await finish_ok(store, failure(rows[0]), T0 + SEC)
    rows, _ = await store.lease("w1", ["default"], 1, T0 + 10 * SEC)
    assert rows[0].attempt == 2 and rows[0].lease_expires_at == T0 + 10 * SEC + 1500 * 1000


async def test_a_stored_timeout_near_int64_max_does_not_fail_the_pools_leases(
    store: Store, settings: StoreSettings
) -> None:
    """The API refuses a timeout_ms over 7 days; one stored before it did (2^63 - 1 once made every
    lease of its pool fail on PostgreSQL: bigint out of range) is taken as 7 days."""
    ttl = settings.lease_ttl_us["default"]
    subs, _ = await store.submit([dataclasses.replace(new(), timeout_ms=2**63 - 1), new()], T0)
    rows, _ = await store.lease("w1", ["default"], 2, T0)
    assert sorted(r.seq for r in rows) == sorted(s.row.seq for s in subs)
    assert {r.lease_expires_at for r in rows} == {T0 + ttl}
    assert await store.heartbeat("w1", [(r.seq, r.attempt) for r in rows], T0 + SEC) == ([], [])


async def test_a_keyed_lease_looks_up_the_key_then_the_full_size(store: Store) -> None:
    subs, _ = await store.submit(
        [
            with_resources({"conn:a": 1}, priority=9),  # key a is at its limit: skipped
            with_resources({"conn:b": 2}, priority=8),  # a fresh key: the full size
            with_resources({"conn:b": 1}, priority=7),  # b would then be over: skipped
            with_resources({"conn:c": 1, "gpu": 1}, priority=6),
            with_resources({"conn:d": 3}, priority=5),  # more than the full size
            new(priority=1),
        ],  # type: ignore[list-item]
        T0,
    )
    seqs = [s.row.seq for s in subs]
    free = {"conn:": 2, "conn:a": 0, "gpu": 1}
    rows, _ = await store.lease("w1", ["default"], 10, T0, free=free)
    assert [r.seq for r in rows] == [seqs[1], seqs[3], seqs[5]]
    rows, _ = await store.lease("w1", ["default"], 10, T0, free={"conn:": 2, "conn:a": 1, "conn:b": 0})
    assert [r.seq for r in rows] == [seqs[0]]


async def test_a_key_at_its_limit_never_blocks_another_key_however_many_tasks_it_has(store: Store) -> None:
    await store.submit([with_resources({"conn:a": 1}) for _ in range(1010)], T0)  # type: ignore[misc]
    (other,), _ = await store.submit([with_resources({"conn:b": 1})], T0)  # type: ignore[list-item]
    rows, _ = await store.lease("w1", ["default"], 10, T0, free={"conn:": 2, "conn:a": 0})
    assert [r.seq for r in rows] == [other.row.seq]


async def test_a_lease_that_visits_fewer_keys_than_have_tasks_visits_them_in_turns(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With more keys than a lease visits (KEY_SCAN), each lease starts after the last key the one
    before it visited, and wraps around: every key is served within a turn."""
    package = type(store).__module__  # a store is a package of modules: each one that reads KEY_SCAN
    for name, module in list(sys.modules.items()):
        if (name == package or name.startswith(f"{package}.")) and hasattr(module, "KEY_SCAN"):
            monkeypatch.setattr(module, "KEY_SCAN", 2)
    subs, _ = await store.submit([with_resources({f"conn:k{i}": 1}) for i in range(5) for _ in range(2)], T0)  # type: ignore[misc]
    key_of = {s.row.seq: next(iter(s.row.resources)) for s in subs}
    served = []
    for _ in range(3):
        rows, _ = await store.lease("w1", ["default"], 10, T0, free={"conn:": 1})
        served.append(sorted(key_of[r.seq] for r in rows))
    assert served == [["conn:k0", "conn:k1"], ["conn:k2", "conn:k3"], ["conn:k0", "conn:k4"]]
    rows, _ = await store.lease("w1", ["default"], 10, T0, free={"conn:": 1})
    assert sorted(key_of[r.seq] for r in rows) == ["conn:k1", "conn:k2"]  # after k0, where the last ended


async def test_keyed_tasks_are_leased_in_the_pools_order_across_keys_and_beside_other_tasks(store: Store) -> None:
    subs, _ = await store.submit(
        [
            with_resources({"conn:a": 1}, priority=1),
            with_resources({"conn:a": 1}, priority=5),
            with_resources({"conn:b": 1}, priority=3),
            with_resources({"gpu": 1}, priority=4),
            new(priority=2),
        ],  # type: ignore[list-item]
        T0,
    )
    seqs = [s.row.seq for s in subs]
    rows, _ = await store.lease("w1", ["default"], 3, T0, free={"conn:": 1, "gpu": 1})
    assert [r.seq for r in rows] == [seqs[1], seqs[3], seqs[2]]  # a's first by priority, then by priority
