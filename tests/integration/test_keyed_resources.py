"""Keyed resources (per_key): each key has its own slots or bucket, enforced at lease time;
real servers, real worker processes, on SQLite and PostgreSQL."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, eventually, log_lines, max_overlap, runs_by_task, start_worker
from test_resources import all_succeed, config, submit
from test_resources import store_kind as store_kind


def test_bad_keys_are_refused_naming_the_resource(start_server: Any, tmp_path: Path) -> None:
    srv = start_server(
        config(
            {"kind": "sqlite", "path": str(tmp_path / "q.db")},
            [{"name": "quota", "rate": 5, "per_key": True}, {"name": "gpu", "concurrency": 1}],
        )
    )
    api = Api(srv.grpc_target)
    for resources in ({"quota": 1}, {"quota:": 1}, {"quota:" + "k" * 129: 1}, {"quota:a\n": 1}, {"gpu:a": 1}):
        with pytest.raises(grpc.RpcError) as err:
            api.submit(resources=resources)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "resources" in (err.value.details() or "")
        assert repr(next(iter(resources)).partition(":")[0])[1:-1] in (err.value.details() or "")
    assert api.submit(resources={"quota:" + "k" * 128: 1}).id


def test_a_keyed_limit_holds_per_key_and_never_blocks_other_keys(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, [{"name": "conn", "concurrency": 2, "per_key": True}]))
    api = Api(srv.grpc_target)
    # Key a's backlog first: the tasks of key b and those without resources behind it still run.
    by_key = {key: submit(api, 12, {"sleep": 0.2}, resources={f"conn:{key}": 1}) for key in ("a", "b")}
    plain = submit(api, 4, {"sleep": 0.2})
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    workers = [start_worker(srv.endpoint, "default", log, concurrency=8) for log in logs]
    try:
        all_succeed(api, [i for ids in by_key.values() for i in ids] + plain, timeout=45)
    finally:
        for w in workers:
            w.kill()
    runs = {task: iv for log in logs for task, iv in runs_by_task(log).items()}
    per_key = {key: [iv for i in ids for iv in runs[i]] for key, ids in by_key.items()}
    assert {key: len(ivs) for key, ivs in per_key.items()} == {"a": 12, "b": 12}
    assert {key: max_overlap(ivs) for key, ivs in per_key.items()} == {"a": 2, "b": 2}
    both = per_key["a"] + per_key["b"]
    assert max_overlap(both) > 2  # the keys ran beside each other
    first_b = min(s for s, _ in per_key["b"])
    assert first_b < min(s for s, _ in per_key["a"]) + 1.0  # b did not wait for a's backlog


def test_a_keyed_rate_is_held_per_key_over_every_second(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, [{"name": "quota", "rate": 4, "burst": 1, "per_key": True}]))
    api = Api(srv.grpc_target)
    by_key = {key: submit(api, 12, resources={f"quota:{key}": 1}) for key in ("a", "b", "c")}
    worker = start_worker(srv.endpoint, "default", tmp_path / "w.log", concurrency=16)
    try:
        tasks = {key: all_succeed(api, ids, timeout=30) for key, ids in by_key.items()}
    finally:
        worker.kill()
    for key, done in tasks.items():
        starts = sorted(t.started_at.ToMicroseconds() / 1e6 for t in done)
        for i, t in enumerate(starts):
            in_window = sum(1 for s in starts[i:] if s < t + 1.0)
            assert in_window <= 4 + 1, f"key {key}: {in_window} starts in the second after {t - starts[0]:.3f}s"
        assert starts[-1] - starts[0] < 12 / 4 + 1.5, f"key {key} ran at its rate"


def test_the_snapshot_and_metrics_show_the_keys_at_their_limit(
    start_server: Any, store_kind: dict[str, Any], tmp_path: Path
) -> None:
    srv = start_server(config(store_kind, [{"name": "conn", "concurrency": 2, "per_key": True}]))
    api = Api(srv.grpc_target)
    submit(api, 2, {"sleep": 30}, resources={"conn:a": 1})
    submit(api, 1, {"sleep": 30}, resources={"conn:b": 1})
    log = tmp_path / "w.log"
    worker = start_worker(srv.endpoint, "default", log, concurrency=8)
    try:
        eventually(lambda: len(log_lines(log, "start")) == 3, what="the three tasks run")
        status, body = srv.http("GET", "/v1/snapshot")
        assert status == 200, body
        [conn] = body["shards"][0]["resources"]
        assert conn["per_key"] and int(conn["keys"]) == 2 and int(conn["in_use"]) == 3
        assert conn["keys_at_limit"] == ["a"]
        with urllib.request.urlopen(srv.http_url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'cronoq_resource_keys_at_limit{resource="conn"} 1.0' in metrics
        assert 'cronoq_resource_in_use{resource="conn"} 3.0' in metrics
    finally:
        worker.kill()
