"""The PostgreSQL store's cancels and bulk actions."""

from __future__ import annotations

import asyncpg

from ..base import NOT_STARTED, Changes, State, TaskFilter, TaskRow
from ..logic import WorkflowTree, decide_restore, decide_retry, descendants_changed, match_sql
from .finish import Finish
from .sql import _DIALECT, DELETE_WITH_TASKS, EXPIRE, EXPIRING


class Bulk(Finish):
    """Cancels, and an operator's actions on many tasks."""

    async def cancel_workflow(
        self, seq: int, now: int, cancellable: frozenset[str] | None
    ) -> tuple[TaskRow | None, int, Changes]:
        sql = self._sql(
            "SELECT seq, pool FROM {s}.tasks WHERE parent_seq = ANY($1::bigint[])"
            " UNION SELECT d.task_seq, t.pool FROM {s}.deps d JOIN {s}.tasks t ON t.seq = d.task_seq"
            " WHERE d.dep_seq = ANY($1::bigint[])"
        )

        async def cancel(conn: asyncpg.Connection) -> tuple[TaskRow | None, int, Changes]:
            tree = WorkflowTree(seq, cancellable)
            while tree.frontier:
                tree.add((r[0], r[1]) for r in await conn.fetch(sql, tree.frontier))
            _, changes = await self._cancel_tasks(conn, [seq, *tree.found], now)
            rows = await self._select(conn, "seq = $1", seq)
            return (rows[0] if rows else None), descendants_changed(seq, changes), changes

        return await self._tx(cancel)

    async def cancel(self, seq: int, now: int) -> tuple[TaskRow | None, Changes]:
        async def cancel(conn: asyncpg.Connection) -> tuple[TaskRow | None, Changes]:
            _, changes = await self._cancel_tasks(conn, [seq], now)
            rows = await self._select(conn, "seq = $1", seq)
            return (rows[0] if rows else None), changes

        return await self._tx(cancel)

    async def cancel_tasks(self, seqs: list[int], now: int) -> tuple[list[int], Changes]:
        return await self._tx(lambda conn: self._cancel_tasks(conn, seqs, now))

    async def _cancel_tasks(self, conn: asyncpg.Connection, seqs: list[int], now: int) -> tuple[list[int], Changes]:
        # Locked in seq order, as every change of several tasks does: no deadlock between them.
        rows = await conn.fetch(
            self._sql(
                "SELECT seq, state FROM {s}.tasks WHERE seq = ANY($1::bigint[])"
                " AND (state IN (1, 2) OR (state = 3 AND NOT cancel_requested)) ORDER BY seq FOR UPDATE"
            ),
            seqs,
        )
        ended = [(r[0], State(r[1])) for r in rows if r[1] != State.RUNNING]
        requested = [r[0] for r in rows if r[1] == State.RUNNING]
        await conn.execute(
            self._sql(
                "UPDATE {s}.tasks SET state = 6, error = 'cancelled', finished_at = $1 WHERE seq = ANY($2::bigint[])"
            ),
            now,
            [seq for seq, _ in ended],
        )
        await conn.execute(
            self._sql("UPDATE {s}.tasks SET cancel_requested = true WHERE seq = ANY($1::bigint[])"), requested
        )
        changes: Changes = [(seq, State.CANCELLED) for seq, _ in ended] + [(seq, State.RUNNING) for seq in requested]
        prev = [state for _, state in ended] + [State.RUNNING] * len(requested)
        dependents = await self._end_dependents(conn, [seq for seq, _ in ended], State.CANCELLED, now)
        changes += dependents
        prev += [State.BLOCKED] * len(dependents)
        await self._record_events(conn, changes, prev, now)
        return sorted([seq for seq, _ in ended] + requested), changes

    async def expire_unstarted(self, now: int, limit: int) -> Changes:
        async def expire(conn: asyncpg.Connection) -> Changes:
            rows = await conn.fetch(self._sql(EXPIRING), now, limit)
            seqs = [r[0] for r in rows]
            await conn.execute(self._sql(EXPIRE), now, NOT_STARTED, seqs)
            changes: Changes = [(seq, State.EXPIRED) for seq in seqs]
            prev = [State(r[1]) for r in rows]
            dependents = await self._end_dependents(conn, seqs, State.EXPIRED, now)
            changes += dependents
            prev += [State.BLOCKED] * len(dependents)
            await self._record_events(conn, changes, prev, now)
            if any(state == State.PENDING for _, state in dependents):  # a finalizer released
                await conn.execute("SELECT pg_notify($1, '')", self.channel)
            return changes

        return await self._tx(expire)

    async def match_tasks(self, match: TaskFilter, after_seq: int, limit: int) -> list[tuple[int, State, str]]:
        where, params = match_sql(match, after_seq, limit, _DIALECT)
        sql = self._sql(f"SELECT seq, state, pool FROM {{s}}.tasks WHERE {where}")
        rows = await self._scan(lambda c: c.fetch(sql, *params))
        return [(r[0], State(r[1]), r[2]) for r in rows]

    # Rows are locked in the order finish locks them: a task's dependencies (FOR SHARE: none ends
    # until this commits, so none is miscounted) before the task (FOR UPDATE).

    async def retry_tasks(
        self,
        seqs: list[int],
        now: int,
        run_at: int | None,
        extra_attempts: int,
        restorable: frozenset[str] | None = None,
    ) -> tuple[list[TaskRow], int, Changes]:
        with self._may_block():  # may create BLOCKED tasks, as a submission may
            return await self._tx(lambda c: self._retry_tasks(c, seqs, now, run_at, extra_attempts, restorable))

    async def _retry_tasks(
        self,
        conn: asyncpg.Connection,
        seqs: list[int],
        now: int,
        run_at: int | None,
        extra_attempts: int,
        restorable: frozenset[str] | None,
    ) -> tuple[list[TaskRow], int, Changes]:
        deps = await self._dep_states(conn, seqs)
        sql = self._sql(
            "SELECT seq, state, attempt, max_attempts FROM {s}.tasks WHERE seq = ANY($1::bigint[])"
            " AND state IN (5, 6, 7) ORDER BY seq FOR UPDATE"
        )
        rows = [(r[0], State(r[1]), r[2], r[3]) for r in await conn.fetch(sql, seqs)]
        plan = decide_retry(rows, deps, now, run_at, extra_attempts)
        if plan.retried:
            await conn.execute(
                self._sql(
                    "UPDATE {s}.tasks t SET state = u.state, run_at = u.run_at, max_attempts = u.max_attempts,"
                    " blocked_on = u.blocked_on, error = '', result = NULL, result_content_type = '',"
                    " finished_at = NULL, worker_id = NULL, started_at = NULL, lease_expires_at = NULL,"
                    # An operator's retry means run it: its start deadline goes.
                    f" cancel_requested = false, start_by = NULL, {self._rank_reset}"
                    " FROM unnest($1::smallint[], $2::bigint[], $3::int[], $4::int[], $5::bigint[])"
                    " AS u(state, run_at, max_attempts, blocked_on, seq)"
                    " WHERE t.seq = u.seq"
                ),
                *[list(c) for c in zip(*plan.retried, strict=True)],
            )
        # Each step's events are recorded after its writes: they read the task as it left it.
        await self._record_events(conn, plan.changes, plan.prev, now)
        retried = frontier = [r[-1] for r in plan.retried]
        while frontier:
            recorded, restored, renamed = len(plan.changes), len(plan.restored), len(plan.renamed)
            sql = self._sql(
                "SELECT DISTINCT d.task_seq FROM {s}.deps d JOIN {s}.tasks t ON t.seq = d.task_seq"
                " WHERE d.dep_seq = ANY($1::bigint[]) AND t.state IN (5, 6, 7) AND t.attempt = 0"
            )
            found = [r[0] for r in await conn.fetch(sql, frontier)]
            deps = await self._dep_states(conn, found)
            sql = self._sql(
                "SELECT seq, state, error, pool FROM {s}.tasks WHERE seq = ANY($1::bigint[]) AND state IN (5, 6, 7)"
                " AND attempt = 0 ORDER BY seq FOR UPDATE"
            )
            candidates = [(r[0], State(r[1]), r[2], r[3]) for r in await conn.fetch(sql, found)]
            frontier = decide_restore(plan, candidates, frontier, deps, self._full_id, restorable)
            if plan.restored[restored:]:
                await conn.execute(
                    self._sql(
                        "UPDATE {s}.tasks t SET state = 2, blocked_on = u.blocked_on, error = '', finished_at = NULL"
                        " FROM unnest($1::int[], $2::bigint[]) AS u(blocked_on, seq) WHERE t.seq = u.seq"
                    ),
                    *[list(c) for c in zip(*plan.restored[restored:], strict=True)],
                )
            if plan.renamed[renamed:]:
                await conn.execute(
                    self._sql(
                        "UPDATE {s}.tasks t SET error = u.error FROM unnest($1::text[], $2::bigint[])"
                        " AS u(error, seq) WHERE t.seq = u.seq"
                    ),
                    *[list(c) for c in zip(*plan.renamed[renamed:], strict=True)],
                )
            await self._record_events(conn, plan.changes[recorded:], plan.prev[recorded:], now)
        # A finalizer still waiting counted these as ended: it waits for them again.
        await conn.execute(
            self._sql(
                "WITH inc AS (SELECT d.task_seq, count(*) AS n FROM {s}.deps d JOIN {s}.tasks w ON w.seq = d.task_seq"
                " WHERE d.dep_seq = ANY($1::bigint[]) AND w.state = 2 AND w.run_when = 2 GROUP BY d.task_seq)"
                " UPDATE {s}.tasks t SET blocked_on = t.blocked_on + inc.n FROM inc WHERE t.seq = inc.task_seq"
            ),
            [seq for seq, _ in plan.changes],
        )
        if any(state == State.PENDING for _, state in plan.changes):
            await conn.execute("SELECT pg_notify($1, '')", self.channel)
        return await self._select(conn, "seq = ANY($1::bigint[])", retried), len(plan.restored), plan.changes

    async def _dep_states(self, conn: asyncpg.Connection, seqs: list[int]) -> dict[int, list[tuple[int, State]]]:
        """The dependencies still stored of each of these tasks, with their states (share-locked)."""
        sql = self._sql(
            "SELECT d.task_seq, d.dep_seq, t.state FROM {s}.deps d JOIN {s}.tasks t ON t.seq = d.dep_seq"
            " WHERE d.task_seq = ANY($1::bigint[]) ORDER BY t.seq FOR SHARE OF t"
        )
        deps: dict[int, list[tuple[int, State]]] = {}
        for seq, dep, state in await conn.fetch(sql, seqs):
            deps.setdefault(seq, []).append((dep, State(state)))
        return deps

    async def delete_tasks(self, seqs: list[int]) -> list[int]:
        sql = self._sql(
            "WITH gone AS (DELETE FROM {s}.tasks WHERE seq = ANY($1::bigint[]) AND state IN (4, 5, 6, 7)"
            f" RETURNING seq),{DELETE_WITH_TASKS}"
            " SELECT seq FROM gone ORDER BY seq"
        )
        return [r[0] for r in await self._tx(lambda c: c.fetch(sql, seqs))]
