"""core/maintenance.Periodic: a poke while a step runs is not lost (the next step starts at once)."""

from __future__ import annotations

import asyncio

from cronoq_server.core.maintenance import Periodic


async def test_a_poke_during_a_step_runs_the_next_step_at_once() -> None:
    steps: list[float] = []
    periodic: Periodic

    async def step() -> None:
        steps.append(asyncio.get_running_loop().time())
        if len(steps) == 1:
            periodic.poke()  # as a NOTIFY that arrives while the step reads
            await asyncio.sleep(0.01)

    periodic = Periodic("test", 30.0, step)
    periodic.start()
    try:
        for _ in range(100):
            if len(steps) >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        await periodic.stop()
    assert len(steps) >= 2, "the poke made during the first step was lost: the next waited for the interval"
