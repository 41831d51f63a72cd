"""Scrapes read gauges counted in the background, at most every GAUGE_MAX_AGE_S."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cronoq_server.config import parse_config
from cronoq_server.node import Node


async def test_scrapes_never_wait_for_a_count_and_count_at_most_once_per_period(tmp_path: Path) -> None:
    node = Node(parse_config({"store": {"path": str(tmp_path / "cronoq.db")}}))
    await node.store.open()
    try:
        node.is_leader = True
        counted = 0
        real_count = node.store.count_by_pool_and_state

        async def counting() -> dict:  # type: ignore[type-arg]
            nonlocal counted
            counted += 1
            await asyncio.sleep(0.2)  # a slow full scan
            return await real_count()

        node.store.count_by_pool_and_state = counting  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(50):  # a scrape loop at full speed
            await node.refresh_gauges()
        assert loop.time() - started < 0.1  # no scrape waited for the count
        await asyncio.sleep(0.3)
        for _ in range(50):
            await node.refresh_gauges()
        assert counted == 1
    finally:
        await node.store.close()
