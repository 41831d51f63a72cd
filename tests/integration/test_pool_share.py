"""A worker of two pools runs tasks of both from the start, whatever each pool's lease path
(plain, capping its groups, a keyed resource, a resource) and whichever pool's backlog is
older: real servers, a real worker process, on SQLite and PostgreSQL."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from _helpers import Api, eventually, log_lines, start_worker, store_table

from cronoq.v1 import task_service_pb2 as tpb

KINDS = ("plain", "capped", "keyed", "resource")
BACKLOG = 240  # tasks of each pool, the first pool's submitted first


@pytest.fixture(params=["sqlite", "postgres"])
def store_kind(request: pytest.FixtureRequest) -> dict[str, Any]:
    return store_table(request.param, request)


def pool_table(name: str, kind: str) -> dict[str, Any]:
    return {"name": name, "lease_ttl": "5s", **({"max_running_per_group": 100} if kind == "capped" else {})}


def task(pool: str, kind: str, i: int) -> tpb.SubmitTaskRequest:
    req = tpb.SubmitTaskRequest(pool=pool, payload=b"{}", content_type="application/json")
    if kind == "capped":
        req.group_key = f"g{i % 5}"
    elif kind == "keyed":
        req.resources["conn:k" + str(i % 5)] = 1
    elif kind == "resource":
        req.resources["gpu"] = 1
    return req


@pytest.mark.parametrize("kinds", list(itertools.combinations(KINDS, 2)), ids="-".join)
@pytest.mark.parametrize("older", [0, 1], ids=["first-older", "second-older"])
def test_a_worker_of_two_pools_starts_tasks_of_both_from_the_start(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path, kinds: tuple[str, str], older: int
) -> None:
    pools = {"p0": kinds[0], "p1": kinds[1]}
    srv = start_server(
        {
            "store": store_kind,
            "pools": [pool_table(name, kind) for name, kind in pools.items()],
            "resources": [{"name": "conn", "concurrency": 100, "per_key": True}, {"name": "gpu", "concurrency": 100}],
        }
    )
    api = Api(srv.grpc_target)
    first, second = sorted(pools, reverse=bool(older))
    ids: dict[str, set[int]] = {}
    for pool in (first, second):
        reqs = [task(pool, pools[pool], i) for i in range(BACKLOG)]
        ids[pool] = {t.id for t in api.tasks.SubmitBatch(tpb.SubmitBatchRequest(tasks=reqs)).tasks}
    log = tmp_path / "w.log"
    worker = start_worker(srv.endpoint, "p0,p1", log, concurrency=8)
    try:
        eventually(lambda: len(log_lines(log, "start")) >= BACKLOG // 2, timeout=60, what="half a backlog starts")
    finally:
        worker.kill()
    started = [t for t, _, _ in log_lines(log, "start")]
    first_of_second = next(n for n, t in enumerate(started) if t in ids[second])
    # Dealt in turns, the second pool's first start comes within the worker's first leases;
    # served one pool after the other, only once the first pool's backlog has run.
    assert first_of_second < BACKLOG // 4, (first_of_second, started[:40])
    ran_first = sum(1 for t in started[: BACKLOG // 2] if t in ids[first])
    assert BACKLOG // 8 < ran_first < BACKLOG // 2 - BACKLOG // 8, ran_first  # neither pool waits for the other
