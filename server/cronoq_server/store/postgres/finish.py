"""The PostgreSQL store's finish reports, spawned tasks and expired leases."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import asyncpg

from ...errors import ApiError
from ..base import Changes, Held, Outcome, OutcomeKind, OutcomeResult, State, TaskRow
from ..logic import (
    check_outcomes,
    decide_outcomes,
    dependency_error,
    expired_outcome,
    not_leased,
    spawn_refused,
    task_row,
)
from .lease import Lease, _carried
from .sql import NOTIFY
from .sql.finish import (
    ANY_BLOCKED,
    END_DEPENDENTS,
    END_TASKS,
    ENDING_DEPENDENTS,
    EXPIRED_LEASES,
    FINISH_SUCCESSES,
    INSERT_ATTEMPT_ROWS,
    LOCK_OUTCOME_ROWS,
    UNBLOCK_DEPENDENTS,
    finish_with,
    release_attempts,
    release_unblocked,
    retry_later,
    snooze,
)
from .submit import Submit


class Finish(Lease, Submit):
    """The ends of attempts, what they release or end, and expired leases."""

    def _fast_finish(self, outcomes: list[Outcome]) -> bool:
        """Whether these outcomes take the one-statement path: successes of distinct tasks while
        no task is BLOCKED."""
        seqs = {o.seq for o in outcomes}
        return (
            self._nothing_blocked()
            and all(o.kind is OutcomeKind.SUCCESS and o.report is None and not o.spawn for o in outcomes)
            and len(seqs) == len(outcomes)
        )

    async def finish(self, worker_id: str, outcomes: list[Outcome], now: int) -> tuple[list[OutcomeResult], Changes]:
        if self._fast_finish(outcomes):
            generation = self._blocked_generation
            sql = self._sql(FINISH_SUCCESSES)
            rows = await self._fenced_fetch(sql, *_success_args(outcomes), now, worker_id, planned_once=True)
            return await self._successes(worker_id, outcomes, {r[0]: State(r[1]) for r in rows}, generation, now)

        async def finish(conn: asyncpg.Connection) -> tuple[list[OutcomeResult], Changes]:
            sql = self._sql(LOCK_OUTCOME_ROWS)
            current = {r[0]: tuple(r) for r in await conn.fetch(sql, [o.seq for o in outcomes])}
            results, accepted = check_outcomes(worker_id, outcomes, current, self._full_id)
            accepted, spawned = await self._spawn(conn, accepted, now)
            return results, await self._apply_outcomes(conn, accepted, now) + spawned

        if not any(o.spawn for o in outcomes):
            return await self._tx(finish)
        with self._may_block():  # spawned tasks may wait for each other
            return await self._tx(finish)

    async def _spawn(
        self, conn: asyncpg.Connection, accepted: list[tuple[Outcome, Any]], now: int
    ) -> tuple[list[tuple[Outcome, Any]], Changes]:
        """Creates the tasks the accepted successes spawn, before the successes are applied (a
        child that depends on its parent waits for it, and the success releases it). Each
        success's children are created in a savepoint: when they cannot be, the success becomes
        a failure (spawn_refused) and none of them exists."""
        out: list[tuple[Outcome, Any]] = []
        changes: Changes = []
        for outcome, current in accepted:
            if outcome.spawn and outcome.kind is OutcomeKind.SUCCESS and not current[5]:  # not cancel_requested
                for task in outcome.spawn:
                    task.parent_seq = outcome.seq
                try:
                    async with conn.transaction():  # a savepoint
                        _, created = await self._submit(conn, outcome.spawn, now, None, outcome.spawn_visible)
                    changes += created
                except ApiError as err:
                    outcome = spawn_refused(outcome, err)
            out.append((outcome, current))
        return out, changes

    async def finish_and_lease(
        self,
        worker_id: str,
        outcomes: list[Outcome],
        pools: list[str],
        limit: int,
        now: int,
        max_bytes: int = 0,
        free: Mapping[str, int] | None = None,
        groups: Mapping[str, tuple[int, Mapping[str, int]]] | None = None,
        chosen: Callable[[list[Held]], None] | None = None,
    ) -> tuple[list[OutcomeResult], Changes, list[TaskRow], int | None]:
        """finish, then lease: one statement (one round trip, one commit) when the outcomes take
        the fast path and the lease is of plain pools without resources, or only of pools that
        cap their groups (then after one read, and chosen is told: see _fair_take); else one
        call after the other."""
        fair = [p for p in pools if p in self.settings.group_pools]
        together = outcomes and limit > 0 and self._fast_finish(outcomes)
        generation = self._blocked_generation  # read with the fast path's check, before any await
        if together and not fair and not free:
            ctes, args = self._lease_ctes(worker_id, pools, limit, now, max_bytes, None)
            return await self._finish_with(ctes, args, "$3", worker_id, outcomes, generation, now, pools)
        if together and len(fair) == len(pools):
            take = await self._fair_take(worker_id, fair, limit, now, max_bytes, free, groups)
            if take is not None:
                finish = (worker_id, outcomes, generation, now, pools, fair)
                try:
                    if chosen is not None:
                        chosen(take.held)
                    finished = await self._finish_with(take.ctes, take.args, "$2", *finish)
                finally:
                    self._taking -= take.seqs
                results, changes, rows, due = finished
                return results, changes, take.served(rows), due
            results, changes = await self.finish(worker_id, outcomes, now)
            return results, changes, *await self._leased([], pools, now, fair)
        results, changes = await self.finish(worker_id, outcomes, now) if outcomes else ([], [])
        rows, due = await self.lease(worker_id, pools, limit, now, max_bytes, free, groups) if limit > 0 else ([], None)
        return results, changes, rows, due

    async def _finish_with(
        self,
        ctes: str,
        args: tuple[Any, ...],
        worker: str,
        worker_id: str,
        outcomes: list[Outcome],
        generation: int,
        now: int,
        pools: list[str],
        fair: Sequence[str] = (),
    ) -> tuple[list[OutcomeResult], Changes, list[TaskRow], int | None]:
        """These successes (of the fast path, checked at generation) ended in the statement of a
        lease's CTEs (now at $1, the worker id at the parameter named): one round trip, one commit."""
        sql = self._sql(finish_with(ctes, len(args) + 1, worker))
        fetched = await self._fenced_fetch(sql, *args, *_success_args(outcomes), planned_once=not fair)
        seqs, states = _carried(fetched)
        ended = dict(zip(seqs, map(State, states), strict=True))
        results, changes = await self._successes(worker_id, outcomes, ended, generation, now)
        rows, due = await self._leased([task_row(r) for r in fetched if r[0] is not None], pools, now, fair)
        return results, changes, rows, due

    async def _successes(
        self, worker_id: str, outcomes: list[Outcome], ended: dict[int, State], generation: int, now: int
    ) -> tuple[list[OutcomeResult], Changes]:
        """The results of successes that took the fast path (ended: the tasks they ended)."""
        results = [
            OutcomeResult(o.seq, True) if o.seq in ended else not_leased(worker_id, self._full_id(o.seq), o.attempt)
            for o in outcomes
        ]
        changes: Changes = list(ended.items())
        if generation != self._blocked_generation and changes:
            # A submission naming these tasks as dependencies ran meanwhile: it may have
            # created dependents the statement could not see. Release them now.
            changes += await self._tx(lambda c: self._release_unblocked(c, [seq for seq, _ in changes], now))
        return results, changes

    async def _release_unblocked(self, conn: asyncpg.Connection, succeeded: list[int], now: int) -> Changes:
        """BLOCKED dependents of these tasks whose every dependency has succeeded become PENDING.

        Reads the states themselves (not the blocked_on counts), so running it again is harmless.
        """
        rows = await conn.fetch(
            self._sql(release_unblocked(self._rank_reset)),
            succeeded,
            now,
        )
        if rows:
            await conn.execute(NOTIFY, self.channel)
        return [(r[0], State.PENDING) for r in rows]

    async def _apply_outcomes(self, conn: asyncpg.Connection, accepted: list[tuple[Outcome, Any]], now: int) -> Changes:
        await self._keep_reports(conn, [o.report for o, _ in accepted if o.report is not None], now)
        d = decide_outcomes(accepted, now, self.settings.retry_at, self.settings.max_snoozes)
        if d.attempts:
            await conn.execute(
                self._sql(INSERT_ATTEMPT_ROWS),
                *[list(c) for c in zip(*d.attempts, strict=True)],
            )
        if d.terminal:
            cols = list(zip(*d.terminal, strict=True))
            await conn.execute(
                self._sql(END_TASKS),
                *[list(c) for c in cols],
            )
        if d.retries:
            cols = list(zip(*d.retries, strict=True))
            await conn.execute(
                self._sql(retry_later(self._rank_reset)),
                *[list(c) for c in cols],
            )
        if d.released:
            await conn.execute(
                self._sql(release_attempts(self._rank_keep)),
                d.released,
            )
        if d.snoozed:
            await conn.execute(
                self._sql(snooze(self._rank_reset)),
                *[list(c) for c in zip(*d.snoozed, strict=True)],
            )
        changes = d.changes
        ended = len(changes)  # RUNNING before; the dependents after them were BLOCKED
        changes += await self._unblock_dependents(conn, d.succeeded)
        changes += await self._end_dependents(conn, d.failed, State.FAILED, now)
        changes += await self._end_dependents(conn, d.cancelled, State.CANCELLED, now)
        prev = [State.RUNNING] * ended + [State.BLOCKED] * (len(changes) - ended)
        await self._record_events(conn, changes, prev, now)
        if any(state == State.PENDING for _, state in changes):
            await conn.execute(NOTIFY, self.channel)
        return changes

    async def _unblock_dependents(
        self, conn: asyncpg.Connection, succeeded: list[int], ended: Sequence[int] = ()
    ) -> Changes:
        """BLOCKED dependents count these tasks as done: those that succeeded, for every one,
        and those that ended otherwise, for finalizers (run_when 2); at 0 they are PENDING."""
        if not (succeeded or ended) or self._nothing_blocked():
            return []  # no task waits for anything: nothing to unblock
        rows = await conn.fetch(
            self._sql(UNBLOCK_DEPENDENTS),
            succeeded,
            list(ended),
        )
        return [(r[0], State.PENDING) for r in rows if r[1] == State.PENDING]

    async def _end_dependents(self, conn: asyncpg.Connection, ended: list[int], state: State, now: int) -> Changes:
        """Fails (or cancels) BLOCKED dependents of ended tasks, transitively; finalizers among
        them count those as done instead. Those of EXPIRED tasks fail."""
        cause, state = state, State.FAILED if state == State.EXPIRED else state
        changes: Changes = []
        frontier = ended
        while frontier:
            changes += await self._unblock_dependents(conn, [], frontier)
            rows = await conn.fetch(
                self._sql(ENDING_DEPENDENTS),
                frontier,
            )
            if not rows:
                break
            await conn.execute(
                self._sql(END_DEPENDENTS),
                int(state),
                now,
                [r[0] for r in rows],
                [dependency_error(cause, self._full_id(r[1])) for r in rows],
            )
            frontier, cause = [r[0] for r in rows], state
            changes += [(seq, state) for seq in frontier]
        return changes

    async def _check_blocked(self, conn: asyncpg.Connection) -> None:
        generation = self._blocked_generation
        if self._blocking_submits:
            return  # a BLOCKED task may be about to commit: this query could miss it
        blocked = await conn.fetchval(self._sql(ANY_BLOCKED))
        if not blocked:
            self._no_blocked_since = generation

    async def expire_leases(self, now: int) -> tuple[Changes, list[tuple[int, int]]]:
        async def expire(conn: asyncpg.Connection) -> tuple[Changes, list[tuple[int, int]]]:
            sql = self._sql(EXPIRED_LEASES)
            expired = [expired_outcome(tuple(r)) for r in await conn.fetch(sql, now)]
            changes = await self._apply_outcomes(conn, expired, now) if expired else []
            await self._check_blocked(conn)
            return changes, [(o.seq, o.attempt) for o, _ in expired]

        return await self._tx(expire)


def _success_args(outcomes: list[Outcome]) -> tuple[list[Any], ...]:
    """The arrays of finish_sql.success_ctes, in order."""
    return (
        [o.seq for o in outcomes],
        [o.attempt for o in outcomes],
        [o.result or None for o in outcomes],
        [o.result_content_type for o in outcomes],
    )
