"""The SQLite store's outcomes: finished attempts, spawned tasks, dependents and expired leases."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import ApiError
from ..base import Changes, Held, Outcome, OutcomeKind, OutcomeResult, State, TaskRow
from ..logic import check_outcomes, decide_outcomes, dependency_error, expired_outcome, spawn_refused
from .core import _chunks
from .lease import Lease
from .sql.finish import (
    END_DEPENDENT,
    END_TASK,
    EXPIRED_LEASES,
    FINALIZERS_ONLY,
    INSERT_ATTEMPT,
    RELEASE_SPAWN,
    ROLLBACK_TO_SPAWN,
    SAVEPOINT_SPAWN,
    count_done,
    done_dependents,
    failing_dependents,
    outcome_rows,
    release,
    retry_later,
    snooze,
    unblock,
)
from .submit import Submit


class Finish(Lease, Submit):
    # -- outcomes -------------------------------------------------------------

    async def finish(self, worker_id: str, outcomes: list[Outcome], now: int) -> tuple[list[OutcomeResult], Changes]:
        return await self._tx(self._finish, worker_id, outcomes, now)

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
        # One transaction on the store's thread: chosen is not called.
        def both(db: sqlite3.Connection) -> tuple[list[OutcomeResult], Changes, list[TaskRow], int | None]:
            results, changes = self._finish(db, worker_id, outcomes, now) if outcomes else ([], [])
            lease = (worker_id, pools, limit, now, max_bytes, free, groups)
            rows, due = self._lease(db, *lease) if limit > 0 else ([], None)
            return results, changes, rows, due

        return await self._tx(both)

    def _finish(
        self, db: sqlite3.Connection, worker_id: str, outcomes: list[Outcome], now: int
    ) -> tuple[list[OutcomeResult], Changes]:
        current: dict[int, tuple[Any, ...]] = {}
        for chunk in _chunks([o.seq for o in outcomes]):
            for r in db.execute(outcome_rows(len(chunk)), chunk):
                current[r[0]] = r
        results, accepted = check_outcomes(worker_id, outcomes, current, self._full_id)
        accepted, spawned = self._spawn(db, accepted, now)
        changes = self._apply_outcomes(db, accepted, now)
        return results, changes + spawned

    def _spawn(
        self, db: sqlite3.Connection, accepted: list[tuple[Outcome, tuple[Any, ...]]], now: int
    ) -> tuple[list[tuple[Outcome, tuple[Any, ...]]], Changes]:
        """Creates the tasks the accepted successes spawn, before the successes are applied (a
        child that depends on its parent waits for it, and the success releases it). Each
        success's children are created in a savepoint: when they cannot be, the success becomes
        a failure (spawn_refused) and none of them exists."""
        out: list[tuple[Outcome, tuple[Any, ...]]] = []
        changes: Changes = []
        for outcome, current in accepted:
            if outcome.spawn and outcome.kind is OutcomeKind.SUCCESS and not current[5]:  # not cancel_requested
                for task in outcome.spawn:
                    task.parent_seq = outcome.seq
                db.execute(SAVEPOINT_SPAWN)
                try:
                    _, created = self._submit(db, outcome.spawn, now, None, outcome.spawn_visible)
                    changes += created
                except ApiError as err:
                    db.execute(ROLLBACK_TO_SPAWN)
                    outcome = spawn_refused(outcome, err)
                db.execute(RELEASE_SPAWN)
            out.append((outcome, current))
        return out, changes

    def _apply_outcomes(
        self, db: sqlite3.Connection, accepted: list[tuple[Outcome, tuple[Any, ...]]], now: int
    ) -> Changes:
        self._keep_reports(db, [o.report for o, _ in accepted if o.report is not None], now)
        d = decide_outcomes(accepted, now, self.settings.retry_at, self.settings.max_snoozes)
        db.executemany(INSERT_ATTEMPT, d.attempts)
        db.executemany(END_TASK, d.terminal)
        db.executemany(retry_later(self._rank_reset), d.retries)
        db.executemany(release(self._rank_keep), [(seq,) for seq in d.released])
        db.executemany(snooze(self._rank_reset), d.snoozed)
        changes = d.changes
        ended = len(changes)  # RUNNING before; the dependents after them were BLOCKED
        changes += self._unblock_dependents(db, d.succeeded, [])
        changes += self._end_dependents(db, d.failed, State.FAILED, now)
        changes += self._end_dependents(db, d.cancelled, State.CANCELLED, now)
        prev = [State.RUNNING] * ended + [State.BLOCKED] * (len(changes) - ended)
        self._record_events(db, changes, prev, now)
        return changes

    def _unblock_dependents(self, db: sqlite3.Connection, succeeded: list[int], ended: list[int]) -> Changes:
        """BLOCKED dependents count these tasks as done: those that succeeded, for every one,
        and those that ended otherwise, for finalizers (run_when 2); at 0 they are PENDING."""
        changes: Changes = []
        done = [(seq, "") for seq in succeeded] + [(seq, FINALIZERS_ONLY) for seq in ended]
        for kind in ("", FINALIZERS_ONLY):
            changes += self._count_done(db, [seq for seq, k in done if k == kind], kind)
        return changes

    def _count_done(self, db: sqlite3.Connection, done: list[int], only: str) -> Changes:
        changes: Changes = []
        for chunk in _chunks(done):
            dependents = [r[0] for r in db.execute(done_dependents(len(chunk), only), chunk)]
            if not dependents:
                continue
            db.executemany(count_done(len(chunk)), [(d, *chunk, d) for d in dependents])
            for part in _chunks(dependents):
                changes += [(r[0], State.PENDING) for r in db.execute(unblock(len(part), self._rank_reset), part)]
        return changes

    def _end_dependents(self, db: sqlite3.Connection, ended: list[int], state: State, now: int) -> Changes:
        """Fails (or cancels) BLOCKED dependents of ended tasks, transitively; finalizers among
        them count those as done instead. Those of EXPIRED tasks fail."""
        changes: Changes = []
        frontier = ended
        cause, state = state, State.FAILED if state == State.EXPIRED else state
        while frontier:
            changes += self._unblock_dependents(db, [], frontier)
            nxt: list[int] = []
            for chunk in _chunks(frontier):
                rows = db.execute(failing_dependents(len(chunk)), chunk).fetchall()
                db.executemany(
                    END_DEPENDENT,
                    [(int(state), dependency_error(cause, self._full_id(dep)), now, seq) for seq, dep in rows],
                )
                nxt += [seq for seq, _ in rows]
            changes += [(seq, state) for seq in nxt]
            frontier, cause = nxt, state
        return changes

    async def expire_leases(self, now: int) -> tuple[Changes, list[tuple[int, int]]]:
        return await self._tx(self._expire_leases, now)

    def _expire_leases(self, db: sqlite3.Connection, now: int) -> tuple[Changes, list[tuple[int, int]]]:
        expired = [expired_outcome(r) for r in db.execute(EXPIRED_LEASES, (now,))]
        if not expired:
            return [], []
        return self._apply_outcomes(db, expired, now), [(o.seq, o.attempt) for o, _ in expired]
