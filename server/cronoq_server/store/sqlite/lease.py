"""The SQLite store's leases (plain, fair and keyed), heartbeats and the resources held."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from ..base import Changes, Held, Report, State, TaskRow
from ..fair import Candidate, choose, fair_window, free_for, left_after, row_bytes, turn_share
from ..logic import (
    KEY_SCAN,
    current_reports,
    decide_heartbeat,
    event_task_values,
    has_keyed,
    lease_scan,
    report_columns,
    task_row,
)
from .core import _chunks
from .events import Events
from .sql import marks
from .sql.lease import (
    EXTEND_LEASE,
    GROUP_RANKS,
    INSERT_EVENT,
    KEEP_REPORT,
    KEY_HEAD,
    LOWEST_RANK,
    NEXT_DUE,
    NEXT_KEY,
    SET_GROUP_RANK,
    TOUCH_WORKER,
    UNRANKED_WHEN_DUE,
    due_unranked,
    fair_heads,
    heartbeat_rows,
    lease_in_turns,
    lease_plain,
    next_unranked,
    running_resources,
    take,
)


class Lease(Events):
    # -- leases ---------------------------------------------------------------

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
        return await self._tx(self._lease, worker_id, pools, limit, now, max_bytes, free, groups)

    def _lease(
        self,
        db: sqlite3.Connection,
        worker_id: str,
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int,
        free: Mapping[str, int] | None,
        groups: Mapping[str, tuple[int, Mapping[str, int]]] | None = None,
    ) -> tuple[list[TaskRow], int | None]:
        """Deals limit across the pools in turn (the first given first), the pools that cap their
        groups (store/fair.py chooses) and the rest (one statement) each taking what the other
        leaves."""
        fair = [p for p in pools if p in self.settings.group_pools]
        others = [p for p in pools if p not in self.settings.group_pools]
        rows: list[TaskRow] = []
        chosen: list[int] = []
        if fair:
            assert groups is not None and set(fair) <= set(groups), "a lease of a pool that caps groups needs its room"
            room = {p: groups[p] for p in fair}
            candidates, ranks = self._fair_candidates(db, fair, limit, now, room)
            share = turn_share(pools, fair, limit)
            chosen = choose(candidates, room, share, max_bytes, free, fair)
        if others:
            left = (limit, max_bytes, free)
            if fair:
                by_seq = {c.seq: c for c in candidates}
                left = left_after(limit, max_bytes, free, [(by_seq[s].size, by_seq[s].resources) for s in chosen])
            if left[0] > 0:
                rows = self._lease_plain(db, worker_id, others, left[0], now, left[1], left[2])
            if fair and len(chosen) == share and len(rows) < left[0]:  # the others left slots: more of these
                overhead = self.settings.lease_overhead_bytes
                plain = [(row_bytes(r, overhead), r.resources) for r in rows]
                chosen = choose(candidates, room, *left_after(limit, max_bytes, free, plain), fair)
        if chosen:
            taken = self._take(db, worker_id, fair, now, marks(len(chosen)), tuple(chosen))
            for r in taken:
                self._ranks.served(*ranks[r.seq])
            rows += taken
        if rows:
            rows.sort(key=lambda r: (-r.priority, r.run_at, r.seq))
            return rows, None
        # When a lease may find more: when the next task becomes due (those due already wait for
        # what they need: a release, a token, or their group's place, and the leader tells or
        # knows when); in pools that cap their groups, the next not yet ranked; now, when it
        # visited KEY_SCAN keys of a pool (the next lease visits the others).
        if any(p in self._key_after for p in others):
            return [], now
        due = [db.execute(NEXT_DUE, (p, now)).fetchone()[0] for p in others]
        if fair:
            due.append(db.execute(next_unranked(len(fair)), fair).fetchone()[0])
        return [], min((d for d in due if d is not None), default=None)

    def _fair_candidates(
        self,
        db: sqlite3.Connection,
        pools: list[str],
        limit: int,
        now: int,
        room: Mapping[str, tuple[int, Mapping[str, int]]],
    ) -> tuple[list[Candidate], dict[int, tuple[str, int]]]:
        """Ranks the tasks of these pools (that cap their groups) that became due, then reads
        the first by (priority, rank, seq): store/fair.py chooses among them (one statement more
        than a plain lease: the choice is made between the read and the update). With each
        one's pool and rank."""
        due = db.execute(due_unranked(len(pools)), (*pools, now)).fetchall()
        ranked = [(self._ranks.rank(pool, group), seq) for seq, pool, group in due]
        db.executemany(SET_GROUP_RANK, ranked)
        head = fair_heads(len(pools), self.settings.lease_overhead_bytes)
        window = fair_window(limit, room)
        found = db.execute(head, [v for p in pools for v in (p, now, window)]).fetchall()
        found.sort(key=lambda r: (-r[5], r[6], r[0]))
        ranks = {r[0]: (r[1], r[6]) for r in found}
        return [Candidate(r[0], r[1], r[2], r[3], json.loads(r[4]) if r[4] else None) for r in found], ranks

    def _lease_plain(
        self,
        db: sqlite3.Connection,
        worker_id: str,
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int,
        free: Mapping[str, int] | None,
    ) -> list[TaskRow]:
        if len(pools) > 1:
            return self._lease_in_turns(db, worker_id, pools, limit, now, max_bytes, free)
        params: tuple[Any, ...] = (*pools, now, limit)
        if free:
            # The keys with room of a keyed resource: their tasks are candidates beside the others.
            keyed = self._keyed(db, pools, now, limit, free) if has_keyed(free) else []
            scan = lease_scan(limit)
            params = (json.dumps(dict(free)), *pools, now, scan, json.dumps(keyed), scan, *params, limit)
        chosen = lease_plain(len(pools), self.settings.lease_overhead_bytes, bool(free))
        return self._take(db, worker_id, pools, now, chosen, (*params, max_bytes, max_bytes))

    def _lease_in_turns(
        self,
        db: sqlite3.Connection,
        worker_id: str,
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int,
        free: Mapping[str, int] | None,
    ) -> list[TaskRow]:
        """_lease_plain of several pools, dealt round robin (in the order given): the first due
        tasks of each pool (its place), then each pool's first of those, its second, and so on."""

        def each(count: int) -> list[Any]:
            return [v for p in pools for v in (p, now, count)]

        params = each(limit)
        keyed = has_keyed(free) if free else False
        if free:
            # As _lease_plain's, each pool's own (those of a keyed resource by key: _keyed).
            scan = lease_scan(limit)
            cand_params = each(scan)
            if keyed:
                for pool in pools:
                    cand_params.append(json.dumps(self._keyed(db, [pool], now, limit, free)))
            params = [json.dumps(dict(free)), *cand_params, scan, *params]
        chosen = lease_in_turns(len(pools), self.settings.lease_overhead_bytes, bool(free), keyed)
        return self._take(db, worker_id, pools, now, chosen, (*params, limit, max_bytes, max_bytes))

    def _keyed(
        self, db: sqlite3.Connection, pools: list[str], now: int, limit: int, free: Mapping[str, int]
    ) -> list[int]:
        """Of the keys of these pools' PENDING tasks (_keys), those with room: each one's first
        due tasks that fit alone, as many as it has room for (at most limit). A key without room
        costs one index step; its tasks are never read."""
        free_json = json.dumps(dict(free))
        seqs: list[int] = []
        for pool in pools:
            for key in self._keys(db, pool):
                room = min(free_for(free, key), limit)
                if room > 0:  # one prepared statement a key (a compound of them is slower to prepare)
                    seqs += [r[0] for r in db.execute(KEY_HEAD, (free_json, pool, key, now, room))]
        return seqs

    def _keys(self, db: sqlite3.Connection, pool: str) -> list[str]:
        """The keys of the pool's PENDING tasks a lease visits (logic.KEY_SCAN): after those
        the last lease visited, then from the first again up to there."""
        after = self._key_after.pop(pool, "")
        keys: list[str] = []
        key, wrapped = after, False
        while len(keys) < KEY_SCAN:
            row = db.execute(NEXT_KEY, (pool, key)).fetchone()
            if row is None:
                if wrapped or not after:
                    break
                key, wrapped = "", True
                continue
            key = row[0]
            if wrapped and key > after:
                break
            keys.append(key)
        if len(keys) == KEY_SCAN:
            self._key_after[pool] = keys[-1]
        return keys

    def _take(
        self, db: sqlite3.Connection, worker_id: str, pools: list[str], now: int, chosen: str, params: tuple[Any, ...]
    ) -> list[TaskRow]:
        """Leases the PENDING tasks of these pools whose seqs chosen (SQL, with params) gives:
        RUNNING for worker_id from now, their events recorded; in lease order."""
        ttl = self.settings.lease_ttl_us
        expiry_params: list[Any] = []
        for p in pools:
            expiry_params += [p, now + ttl[p]]
        all_params = (worker_id, now, *expiry_params, now, *expiry_params, *params)
        rows = [task_row(r) for r in db.execute(take(len(pools), chosen), all_params)]
        rows.sort(key=lambda r: (-r.priority, r.run_at, r.seq))
        running = int(State.RUNNING)
        pending = int(State.PENDING)
        events = [(r.seq, running, r.attempt, now, r.pool, pending, *event_task_values(r)) for r in rows]
        db.executemany(INSERT_EVENT, events)
        return rows

    async def heartbeat(
        self, worker_id: str, attempts: list[tuple[int, int]], now: int, reports: Sequence[Report] = ()
    ) -> tuple[list[int], list[int]]:
        return await self._tx(self._heartbeat, worker_id, attempts, now, reports)

    def _heartbeat(
        self,
        db: sqlite3.Connection,
        worker_id: str,
        attempts: list[tuple[int, int]],
        now: int,
        reports: Sequence[Report],
    ) -> tuple[list[int], list[int]]:
        db.execute(TOUCH_WORKER, (now, worker_id))
        current: dict[int, tuple[Any, ...]] = {}
        seqs = [s for s, _ in attempts] + [r.seq for r in reports]
        for chunk in _chunks(seqs):
            for r in db.execute(heartbeat_rows(len(chunk)), chunk):
                current[r[0]] = r
        self._keep_reports(db, current_reports(reports, current, worker_id), now)
        cancelled, lost, extend = decide_heartbeat(worker_id, attempts, current, now, self.settings.lease_ttl_us)
        db.executemany(EXTEND_LEASE, extend)
        return cancelled, lost

    def _keep_reports(self, db: sqlite3.Connection, reports: Sequence[Report], now: int) -> None:
        """Keeps the reports of current attempts with their tasks; a progress is an event."""
        seqs, progress, has_checkpoint, checkpoint = report_columns(reports, now)
        db.executemany(
            KEEP_REPORT,
            zip(progress, has_checkpoint, checkpoint, seqs, strict=True),
        )
        progressed: Changes = [(r.seq, State.RUNNING) for r in reports if r.progress is not None]
        self._record_events(db, progressed, [State.RUNNING] * len(progressed), now)

    async def running_resources(self) -> list[tuple[str, Held]]:
        sql = running_resources(len(self.settings.group_pools))
        rows = await self._run(lambda: self._conn.execute(sql, sorted(self.settings.group_pools)).fetchall())
        return [(r[0], Held(r[1], r[2], json.loads(r[3]) if r[3] else {}, r[4], r[5])) for r in rows]

    async def load_ranks(self) -> None:
        await self._tx(self._load_ranks)

    def _load_ranks(self, db: sqlite3.Connection) -> None:
        for pool in sorted(self.settings.group_pools):
            # PENDING tasks stored before the pool capped its groups: ranked when due.
            db.execute(UNRANKED_WHEN_DUE, (pool,))
            lowest = db.execute(LOWEST_RANK, (pool,)).fetchone()[0]
            self._ranks.rebuild(pool, (lowest or 1) - 1, dict(db.execute(GROUP_RANKS, (pool,)).fetchall()))
