"""The PostgreSQL store's leases and heartbeats."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from ...core.limits import MAX_TIMEOUT_MS
from ..base import Changes, Held, Report, State, TaskRow
from ..fair import (
    FAIR_WINDOW_MAX,
    RANK_BATCH,
    Candidate,
    GroupRanks,
    choose,
    fair_window,
    left_after,
    row_bytes,
    turn_share,
)
from ..logic import (
    HEARTBEAT_COLUMNS,
    KEY_SCAN,
    current_reports,
    decide_heartbeat,
    has_keyed,
    lease_scan,
    report_columns,
    task_row,
)
from .events import Events
from .sql import _FITS_ALONE, _KEYED, _ONCE, LEASE_SIZE, _free_for, _in_turns, events_of, startable


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
                sql = self._sql(f"WITH {take.ctes} SELECT * FROM leased")
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
            # The leased tasks, and the key each pool's visit ended at when it visited
            # KEY_SCAN keys (the next lease starts after it); a row without a task when
            # none was leased (none leased and no such key: no row, and the term is checked).
            sql = self._sql(
                f"WITH {ctes} SELECT l.*, {_ONCE.format('e.pools')}, {_ONCE.format('e.keys')}"
                " FROM (SELECT array_agg(pool) AS pools, array_agg(key) AS keys FROM keys WHERE n = $12"
                " AND {fence}) AS e LEFT JOIN leased l ON true WHERE l.seq IS NOT NULL OR e.pools IS NOT NULL"
            )
            fetched = await self._fenced_fetch(sql, *args)
            for pool in pools:
                self._key_after.pop(pool, None)
            self._key_after.update(zip(*_carried(fetched), strict=True))
            return [task_row(r) for r in fetched if r[0] is not None]
        sql = self._sql(f"WITH {ctes} SELECT * FROM leased")
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
        # One index step per pool (tasks_due; "pool = ANY" would read every PENDING task).
        due_sql = self._sql(
            "SELECT least((SELECT min(x.run_at) FROM unnest($1::text[]) AS p(pool), LATERAL (SELECT run_at"
            " FROM {s}.tasks WHERE state = 1 AND pool = p.pool AND run_at > $3 ORDER BY run_at LIMIT 1) AS x),"
            " (SELECT min(run_at) FROM {s}.tasks WHERE state = 1 AND group_rank = 0 AND pool = ANY($2::text[])))"
        )
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
        sql = self._sql(
            f"(SELECT seq, pool, group_key, {LEASE_SIZE} + $3, resources, priority, 0::bigint, attempt"
            " FROM {s}.tasks t WHERE state = 1 AND group_rank = 0 AND pool = ANY($1::text[]) AND run_at <= $2"
            f" AND {startable('$2')}"
            f" ORDER BY run_at, seq LIMIT {RANK_BATCH})"
            " UNION ALL (SELECT x.* FROM unnest($1::text[]) AS p(pool), LATERAL (SELECT t.seq, t.pool, t.group_key,"
            f" {LEASE_SIZE} + $3, t.resources, t.priority, t.group_rank, t.attempt FROM {{s}}.tasks t"
            f" WHERE t.state = 1 AND t.group_rank > 0 AND t.pool = p.pool AND t.run_at <= $2 AND {startable('$2')}"
            " ORDER BY t.priority DESC, t.group_rank, t.seq LIMIT $4) AS x)"
        )
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
        # Taken only while still PENDING (they were read without a lock): the state written as an
        # expression, so that no partial index on state = 1 applies, and the seqs named again as
        # an index condition: the tasks are looked up by seq, whatever the table's statistics.
        take = (
            "FROM chosen WHERE t.seq = chosen.seq AND t.seq = ANY($3::bigint[]) AND t.state::int = 1"
            f" AND {startable('$1')}"
        )
        ctes = (
            "ranked AS (UPDATE {s}.tasks t SET group_rank = u.rank FROM unnest($6::bigint[], $7::bigint[])"
            " AS u(seq, rank) WHERE t.seq = u.seq AND t.state = 1 AND t.group_rank = 0 AND {fence}),"
            " chosen AS (SELECT * FROM unnest($3::bigint[], $4::bigint[], $5::bigint[]) AS c(seq, rank, ttl)"
            " WHERE {fence})," + self._leased_cte("$2", "chosen.ttl", take, rank="chosen.rank")
        )
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
        return _FairTake(ctes, args, {seq: rank_of[seq] for seq in chosen}, self._ranks, held, seqs)

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
        # Several pools are dealt round robin (in the order given): each task carries its pool's
        # place, and those picked are each pool's first in lease order, then each one's second...
        multi = len(pools) > 1
        place, unnest = ", p.place", "unnest($4::text[]) WITH ORDINALITY AS p(pool, place)"
        if not multi:
            place, unnest = "", "unnest($4::text[]) AS p(pool)"
        # One index-ordered scan per pool ("pool = ANY" would sort every pending row).
        # Tasks that name no resources, and those that do, are in indexes of their own: the
        # first never wait behind the second.
        plain = (
            f"SELECT x.seq, x.priority, x.run_at, x.size{place} FROM {unnest}, LATERAL"
            f" (SELECT seq, priority, run_at, {LEASE_SIZE} AS size FROM {{s}}.tasks t"
            f" WHERE state = 1 AND pool = p.pool AND run_at <= $1 AND {startable('$1')}"
            " AND resources IS NULL ORDER BY priority DESC, run_at, seq LIMIT $2 FOR UPDATE SKIP LOCKED) AS x"
            " WHERE {fence}"
        )
        if multi:
            picked = f"picked AS ({_in_turns(plain, '$2')})"
        else:
            picked = f"picked AS ({plain} ORDER BY x.priority DESC, x.run_at, x.seq LIMIT $2)"
        args: tuple[Any, ...] = ()
        if free:
            # Of the due tasks that name resources, the first whose every amount is available
            # alone (those of a resource used up are passed over in the index scan, so they
            # never hold back the tasks behind), and those of the keys with room a keyed
            # resource names (_KEYED); of those, the ones that still fit beside the tasks before
            # them (running totals per resource).
            keyed = has_keyed(free)
            # Per pool, in index order, locked as they are read.
            cand = (
                f"SELECT x.seq, x.priority, x.run_at, x.size, x.resources{place}"
                f" FROM {unnest}, LATERAL (SELECT seq, priority, run_at,"
                f" {LEASE_SIZE} AS size, resources FROM {{s}}.tasks t"
                f" WHERE state = 1 AND pool = p.pool AND run_at <= $1 AND {startable('$1')}"
                " AND resources IS NOT NULL AND res_key IS NULL"
                # A task naming an entry with nothing free ($10) is passed over by one look-up,
                # not a row per entry.
                f" AND NOT resources::jsonb ?| $10::text[] AND {_FITS_ALONE}"
                " ORDER BY priority DESC, run_at, seq LIMIT $9 FOR UPDATE SKIP LOCKED) AS x WHERE {fence}"
                + (" UNION ALL SELECT * FROM keyed" if keyed else "")
            )
            need = (
                " need AS (SELECT c.seq, r.key AS name, sum(r.value::bigint) OVER (PARTITION BY r.key"
                " ORDER BY c.priority DESC, c.run_at, c.seq) AS upto"
                " FROM cand c, jsonb_each_text(c.resources::jsonb) r),"
            )
            fits = (
                f"SELECT seq, priority, run_at, size{', place' if multi else ''} FROM cand WHERE seq NOT IN"
                f" (SELECT seq FROM need WHERE upto > {_free_for('need.name')})"
            )
            if multi:
                picked = (
                    f" cand AS ({_in_turns(cand, '$9')}),{need}"
                    f" picked AS ({_in_turns(f'SELECT * FROM ({plain}) AS plain UNION ALL {fits}', '$2')})"
                )
            else:
                picked = (
                    f" cand AS (SELECT * FROM ({cand}) AS c ORDER BY priority DESC, run_at, seq LIMIT $9),{need}"
                    f" picked AS (SELECT * FROM ({plain}) AS plain UNION ALL {fits}"
                    " ORDER BY priority DESC, run_at, seq LIMIT $2)"
                )
            args = (json.dumps(dict(free)), lease_scan(limit), [n for n, a in free.items() if a <= 0])
            if keyed:
                by_place = ", array_position($4::text[], keys.pool) AS place" if multi else ""
                picked = _KEYED.replace("{place}", by_place) + "," + picked
                args += ([self._key_after.get(p, "") for p in pools], KEY_SCAN)
        # Of the rows picked, the first always and then as many as fit in max_bytes (each row's
        # size is read as it is picked: octet_length reads a stored value's size without
        # decompressing it).
        ctes = (
            f"{picked},"
            f" sized AS (SELECT p.seq, row_number() OVER w AS n, sum(p.size + $7) OVER w"
            " AS upto FROM picked p"
            f" WINDOW w AS (ORDER BY {'p.turn, p.place' if multi else 'p.priority DESC, p.run_at, p.seq'})),"
            " chosen AS (SELECT seq FROM sized WHERE n = 1 OR $6::bigint <= 0 OR upto <= $6::bigint),"
            + self._take_ctes()
        )
        overhead = self.settings.lease_overhead_bytes
        return ctes, (now, limit, worker_id, pools, [ttl[p] for p in pools], max_bytes, overhead, *args)

    def _take_ctes(self) -> str:
        """The CTEs that lease the tasks `chosen` names (now is $1; the worker id $3, the pools $4
        and their lease TTLs $5): `leased` returns them in TASK_COLUMNS order, and their events
        are inserted."""
        # The tasks by their seqs (an index condition whatever the plan expects of `chosen`).
        ttl = "($5::bigint[])[array_position($4::text[], t.pool)]"
        return self._leased_cte("$3", ttl, "WHERE t.seq = ANY(ARRAY(SELECT seq FROM chosen))")

    def _leased_cte(self, worker: str, ttl: str, source: str, rank: str = "") -> str:
        """`leased`, that leases the tasks of source (now is $1) for their TTL, and `lease_ev`."""
        keep_rank = f" group_rank = {rank}," if rank else ""
        return (
            " leased AS (UPDATE {s}.tasks t SET state = 3, attempt = t.attempt + 1,"
            f" worker_id = {worker}, started_at = $1,{keep_rank}"
            # Never past the attempt's deadline (started_at + timeout_ms); a timeout stored before the
            # API bounded it is taken at that bound, so its product fits a bigint.
            " lease_expires_at = $1 + CASE WHEN t.timeout_ms > 0"
            f" THEN least({ttl}, least(t.timeout_ms, {MAX_TIMEOUT_MS}) * 1000)"
            f" ELSE {ttl} END {source}"
            f" RETURNING {self._cols}),"
            f" lease_ev AS ({events_of('3', 'attempt', '$1::bigint', '1', 'leased')})"
        )

    async def running_resources(self) -> list[tuple[str, Held]]:
        sql = (
            "SELECT worker_id, seq, attempt, resources, pool, group_key FROM {s}.tasks WHERE state = 3"
            " AND (resources IS NOT NULL OR pool = ANY($1::text[]))"
        )
        rows = await self._read(lambda c: c.fetch(self._sql(sql), sorted(self.settings.group_pools)))
        return [(r[0], Held(r[1], r[2], json.loads(r[3]) if r[3] else {}, r[4], r[5])) for r in rows]

    async def load_ranks(self) -> None:
        async def load(conn: asyncpg.Connection) -> None:
            for pool in sorted(self.settings.group_pools):
                # PENDING tasks stored before the pool capped its groups: ranked when due.
                sql = "UPDATE {s}.tasks SET group_rank = 0 WHERE state = 1 AND pool = $1 AND group_rank IS NULL"
                await conn.execute(self._sql(sql), pool)
                sql = "SELECT min(group_rank) FROM {s}.tasks WHERE state = 1 AND group_rank > 0 AND pool = $1"
                lowest = await conn.fetchval(self._sql(sql), pool)
                sql = (
                    "SELECT group_key, max(group_rank) FROM {s}.tasks WHERE state = 1 AND group_rank > 0"
                    " AND pool = $1 GROUP BY group_key"
                )
                last = {r[0]: r[1] for r in await conn.fetch(self._sql(sql), pool)}
                self._ranks.rebuild(pool, (lowest or 1) - 1, last)

        await self._tx(load)

    async def heartbeat(
        self, worker_id: str, attempts: list[tuple[int, int]], now: int, reports: Sequence[Report] = ()
    ) -> tuple[list[int], list[int]]:
        async def beat(conn: asyncpg.Connection) -> tuple[list[int], list[int]]:
            await conn.execute(self._sql("UPDATE {s}.workers SET last_seen_at = $1 WHERE id = $2"), now, worker_id)
            sql = self._sql(f"SELECT {HEARTBEAT_COLUMNS} FROM {{s}}.tasks WHERE seq = ANY($1::bigint[])")
            seqs = [s for s, _ in attempts] + [r.seq for r in reports]
            current = {r[0]: tuple(r) for r in await conn.fetch(sql, seqs)}
            await self._keep_reports(conn, current_reports(reports, current, worker_id), now)
            cancelled, lost, extend = decide_heartbeat(worker_id, attempts, current, now, self.settings.lease_ttl_us)
            if extend:
                await conn.execute(
                    self._sql(
                        "UPDATE {s}.tasks t SET lease_expires_at = u.expiry"
                        " FROM unnest($1::bigint[], $2::bigint[]) AS u(expiry, seq) WHERE t.seq = u.seq"
                    ),
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
            self._sql(
                "UPDATE {s}.tasks t SET progress = coalesce(u.progress, t.progress),"
                " checkpoint = CASE WHEN u.has_checkpoint THEN u.checkpoint ELSE t.checkpoint END"
                " FROM unnest($1::bigint[], $2::text[], $3::boolean[], $4::bytea[])"
                " AS u(seq, progress, has_checkpoint, checkpoint) WHERE t.seq = u.seq"
            ),
            *report_columns(reports, now),
        )
        progressed: Changes = [(r.seq, State.RUNNING) for r in reports if r.progress is not None]
        await self._record_events(conn, progressed, [State.RUNNING] * len(progressed), now)
