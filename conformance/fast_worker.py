"""A fast worker beside the SDK's, for the cases that say `fast_worker` (real servers only).

    python conformance/fast_worker.py ENDPOINT TOKEN POOL COUNT_FILE

Waits until a task of POOL is RUNNING (the SDK's worker has leased), then runs a Python-SDK
worker whose handlers return at once; stops gracefully on SIGTERM and writes how many tasks it
handled to COUNT_FILE.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import cronoq


async def main(endpoint: str, token: str, pool: str) -> int:
    handled = 0

    async def handle(task: cronoq.TaskContext) -> None:
        nonlocal handled
        handled += 1

    async with cronoq.Client(endpoint, token=token) as client:
        while not (await client.list(pool, state=cronoq.TaskState.Value("TASK_STATE_RUNNING"))).tasks:
            await asyncio.sleep(0.02)
    worker = cronoq.Worker(endpoint, pool, handle, token=token, concurrency=4)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    await worker.run()
    return handled


if __name__ == "__main__":
    Path(sys.argv[4]).write_text(str(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))))
