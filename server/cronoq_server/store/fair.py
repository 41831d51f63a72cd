"""Fair share inside a pool that caps its groups (max_running_per_group): the rank that orders
its tasks round robin across groups, and the choice of what a lease takes.

A task's rank is given when it becomes due to run: one more than the higher of the pool's
round (the highest rank leased so far) and its group's last rank. A group with 100,000 tasks
due holds ranks round+1 ... round+100,000; a group whose tasks come later starts again just
past the round, so leases, which take tasks by (priority, rank, seq), alternate between the
groups with due tasks: round robin within a priority level, whatever the number of groups.
Ranks only order: the cap is the leader's accounting (core/resources.py), not theirs. Both
live in the leader's memory, rebuilt from the store when a server takes over.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .base import TaskRow

# A lease reads this many due tasks more than it may take (a task that does not fit beside
# those before it is skipped), and as many again for each group at its cap (whose tasks come
# once a round in rank order): at most FAIR_WINDOW_MAX.
FAIR_WINDOW_SLACK = 16
FAIR_WINDOW_MAX = 10_000
# Due tasks ranked per lease at most (the rest on the next).
RANK_BATCH = 1000
_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A due task of a pool that caps its groups, in lease order."""

    seq: int
    pool: str
    group_key: str
    size: int  # bytes counted against the lease's max_bytes
    resources: Mapping[str, int] | None


def fair_window(limit: int, room: Mapping[str, tuple[int, Mapping[str, int]]]) -> int:
    """How many due tasks a lease of limit reads from pools with these groups' room."""
    full = sum(1 for cap, running in room.values() for n in running.values() if n >= cap)
    return min((limit + FAIR_WINDOW_SLACK) * (1 + full), FAIR_WINDOW_MAX)


def free_for(free: Mapping[str, int], entry: str) -> int:
    """What is free for a task's resources entry: its own amount, else (a key of a keyed
    resource that has no state) the resource's full size under "name:"; else none. The stores'
    SQL looks it up alike."""
    own = free.get(entry)
    return own if own is not None else free.get(entry[: entry.find(":") + 1], 0)


def choose(
    candidates: Iterable[Candidate],
    room: Mapping[str, tuple[int, Mapping[str, int]]],
    limit: int,
    max_bytes: int = 0,
    free: Mapping[str, int] | None = None,
    pools: Sequence[str] = (),
) -> list[int]:
    """The seqs a lease takes of these candidates (in lease order within each pool): one of each
    pool in turn (pools, in turn order; none given: one line), each the pool's next while its
    group is under the cap with what this lease took before it, its resources fit in what is
    free beside those before it, and (past the first) the bytes fit in max_bytes (0: no bound)."""
    taken: dict[tuple[str, str], int] = {}
    spent: dict[str, int] = {}
    chosen: list[int] = []
    size = 0

    def fits(c: Candidate) -> bool:
        cap, running = room.get(c.pool, (0, {}))
        if cap and running.get(c.group_key, 0) + taken.get((c.pool, c.group_key), 0) >= cap:
            return False
        return not c.resources or all(spent.get(n, 0) + a <= free_for(free or {}, n) for n, a in c.resources.items())

    # What does not fit now never fits later in this lease: a line passes it over for good.
    lines = [iter(line) for line in _by_pool(candidates, pools)]
    while lines and len(chosen) < limit:
        for line in list(lines):
            c = next((c for c in line if fits(c)), None)
            if c is None:
                lines.remove(line)
                continue
            if chosen and max_bytes > 0 and size + c.size > max_bytes:
                return chosen  # as the plain lease: the first always, then as many as fit
            chosen.append(c.seq)
            size += c.size
            taken[(c.pool, c.group_key)] = taken.get((c.pool, c.group_key), 0) + 1
            for n, a in (c.resources or {}).items():
                spent[n] = spent.get(n, 0) + a
            if len(chosen) >= limit:
                break
    return chosen


def _by_pool(candidates: Iterable[Candidate], pools: Sequence[str]) -> list[list[Candidate]]:
    """The candidates of each pool, in turn order (pools; none given: all in one line)."""
    if len(pools) < 2:
        return [list(candidates)]
    lines: dict[str, list[Candidate]] = {p: [] for p in pools}
    for c in candidates:
        lines[c.pool].append(c)
    return list(lines.values())


