"""A lease of several pools deals its slots round robin across them (in the order given, the
first pool first), whatever each pool's lease path: plain, capping its groups, a keyed
resource, a resource. A pool with fewer tasks than its share leaves the rest to the others.
On every backend."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Any

import pytest
from test_store import T0, new

from cronoq_server.store.base import NewTask, Store

KINDS = ("plain", "capped", "keyed", "resource")
PAIRS = [*itertools.combinations(KINDS, 2), ("plain", "plain"), ("capped", "capped")]


def task(kind: str, pool: str, i: int) -> NewTask:
    if kind == "capped":
        return dataclasses.replace(new(pool), group_key=f"g{i % 5}")
    if kind == "keyed":
        return dataclasses.replace(new(pool), resources={f"conn:k{i % 5}": 1})
    if kind == "resource":
        return dataclasses.replace(new(pool), resources={"gpu": 1})
    return new(pool)


class Pair:
    """Two pools ("default" and "other") of these kinds, and what a lease of them is given."""

    def __init__(self, kinds: tuple[str, str]):
        self.kinds = dict(zip(("default", "other"), kinds, strict=True))
        self.capped = frozenset(p for p, k in self.kinds.items() if k == "capped")
        self.free = {"conn:": 1000, "gpu": 1000}
        self.groups = {p: (100, {}) for p in self.capped}

    async def submit(self, store: Store, pool: str, n: int) -> None:
        await store.submit([task(self.kinds[pool], pool, i) for i in range(n)], T0)

    async def lease(self, store: Store, pools: list[str], limit: int) -> Counter[str]:
        rows, _ = await store.lease("w1", pools, limit, T0, 0, self.free, self.groups)
        return Counter(r.pool for r in rows)


@pytest.fixture(params=PAIRS, ids="-".join)
def pair(request: pytest.FixtureRequest) -> Pair:
    return Pair(request.param)


@pytest.mark.parametrize("first", ["default", "other"])
async def test_each_pool_gets_its_share_of_a_lease(open_store: Any, pair: Pair, first: str) -> None:
    store = await open_store(group_pools=pair.capped)
    second = "other" if first == "default" else "default"
    await pair.submit(store, first, 40)  # the older tasks
    await pair.submit(store, second, 40)
    assert await pair.lease(store, [first, second], 8) == {first: 4, second: 4}
    assert await pair.lease(store, [second, first], 7) == {first: 3, second: 4}  # the odd one: the first given
    assert await pair.lease(store, [first, second], 1) == {first: 1}
    assert await pair.lease(store, [second, first], 1) == {second: 1}


@pytest.mark.parametrize("short", ["default", "other"])
async def test_a_pool_with_less_than_its_share_leaves_the_rest_to_the_other(
    open_store: Any, pair: Pair, short: str
) -> None:
    store = await open_store(group_pools=pair.capped)
    other = "other" if short == "default" else "default"
    await pair.submit(store, short, 2)
    await pair.submit(store, other, 40)
    assert await pair.lease(store, [short, other], 8) == {short: 2, other: 6}
    await pair.submit(store, short, 2)
    assert await pair.lease(store, [other, short], 8) == {short: 2, other: 6}
