"""The leader keeps the task gauges from the events as tasks change (never a scan per scrape or
per interval), and recounts workers as a service of its own; scrapes only read them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from cronoq_server.config import parse_config
from cronoq_server.core.tasks import now_us
from cronoq_server.node import WORKER_GAUGES_EVERY_S, Node
from cronoq_server.store.base import NewTask, Outcome, OutcomeKind, State


def task(pool: str = "default", key: str | None = None, deps: list[str] | None = None) -> NewTask:
    return NewTask(pool, key, b"", "", 0, None, 1, dep_keys=list(deps or []))


def gauge(state: str, pool: str = "default") -> float | None:
    return REGISTRY.get_sample_value("cronoq_tasks", {"pool": pool, "state": state})


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    config = {"store": {"path": str(tmp_path / "cronoq.db")}, "pools": [{"name": "default"}, {"name": "other"}]}
    opened = Node(parse_config(config))
    await opened.store.open()
    yield opened
    opened.events.step_down()
    await opened.store.close()


async def test_task_gauges_start_from_the_store_then_follow_the_events_without_a_scan(node: Node) -> None:
    await node.store.submit([task(), task(), task("other", "a"), task("other", "b", ["a"])], 1)
    assert not any(s.name == "task gauges" for s in node.services)
    node.events.lead()
    await node.events.sequence_once()  # taking over: one count of the store
    assert [gauge(s) for s in ("pending", "blocked", "running")] == [2, 0, 0]
    assert [gauge(s, "other") for s in ("pending", "blocked", "running")] == [1, 1, 0]
    assert gauge("succeeded") is None  # ended tasks are counters, not this gauge

    async def no_scan() -> None:
        raise AssertionError("the leader scanned the tasks")

    node.store.count_by_pool_and_state = no_scan  # type: ignore[assignment,method-assign]
    node.store.count_unfinished = no_scan  # type: ignore[assignment,method-assign]
    rows, _ = await node.store.lease("w", ["other"], 1, 2)
    await node.store.finish("w", [Outcome(rows[0].seq, 1, OutcomeKind.SUCCESS)], 3)  # b unblocked
    await node.store.lease("w", ["default"], 1, 4)
    await node.events.sequence_once()
    assert [gauge(s) for s in ("pending", "blocked", "running")] == [1, 0, 1]
    assert [gauge(s, "other") for s in ("pending", "blocked", "running")] == [1, 0, 0]


async def test_a_standby_shows_no_task_gauges_and_a_new_term_counts_again(node: Node) -> None:
    node.events.lead()
    await node.events.sequence_once()
    assert gauge("pending") == 0
    node.events.step_down()
    assert gauge("pending") is None
    await node.store.submit([task()], 1)  # changed while this server did not lead
    node.events.lead()
    await node.events.sequence_once()
    assert gauge("pending") == 1


async def test_events_purged_before_they_were_counted_make_the_leader_count_again(node: Node) -> None:
    node.events.lead()
    await node.events.sequence_once()
    await node.store.submit([task(), task()], 1)
    await node.store.purge_events(10, 100)  # both events gone before the leader read them
    await node.events.sequence_once()
    assert gauge("pending") == 2
    assert node.events.counts.get("default", State.PENDING) == 2


async def test_the_worker_gauges_service_counts_workers_by_pool(node: Node) -> None:
    from cronoq_server.store.base import WorkerRow

    now = now_us()  # workers heard from now: one silent for long is not counted (Leases.present_workers)
    await node.store.register_worker(WorkerRow("w1", "w1", ["default", "other"], 1, {}, now, now))
    await node.store.register_worker(WorkerRow("w2", "w2", ["default"], 1, {}, now, now))
    await node.store.register_worker(WorkerRow("gone", "gone", ["default"], 1, {}, 1, 1))
    service = next(s for s in node.services if s.name == "worker gauges")
    assert service.every == WORKER_GAUGES_EVERY_S
    await node._set_worker_gauges()
    assert REGISTRY.get_sample_value("cronoq_workers", {"pool": "default"}) == 2
    assert REGISTRY.get_sample_value("cronoq_workers", {"pool": "other"}) == 1
