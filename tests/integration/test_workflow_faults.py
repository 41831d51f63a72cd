"""A workflow across a leader's SIGKILL, on PostgreSQL (three replicas) and SQLite (two on one
file): 1,000 handlers in two worker processes each spawn 10 children with their success while the
leader is killed. Every parent ends SUCCEEDED with exactly its 10 children, all from the attempt
that succeeded (a child records its parent's attempt): none from an attempt whose success was
lost with the leader, and none twice."""

from __future__ import annotations

import asyncio
import collections
import json
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from _helpers import eventually, start_worker
from test_failover import endpoints, is_leader, start_replicas

from cronoq.v1 import task_pb2

PARENTS = 1000
CHILDREN = 10
SUCCEEDED = task_pb2.TASK_STATE_SUCCEEDED


def rows_of(config: dict[str, Any], pg: Any) -> list[tuple[int, int | None, int, int, bytes]]:
    """(seq, parent_seq, state, attempt, payload) of every task, read from the store itself."""
    sql = "SELECT seq, parent_seq, state, attempt, payload FROM {}tasks"
    store = config["store"]
    if store.get("kind") == "postgres":

        async def read() -> list[Any]:
            conn = await asyncpg.connect(pg.url)
            try:
                return [tuple(r) for r in await conn.fetch(sql.format(store["schema"] + "."))]
            finally:
                await conn.close()

        return asyncio.run(read())
    with sqlite3.connect(store["path"]) as db:
        return db.execute(sql.format("")).fetchall()


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
def test_sigkill_the_leader_while_1000_handlers_spawn_10_children_each(
    kind: str, start_server: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pg = request.getfixturevalue("postgres") if kind == "postgres" else None
    store = (
        {"kind": "postgres", "url": pg.url, "schema": f"wf_{uuid.uuid4().hex[:10]}"}
        if pg is not None
        else {"path": str(tmp_path / "shared.db")}
    )
    config = {"store": store, "pools": [{"name": "default", "lease_ttl": "5s"}], "limits": {"max_batch_size": 1000}}
    servers = start_replicas(start_server, config, n=3 if pg is not None else 2)
    ep = endpoints(servers)
    first = servers[0]
    batch = [{"pool": "default", "payload_json": {"spawn": CHILDREN, "sleep": 0.02}} for _ in range(PARENTS)]
    status, body = first.http("POST", "/v1/batches", {"tasks": batch})
    assert status == 200, body
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [start_worker(ep, "default", log, concurrency=32) for log in logs]
    started = time.monotonic()
    try:

        def parents_done() -> int:
            return sum(1 for r in rows_of(config, pg) if r[1] is None and r[2] == SUCCEEDED)

        eventually(lambda: parents_done() >= PARENTS // 3, timeout=60, interval=0.2, what="a third of the parents done")
        first.kill()
        eventually(lambda: any(is_leader(s) for s in servers[1:]), timeout=10, interval=0.02, what="a new leader")

        def all_ended() -> bool:
            rows = rows_of(config, pg)
            return len(rows) == PARENTS * (1 + CHILDREN) and all(r[2] == SUCCEEDED for r in rows)

        eventually(all_ended, timeout=120, interval=0.5, what="every parent and child SUCCEEDED")
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(30)
    rows = rows_of(config, pg)
    parents = {r[0]: r for r in rows if r[1] is None}
    children = collections.defaultdict(list)
    for _seq, parent, _state, _attempt, payload in rows:
        if parent is not None:
            children[parent].append(json.loads(payload))
    assert len(parents) == PARENTS
    wrong = {p: len(c) for p, c in children.items() if len(c) != CHILDREN}
    assert not wrong, f"parents without exactly {CHILDREN} children: {list(wrong.items())[:5]}"
    assert set(children) == set(parents)
    stale = [p for p, c in children.items() if {x["parent_attempt"] for x in c} != {parents[p][3]}]
    assert not stale, f"children of an attempt that did not succeed: {stale[:5]}"
    for p, c in children.items():
        assert sorted(x["child"] for x in c) == list(range(CHILDREN)), p
    print(f"\n{PARENTS} parents x {CHILDREN} children across a leader SIGKILL ({kind}): "
          f"{time.monotonic() - started:.1f}s; parents run more than once: "
          f"{sum(1 for p in parents.values() if p[3] > 1)}")  # fmt: skip
