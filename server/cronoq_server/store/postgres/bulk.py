"""The PostgreSQL store's cancels and bulk actions."""

from __future__ import annotations

import asyncpg

from ..base import NOT_STARTED, Changes, State, TaskFilter, TaskRow
from ..logic import WorkflowTree, decide_restore, decide_retry, descendants_changed, match_sql
from .finish import Finish
from .sql import _DIALECT, NOTIFY
from .sql.bulk import (
    CANCEL_UNSTARTED,
    CHILDREN_AND_DEPENDENTS,
    DELETE_TASKS,
    DEPENDENCY_STATES,
    ENDED_DEPENDENTS,
    EXPIRE,
    EXPIRING,
    LOCK_CANCELLABLE,
    LOCK_RESTORABLE,
    LOCK_RETRYABLE,
    REQUEST_CANCEL,
    RESTORE_BLOCKED,
    SET_ERRORS,
    WAIT_AGAIN,
    matching,
    retry_ended,
)
from .sql.core import BY_SEQ, BY_SEQS


class Bulk(Finish):
    """Cancels, and an operator's actions on many tasks."""

    async def cancel_workflow(
        self, seq: int, now: int, cancellable: frozenset[str] | None
    ) -> tuple[TaskRow | None, int, Changes]:
        sql = self._sql(CHILDREN_AND_DEPENDENTS)

        async def cancel(conn: asyncpg.Connection) -> tuple[TaskRow | None, int, Changes]:
            tree = WorkflowTree(seq, cancellable)
            while tree.frontier:
                tree.add((r[0], r[1]) for r in await conn.fetch(sql, tree.frontier))
            _, changes = await self._cancel_tasks(conn, [seq, *tree.found], now)
            rows = await self._select(conn, BY_SEQ, seq)
            return (rows[0] if rows else None), descendants_changed(seq, changes), changes

        return await self._tx(cancel)

    async def cancel(self, seq: int, now: int) -> tuple[TaskRow | None, Changes]:
        async def cancel(conn: asyncpg.Connection) -> tuple[TaskRow | None, Changes]:
            _, changes = await self._cancel_tasks(conn, [seq], now)
            rows = await self._select(conn, BY_SEQ, seq)
            return (rows[0] if rows else None), changes

        return await self._tx(cancel)

    async def cancel_tasks(self, seqs: list[int], now: int) -> tuple[list[int], Changes]:
        return await self._tx(lambda conn: self._cancel_tasks(conn, seqs, now))

    async def _cancel_tasks(self, conn: asyncpg.Connection, seqs: list[int], now: int) -> tuple[list[int], Changes]:
        rows = await conn.fetch(
            self._sql(LOCK_CANCELLABLE),
            seqs,
        )
        ended = [(r[0], State(r[1])) for r in rows if r[1] != State.RUNNING]
        requested = [r[0] for r in rows if r[1] == State.RUNNING]
        await conn.execute(
            self._sql(CANCEL_UNSTARTED),
            now,
            [seq for seq, _ in ended],
        )
        await conn.execute(self._sql(REQUEST_CANCEL), requested)
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
                await conn.execute(NOTIFY, self.channel)
            return changes

        return await self._tx(expire)

    async def match_tasks(self, match: TaskFilter, after_seq: int, limit: int) -> list[tuple[int, State, str]]:
        where, params = match_sql(match, after_seq, limit, _DIALECT)
        sql = self._sql(matching(where))
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
        sql = self._sql(LOCK_RETRYABLE)
        rows = [(r[0], State(r[1]), r[2], r[3]) for r in await conn.fetch(sql, seqs)]
        plan = decide_retry(rows, deps, now, run_at, extra_attempts)
        if plan.retried:
            await conn.execute(
                self._sql(retry_ended(self._rank_reset)),
                *[list(c) for c in zip(*plan.retried, strict=True)],
            )
        # Each step's events are recorded after its writes: they read the task as it left it.
        await self._record_events(conn, plan.changes, plan.prev, now)
        retried = frontier = [r[-1] for r in plan.retried]
        while frontier:
            recorded, restored, renamed = len(plan.changes), len(plan.restored), len(plan.renamed)
            sql = self._sql(ENDED_DEPENDENTS)
            found = [r[0] for r in await conn.fetch(sql, frontier)]
            deps = await self._dep_states(conn, found)
            sql = self._sql(LOCK_RESTORABLE)
            candidates = [(r[0], State(r[1]), r[2], r[3]) for r in await conn.fetch(sql, found)]
            frontier = decide_restore(plan, candidates, frontier, deps, self._full_id, restorable)
            if plan.restored[restored:]:
                await conn.execute(
                    self._sql(RESTORE_BLOCKED),
                    *[list(c) for c in zip(*plan.restored[restored:], strict=True)],
                )
            if plan.renamed[renamed:]:
                await conn.execute(
                    self._sql(SET_ERRORS),
                    *[list(c) for c in zip(*plan.renamed[renamed:], strict=True)],
                )
            await self._record_events(conn, plan.changes[recorded:], plan.prev[recorded:], now)
        await conn.execute(
            self._sql(WAIT_AGAIN),
            [seq for seq, _ in plan.changes],
        )
        if any(state == State.PENDING for _, state in plan.changes):
            await conn.execute(NOTIFY, self.channel)
        return await self._select(conn, BY_SEQS, retried), len(plan.restored), plan.changes

    async def _dep_states(self, conn: asyncpg.Connection, seqs: list[int]) -> dict[int, list[tuple[int, State]]]:
        """The dependencies still stored of each of these tasks, with their states (share-locked)."""
        sql = self._sql(DEPENDENCY_STATES)
        deps: dict[int, list[tuple[int, State]]] = {}
        for seq, dep, state in await conn.fetch(sql, seqs):
            deps.setdefault(seq, []).append((dep, State(state)))
        return deps

    async def delete_tasks(self, seqs: list[int]) -> list[int]:
        sql = self._sql(DELETE_TASKS)
        return [r[0] for r in await self._tx(lambda c: c.fetch(sql, seqs))]
