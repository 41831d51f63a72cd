"""The PostgreSQL store's leases and heartbeats."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from ..base import Changes, Held, Report, State, TaskRow
from ..fair import (
    FAIR_WINDOW_MAX,
    Candidate,
    GroupRanks,
    choose,
    fair_window,
    left_after,
    row_bytes,
    turn_share,
)
from ..logic import (
    KEY_SCAN,
    current_reports,
    decide_heartbeat,
    has_keyed,
    lease_scan,
    report_columns,
    task_row,
)
from .events import Events
from .sql.lease import (
    EXTEND_LEASES,
    FAIR_CANDIDATES,
    FAIR_TAKE_CTES,
    HEARTBEAT_ROWS,
    KEEP_REPORTS,
    LAST_RANKS,
    LOWEST_RANK,
    NEXT_DUE,
    RUNNING_RESOURCES,
    TOUCH_WORKER,
    UNRANK_UNSTORED,
    lease_ctes,
    lease_keyed,
    select_leased,
)


def _carried(fetched: Sequence[asyncpg.Record]) -> tuple[Sequence[Any], Sequence[Any]]:
    """The two arrays (_ONCE) that end the first row, if any."""
    return (fetched[0][-2] or (), fetched[0][-1] or ()) if fetched else ((), ())


@dataclass(frozen=True, slots=True)
class _FairRead:
    """What a lease of pools that cap their groups read (see PostgresStore._fair_read)."""

    pools: list[str]
    room: dict[str, tuple[int, Mapping[str, int]]]
    candidates: list[Candidate]  # in lease order
    new_ranks: dict[int, int]  # of the tasks ranked now: their rank
    rank_of: dict[int, tuple[str, int]]  # of each candidate: its pool and rank
    row_of: dict[int, Any]  # of each candidate: the row read


@dataclass(frozen=True, slots=True)
class _FairTake:
    """What a lease of pools that cap their groups writes (see PostgresStore._fair_take)."""

    ctes: str
    args: tuple[Any, ...]
    ranks: dict[int, tuple[str, int]]  # of each task chosen: its pool and rank
    group_ranks: GroupRanks
    held: list[Held]  # what the tasks chosen hold once taken
    seqs: frozenset[int]  # the tasks it chose or ranked: no other lease reads them until it is written

    def served(self, rows: list[TaskRow]) -> list[TaskRow]:
        """The rows leased, once their pools' rounds have moved past them."""
        for r in rows:
            self.group_ranks.served(*self.ranks[r.seq])
        return rows


