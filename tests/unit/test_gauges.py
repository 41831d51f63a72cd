"""The leader recounts task and worker gauges as a service of its own; scrapes only read them."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY

from cronoq_server.config import parse_config
from cronoq_server.node import GAUGES_EVERY_S, Node
from cronoq_server.store.base import NewTask


async def test_the_gauges_service_counts_tasks_by_pool_and_state(tmp_path: Path) -> None:
    node = Node(parse_config({"store": {"path": str(tmp_path / "cronoq.db")}}))
    await node.store.open()
    try:
        task = NewTask(pool="default", key=None, payload=b"", content_type="", priority=0, run_at=None, max_attempts=1)
        await node.store.submit([task, task], 1)
        service = next(s for s in node.services if s.name == "task gauges")
        assert service.every == GAUGES_EVERY_S
        await node._set_gauges()
        assert REGISTRY.get_sample_value("cronoq_tasks", {"pool": "default", "state": "pending"}) == 2
        assert REGISTRY.get_sample_value("cronoq_tasks", {"pool": "default", "state": "running"}) == 0
    finally:
        await node.store.close()
