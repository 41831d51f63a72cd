"""The leader's counts of unfinished tasks by pool and state, kept as tasks change.

They start from the store's counts at one event position (read in one snapshot with it) and
fold every numbered event after it: an event leaves its previous state and enters its new one.
Nothing recounts the tasks after that; a scrape only reads the gauge.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from ..metrics import TASKS_BY_STATE, record_events
from ..store.base import STATES, EventColumns, EventRow, State, columns_of
from .activity import Activity

# The states the counts follow; terminal totals are counters (cronoq_tasks_finished_total).
UNFINISHED = (State.PENDING, State.BLOCKED, State.RUNNING)


class TaskCounts:
    """Unfinished tasks by (pool, state) as of event `position` (None: not started)."""

    def __init__(self, pools: Iterable[str] = (), gauge: bool = False, activity: Activity | None = None):
        """gauge: the leader's counts, published as metrics (metrics.record_events too)."""
        self._pools = tuple(pools)
        self._gauge = gauge
        self._activity = activity  # also told of each event folded, once
        self._counts: dict[tuple[str, State], int] = {}
        self.position: int | None = None

    def start(self, position: int, counts: Mapping[tuple[str, State], int]) -> None:
        """Counts after every event up to `position`, and no later one."""
        self.position = position
        self._counts = {k: n for k, n in counts.items() if k[1] in UNFINISHED}
        if self._gauge:
            for pool in {*self._pools, *(p for p, _ in self._counts)}:
                for state in UNFINISHED:
                    self._set_gauge(pool, state)

    def stop(self) -> None:
        """Not counting (not leading): the gauge drops its series rather than show stale counts."""
        self.position = None
        self._counts = {}
        if self._activity is not None:
            self._activity.clear()
        if self._gauge:
            TASKS_BY_STATE.clear()

    def fold(self, events: list[EventRow]) -> bool:
        """Applies the events after `position`, in order; False when they do not follow it (an
        event after it is missing), in which case nothing is applied."""
        return self.fold_columns([columns_of(events)])

    def fold_columns(self, read: Sequence[EventColumns]) -> bool:
        """fold, of events read as columns (the events of deleted tasks are passed over)."""
        if self.position is None:
            return False
        fresh = [f for c in read if (f := c.after(self.position)) is not None]
        if not fresh:
            return True
        if fresh[0].pos[0] != self.position + 1:
            return False
        moves: Counter[tuple[str, int, int]] = Counter()
        for c in fresh:
            moves.update(zip(c.pool, c.prev_state, c.state, strict=True))
        touched: set[tuple[str, State]] = set()
        for (pool, prev_state, state), n in moves.items():
            if prev_state == state:
                continue  # a change within a state (a cancel request)
            if prev_state in UNFINISHED:
                key = (pool, STATES[prev_state])
                self._counts[key] = self._counts.get(key, 0) - n
                touched.add(key)
            if state in UNFINISHED:
                key = (pool, STATES[state])
                self._counts[key] = self._counts.get(key, 0) + n
                touched.add(key)
        self.position = fresh[-1].pos[-1]
        if self._activity is not None:
            self._activity.record_events(fresh, moves)
        if self._gauge:
            record_events(fresh, moves)
            for pool, state in touched:
                self._set_gauge(pool, state)
        return True

    def get(self, pool: str, state: State) -> int:
        return self._counts.get((pool, state), 0)

    def nonzero(self) -> dict[tuple[str, State], int]:
        return {k: n for k, n in self._counts.items() if n}

    def _set_gauge(self, pool: str, state: State) -> None:
        TASKS_BY_STATE.labels(pool=pool, state=state.name.lower()).set(self._counts.get((pool, state), 0))