class Lease(Events):
    """Leases (plain, keyed and of pools that cap their groups) and heartbeats."""

    async def lease(
        self,
        worker_id: str,
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int = 0,
        free: Mapping[str, int] | None = None,
        groups: Mapping[str, tuple[int, Mapping[str, int]]] | None = None,
    ) -> tuple[list[TaskRow], int | None]:
        """Deals limit across the pools in turn (the first given first), the pools that cap their
        groups (store/fair.py chooses) and the rest (one statement) each taking what the other
        leaves: their read, the rest's statement, then their write."""
        fair = [p for p in pools if p in self.settings.group_pools]
        others = [p for p in pools if p not in self.settings.group_pools]
        rows: list[TaskRow] = []
        chosen: list[int] = []
        if fair:
            read = await self._fair_read(fair, limit, now, groups)
            share = turn_share(pools, fair, limit)
            chosen = choose(read.candidates, read.room, share, max_bytes, free, fair)
        if others:
            left = (limit, max_bytes, free)
            if fair:
                by_seq = {c.seq: c for c in read.candidates}
                left = left_after(limit, max_bytes, free, [(by_seq[s].size, by_seq[s].resources) for s in chosen])
            if left[0] > 0:
                rows = await self._lease_others(worker_id, others, left[0], now, left[1], left[2])
            if fair and len(chosen) == share and len(rows) < left[0]:  # the others left slots: more of these
                overhead = self.settings.lease_overhead_bytes
                plain = [(row_bytes(r, overhead), r.resources) for r in rows]
                chosen = choose(read.candidates, read.room, *left_after(limit, max_bytes, free, plain), fair)
        if fair:
            take = self._fair_write(worker_id, read, chosen, now)
            if take is not None:
                sql = self._sql(select_leased(take.ctes))
                try:
                    rows += take.served([task_row(r) for r in await self._fenced_fetch(sql, *take.args)])
                finally:
                    self._taking -= take.seqs
        return await self._leased(rows, others, now, fair)

    async def _lease_others(
        self,
        worker_id: str,
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int,
        free: Mapping[str, int] | None,
    ) -> list[TaskRow]:
        """A lease of pools that do not cap their groups: one statement."""
        ctes, args = self._lease_ctes(worker_id, pools, limit, now, max_bytes, free)
        if free and has_keyed(free):
            sql = self._sql(lease_keyed(ctes))
            fetched = await self._fenced_fetch(sql, *args)
            for pool in pools:
                self._key_after.pop(pool, None)
            self._key_after.update(zip(*_carried(fetched), strict=True))
            return [task_row(r) for r in fetched if r[0] is not None]
        sql = self._sql(select_leased(ctes))
        return [task_row(r) for r in await self._fenced_fetch(sql, *args, planned_once=not free)]

    async def _leased(
        self, rows: list[TaskRow], pools: list[str], now: int, fair: Sequence[str] = ()
    ) -> tuple[list[TaskRow], int | None]:
        """The rows a lease took in order; none: when the next pending task of the pools becomes
        due (those due already wait for what they need: a release, a token, or their group's
        place, and the leader tells or knows when), or, in pools that cap their groups, when the
        next not yet ranked is due (now: the lease visited KEY_SCAN keys of a pool, and the
        next visits the others)."""
        if rows:
            rows.sort(key=lambda r: (-r.priority, r.run_at, r.seq))
            return rows, None
        if any(p in self._key_after for p in pools):
            return [], now
        due_sql = self._sql(NEXT_DUE)
        return [], await self._read(lambda c: c.fetchval(due_sql, pools, list(fair), now))

    async def _fair_take(
        self,
        worker_id: str,
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int,
        free: Mapping[str, int] | None,
        groups: Mapping[str, tuple[int, Mapping[str, int]]] | None,
    ) -> _FairTake | None:
        """A lease of pools that cap their groups only, in two round trips (_fair_read, then
        what _fair_write returns). None: nothing to write."""
        read = await self._fair_read(pools, limit, now, groups)
        return self._fair_write(worker_id, read, choose(read.candidates, read.room, limit, max_bytes, free, pools), now)

    async def _fair_read(
        self,
        pools: list[str],
        limit: int,
        now: int,
        groups: Mapping[str, tuple[int, Mapping[str, int]]] | None,
    ) -> _FairRead:
        """One read (unlocked) of the tasks of these pools (that cap their groups) that became
        due, ranked here, and the first by (priority, rank, seq): the candidates store/fair.py
        chooses among."""
        assert groups is not None and set(pools) <= set(groups), "a lease of a pool that caps groups needs its room"
        room = {p: groups[p] for p in pools}
        window = min(fair_window(limit, room) + len(self._taking), FAIR_WINDOW_MAX)
        sql = self._sql(FAIR_CANDIDATES)
        read = await self._read(lambda c: c.fetch(sql, pools, now, self.settings.lease_overhead_bytes, window))
        # A task ranked now goes into this lease only before the end of its pool's window, if the
        # window was full (those past it may come after tasks this read did not reach).
        heads = [r for r in read if r[6] > 0]
        read_per_pool = Counter(r[1] for r in heads)
        ends = {r[1]: (-r[5], r[6], r[0]) for r in heads if read_per_pool[r[1]] >= window}  # each pool's last
        found = [r for r in read if r[0] not in self._taking]  # another lease is taking or ranking them
        fresh = [r for r in found if r[6] == 0]
        new_ranks = {r[0]: self._ranks.rank(r[1], r[2]) for r in fresh}  # in the order they became due
        ranked = [r for r in found if r[6] > 0]
        order: list[tuple[tuple[int, int, int], Any, int]] = [((-r[5], r[6], r[0]), r, r[6]) for r in ranked]
        for r in fresh:
            key = (-r[5], new_ranks[r[0]], r[0])
            if r[1] not in ends or key < ends[r[1]]:
                order.append((key, r, new_ranks[r[0]]))
        order.sort(key=lambda o: o[0])
        candidates = [Candidate(r[0], r[1], r[2], r[3], json.loads(r[4]) if r[4] else None) for _, r, _ in order]
        rank_of = {r[0]: (r[1], rank) for _, r, rank in order}
        row_of = {r[0]: r for _, r, _ in order}
        return _FairRead(pools, room, candidates, new_ranks, rank_of, row_of)

    def _fair_write(self, worker_id: str, read: _FairRead, chosen: list[int], now: int) -> _FairTake | None:
        """The CTEs that store the new ranks of what read found and take the chosen ($1 to $7),
        each only while still PENDING (the leader's leases of these pools go one at a time, so
        only a cancel or a delete meanwhile takes one away). None: nothing to write."""
        if not chosen and not read.new_ranks:
            return None
        rank_of, row_of = read.rank_of, read.row_of
        taken = set(chosen)
        stored = [(seq, rank) for seq, rank in read.new_ranks.items() if seq not in taken]
        ttl = self.settings.lease_ttl_us
        args = (
            now,
            worker_id,
            chosen,
            [rank_of[seq][1] for seq in chosen],
            [ttl[rank_of[seq][0]] for seq in chosen],
            [seq for seq, _ in stored],
            [rank for _, rank in stored],
        )
        held = [
            Held(seq, row_of[seq][7] + 1, json.loads(row_of[seq][4]) if row_of[seq][4] else {}, *row_of[seq][1:3])
            for seq in chosen
        ]
        seqs = frozenset(chosen) | frozenset(read.new_ranks)
        self._taking |= seqs
        return _FairTake(FAIR_TAKE_CTES, args, {seq: rank_of[seq] for seq in chosen}, self._ranks, held, seqs)

    def _lease_ctes(
        self,
        worker_id: str,
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int,
        free: Mapping[str, int] | None,
    ) -> tuple[str, tuple[Any, ...]]:
        """The CTEs of a lease ($1 to $7, $8 to $10 with resources): `leased` returns the tasks
        it took in TASK_COLUMNS order, and their events are inserted."""
        ttl = self.settings.lease_ttl_us
        multi = len(pools) > 1
        keyed = False
        args: tuple[Any, ...] = ()
        if free:
            keyed = has_keyed(free)
            args = (json.dumps(dict(free)), lease_scan(limit), [n for n, a in free.items() if a <= 0])
            if keyed:
                args += ([self._key_after.get(p, "") for p in pools], KEY_SCAN)
        ctes = lease_ctes(multi, bool(free), keyed)
        overhead = self.settings.lease_overhead_bytes
        return ctes, (now, limit, worker_id, pools, [ttl[p] for p in pools], max_bytes, overhead, *args)

    async def running_resources(self) -> list[tuple[str, Held]]:
        rows = await self._read(lambda c: c.fetch(self._sql(RUNNING_RESOURCES), sorted(self.settings.group_pools)))
        return [(r[0], Held(r[1], r[2], json.loads(r[3]) if r[3] else {}, r[4], r[5])) for r in rows]

    async def load_ranks(self) -> None:
        async def load(conn: asyncpg.Connection) -> None:
            for pool in sorted(self.settings.group_pools):
                await conn.execute(self._sql(UNRANK_UNSTORED), pool)
                lowest = await conn.fetchval(self._sql(LOWEST_RANK), pool)
                last = {r[0]: r[1] for r in await conn.fetch(self._sql(LAST_RANKS), pool)}
                self._ranks.rebuild(pool, (lowest or 1) - 1, last)

        await self._tx(load)

    async def heartbeat(
        self, worker_id: str, attempts: list[tuple[int, int]], now: int, reports: Sequence[Report] = ()
    ) -> tuple[list[int], list[int]]:
        async def beat(conn: asyncpg.Connection) -> tuple[list[int], list[int]]:
            await conn.execute(self._sql(TOUCH_WORKER), now, worker_id)
            sql = self._sql(HEARTBEAT_ROWS)
            seqs = [s for s, _ in attempts] + [r.seq for r in reports]
            current = {r[0]: tuple(r) for r in await conn.fetch(sql, seqs)}
            await self._keep_reports(conn, current_reports(reports, current, worker_id), now)
            cancelled, lost, extend = decide_heartbeat(worker_id, attempts, current, now, self.settings.lease_ttl_us)
            if extend:
                await conn.execute(
                    self._sql(EXTEND_LEASES),
                    [e for e, _ in extend],
                    [s for _, s in extend],
                )
            return cancelled, lost

        return await self._tx(beat)

    async def _keep_reports(self, conn: asyncpg.Connection, reports: Sequence[Report], now: int) -> None:
        """Keeps the reports of current attempts with their tasks; a progress is an event."""
        if not reports:
            return
        await conn.execute(
            self._sql(KEEP_REPORTS),
            *report_columns(reports, now),
        )
        progressed: Changes = [(r.seq, State.RUNNING) for r in reports if r.progress is not None]
        await self._record_events(conn, progressed, [State.RUNNING] * len(progressed), now)
