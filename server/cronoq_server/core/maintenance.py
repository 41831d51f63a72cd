"""The leader's periodic work, as separate services that start when a server leads and stop
when it steps down (lease expiry, retention, worker reaping, schedules, events).

Each service runs one step at a time on its own interval; a failing step is logged and
retried at the next interval without disturbing the other services.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator

from ..store.base import StoreUnavailable

log = logging.getLogger("cronoq.maintenance")


class Periodic:
    """Runs step() every `every` seconds while started. step may return a delay (seconds) that
    replaces the interval once (a service that knows when its next work is due)."""

    def __init__(
        self,
        name: str,
        every: float,
        step: Callable[[], Awaitable[float | None]],
        on_stop: Callable[[], Awaitable[None]] | None = None,
    ):
        self.name = name
        self.every = every
        self._step = step
        self._on_stop = on_stop  # releases what the steps hold (a connection)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"cronoq-{self.name}")

    def poke(self) -> None:
        """Runs the next step now rather than at the end of the interval."""
        self._wake.set()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._on_stop is not None:
            await self._on_stop()

    async def _run(self) -> None:
        while True:
            delay: float | None = None
            self._wake.clear()  # before the step: a poke while it runs starts the next one at once
            try:
                delay = await self._step()
            except asyncio.CancelledError:
                raise
            except StoreUnavailable as err:
                log.warning("%s skipped: %s", self.name, err)
            except Exception:
                log.exception("%s failed; retrying in %.1fs", self.name, self.every)
            timeout = self.every if delay is None else max(min(delay, self.every), 0.0)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass


class Services:
    """The leader's services, started together on taking over and stopped on stepping down."""

    def __init__(self) -> None:
        self._services: list[Periodic] = []

    def add(self, service: Periodic) -> Periodic:
        self._services.append(service)
        return service

    def start(self) -> None:
        for service in self._services:
            service.start()

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self._services))

    def __iter__(self) -> Iterator[Periodic]:
        return iter(self._services)