def turn_share(pools: Sequence[str], some: Collection[str], limit: int) -> int:
    """Of limit slots dealt one at a time across pools in turn (from the first), those that go
    to the pools in some."""
    n = len(pools)
    return sum(limit // n + (i < limit % n) for i, p in enumerate(pools) if p in some)


class GroupRanks:
    """The leader's ranks of the pools that cap their groups: each pool's round, and each
    group's last rank while it is past the round (a group at or behind the round starts again
    just past it, so it is forgotten now and then: memory follows the groups with due tasks)."""

    def __init__(self, pools: Iterable[str]):
        self._round: dict[str, int] = dict.fromkeys(pools, 0)
        self.pools = frozenset(self._round)  # read for every task submitted: built once
        self._last: dict[str, dict[str, int]] = {p: {} for p in self._round}
        self._kept: dict[str, int] = dict.fromkeys(self._round, 0)  # groups kept at the last forgetting

    def rank(self, pool: str, group_key: str) -> int:
        """The rank of a task of this group that becomes due now."""
        last = self._last[pool]
        rank = max(self._round[pool], last.get(group_key, 0)) + 1
        last[group_key] = rank
        return rank

    def served(self, pool: str, rank: int) -> None:
        """A lease took a task of this rank: the round is at least there."""
        if rank <= self._round[pool]:
            return
        self._round[pool] = rank
        if len(self._last[pool]) > max(1024, 2 * self._kept[pool]):
            self._last[pool] = {g: r for g, r in self._last[pool].items() if r > rank}
            self._kept[pool] = len(self._last[pool])

    def rebuild(self, pool: str, round_: int, last: Mapping[str, int]) -> None:
        """From the store: the pool's round (the lowest rank due, less one) and each group's
        highest rank not yet leased."""
        self._round[pool] = round_
        self._last[pool] = {g: r for g, r in last.items() if r > round_}
        self._kept[pool] = len(self._last[pool])


def first_rank(ranks: GroupRanks, pool: str, group_key: str, pending: bool, run_at: int, now: int) -> int | None:
    """The group_rank a task is stored with: none outside pools that cap their groups; its
    rank when it is due now; else 0, ranked when it becomes due (see RANK_RESET)."""
    if pool not in ranks.pools:
        return None
    return ranks.rank(pool, group_key) if pending and run_at <= now else 0


def row_bytes(row: TaskRow, overhead: int) -> int:
    """What a leased task counts against a lease's max_bytes (as the plain lease's SQL counts)."""
    return len(row.payload) + len(row.key or "") + len(row.content_type) + overhead


def left_after(
    limit: int, max_bytes: int, free: Mapping[str, int] | None, taken: Sequence[tuple[int, Mapping[str, int] | None]]
) -> tuple[int, int, Mapping[str, int] | None]:
    """What a lease of limit, max_bytes and free leaves to the rest of its pools once part of
    it took tasks of these (bytes, resources): the limit, the bytes (at least 1: the rest's first
    task is taken whatever its size, as any lease's) and what is free."""
    if max_bytes > 0 and taken:
        max_bytes = max(max_bytes - sum(size for size, _ in taken), 1)
    if free is not None and any(resources for _, resources in taken):
        left = dict(free)
        for _, resources in taken:
            for n, a in (resources or {}).items():
                left[n] = free_for(left, n) - a
        free = left
    return limit - len(taken), max_bytes, free


def _pool_names(pools: Iterable[str]) -> str:
    names = sorted(pools)
    # Pool names are checked by the config (letters, digits, "_", ".", "-"): safe as literals.
    assert all(_POOL_NAME.fullmatch(p) for p in names), names
    return ", ".join(f"'{p}'" for p in names)


def rank_reset(pools: Iterable[str]) -> str:
    """The SET clause of a change that makes a task PENDING again later (a retry, a dependency
    done): in a pool that caps its groups it is ranked again when due (0), elsewhere it has none."""
    names = _pool_names(pools)
    return f"group_rank = CASE WHEN pool IN ({names}) THEN 0 END" if names else "group_rank = NULL"


def rank_keep(pools: Iterable[str]) -> str:
    """The SET clause of a release (PENDING again, due now): it keeps its turn."""
    names = _pool_names(pools)
    if not names:
        return "group_rank = NULL"
    return f"group_rank = CASE WHEN pool IN ({names}) THEN coalesce(group_rank, 0) END"
