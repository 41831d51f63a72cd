"""The SQLite store's actions on many tasks: cancel, match, retry and delete."""

from __future__ import annotations

import sqlite3

from ..base import NOT_STARTED, Changes, State, TaskFilter, TaskRow
from ..logic import WorkflowTree, decide_restore, decide_retry, descendants_changed, match_sql
from .core import MAX_VARS, _chunks
from .finish import Finish
from .sql import BY_SEQ, DIALECT, delete_attempts, delete_deps
from .sql.bulk import (
    CANCEL_UNSTARTED,
    EXPIRE,
    EXPIRED_NOW,
    REQUEST_CANCEL,
    RESTORE,
    SET_ERROR,
    cancellable,
    delete_ended,
    dep_states,
    matching,
    restorable_dependents,
    retry,
    retryable,
    wait_again,
    workflow_below,
)


class Bulk(Finish):
    async def cancel_workflow(
        self, seq: int, now: int, cancellable: frozenset[str] | None
    ) -> tuple[TaskRow | None, int, Changes]:
        def cancel(db: sqlite3.Connection) -> tuple[TaskRow | None, int, Changes]:
            def below(seqs: list[int]) -> list[tuple[int, str]]:
                found: list[tuple[int, str]] = []
                for chunk in _chunks(seqs, MAX_VARS // 2):
                    found += db.execute(workflow_below(len(chunk)), [*chunk, *chunk]).fetchall()
                return found

            tree = WorkflowTree(seq, cancellable)
            while tree.frontier:
                tree.add(below(tree.frontier))
            _, changes = self._cancel_tasks(db, [seq, *tree.found], now)
            rows = self._select(db, BY_SEQ, (seq,))
            return (rows[0] if rows else None), descendants_changed(seq, changes), changes

        return await self._tx(cancel)

    async def cancel(self, seq: int, now: int) -> tuple[TaskRow | None, Changes]:
        def cancel(db: sqlite3.Connection) -> tuple[TaskRow | None, Changes]:
            _, changes = self._cancel_tasks(db, [seq], now)
            rows = self._select(db, BY_SEQ, (seq,))
            return (rows[0] if rows else None), changes

        return await self._tx(cancel)

    async def cancel_tasks(self, seqs: list[int], now: int) -> tuple[list[int], Changes]:
        return await self._tx(self._cancel_tasks, seqs, now)

    def _cancel_tasks(self, db: sqlite3.Connection, seqs: list[int], now: int) -> tuple[list[int], Changes]:
        ended: list[tuple[int, State]] = []  # (seq, state it leaves)
        requested: list[int] = []
        for chunk in _chunks(sorted(set(seqs))):
            for seq, state in db.execute(cancellable(len(chunk)), chunk):
                if state == State.RUNNING:
                    requested.append(seq)
                else:
                    ended.append((seq, State(state)))
        db.executemany(CANCEL_UNSTARTED, [(now, seq) for seq, _ in ended])
        db.executemany(REQUEST_CANCEL, [(seq,) for seq in requested])
        changes: Changes = [(seq, State.CANCELLED) for seq, _ in ended] + [(seq, State.RUNNING) for seq in requested]
        prev = [state for _, state in ended] + [State.RUNNING] * len(requested)
        dependents = self._end_dependents(db, [seq for seq, _ in ended], State.CANCELLED, now)
        changes += dependents
        prev += [State.BLOCKED] * len(dependents)
        self._record_events(db, changes, prev, now)
        return sorted([seq for seq, _ in ended] + requested), changes

    async def expire_unstarted(self, now: int, limit: int) -> Changes:
        def expire(db: sqlite3.Connection) -> Changes:
            found = db.execute(EXPIRED_NOW, (now, limit)).fetchall()
            db.executemany(EXPIRE, [(NOT_STARTED, now, seq) for seq, _ in found])
            changes: Changes = [(seq, State.EXPIRED) for seq, _ in found]
            prev = [state for _, state in found]
            dependents = self._end_dependents(db, [seq for seq, _ in found], State.EXPIRED, now)
            self._record_events(db, changes + dependents, prev + [State.BLOCKED] * len(dependents), now)
            return changes + dependents

        return await self._tx(expire)

    async def match_tasks(self, match: TaskFilter, after_seq: int, limit: int) -> list[tuple[int, State, str]]:
        where, params = match_sql(match, after_seq, limit, DIALECT)
        sql = matching(where)
        rows = await self._scan(lambda db: db.execute(sql, params).fetchall())
        return [(seq, State(state), pool) for seq, state, pool in rows]

    # -- an operator's actions on ended tasks ----------------------------------

    async def retry_tasks(
        self,
        seqs: list[int],
        now: int,
        run_at: int | None,
        extra_attempts: int,
        restorable: frozenset[str] | None = None,
    ) -> tuple[list[TaskRow], int, Changes]:
        return await self._tx(self._retry_tasks, seqs, now, run_at, extra_attempts, restorable)

    def _retry_tasks(
        self,
        db: sqlite3.Connection,
        seqs: list[int],
        now: int,
        run_at: int | None,
        extra_attempts: int,
        restorable: frozenset[str] | None,
    ) -> tuple[list[TaskRow], int, Changes]:
        rows: list[tuple[int, State, int, int]] = []
        for chunk in _chunks(seqs):
            rows += [(r[0], State(r[1]), r[2], r[3]) for r in db.execute(retryable(len(chunk)), chunk)]
        plan = decide_retry(rows, self._dep_states(db, [r[0] for r in rows]), now, run_at, extra_attempts)
        db.executemany(retry(self._rank_reset), plan.retried)
        # Each step's events are recorded after its writes: they read the task as it left it.
        self._record_events(db, plan.changes, plan.prev, now)
        retried = frontier = [r[-1] for r in plan.retried]
        while frontier:
            recorded, restored, renamed = len(plan.changes), len(plan.restored), len(plan.renamed)
            candidates: dict[int, tuple[int, State, str, str]] = {}
            for chunk in _chunks(frontier):
                found = db.execute(restorable_dependents(len(chunk)), chunk)
                candidates |= {r[0]: (r[0], State(r[1]), r[2], r[3]) for r in found}
            deps = self._dep_states(db, list(candidates))
            frontier = decide_restore(plan, candidates.values(), frontier, deps, self._full_id, restorable)
            db.executemany(RESTORE, plan.restored[restored:])
            db.executemany(SET_ERROR, plan.renamed[renamed:])
            self._record_events(db, plan.changes[recorded:], plan.prev[recorded:], now)
        # A finalizer still waiting counted these as ended: it waits for them again.
        again = [seq for seq, _ in plan.changes]
        for chunk in _chunks(again):
            db.execute(wait_again(len(chunk)), [*chunk, *chunk])
        return self._select_seqs(db, retried), len(plan.restored), plan.changes

    def _dep_states(self, db: sqlite3.Connection, seqs: list[int]) -> dict[int, list[tuple[int, State]]]:
        """The dependencies still stored of each of these tasks, with their states."""
        deps: dict[int, list[tuple[int, State]]] = {}
        for chunk in _chunks(seqs):
            for seq, dep, state in db.execute(dep_states(len(chunk)), chunk):
                deps.setdefault(seq, []).append((dep, State(state)))
        return deps

    async def delete_tasks(self, seqs: list[int]) -> list[int]:
        return await self._tx(self._delete_tasks, seqs)

    def _delete_tasks(self, db: sqlite3.Connection, seqs: list[int]) -> list[int]:
        deleted: list[int] = []
        for chunk in _chunks(seqs):
            deleted += [r[0] for r in db.execute(delete_ended(len(chunk)), chunk)]
        for chunk in _chunks(deleted):
            db.execute(delete_deps(len(chunk)), chunk)
            db.execute(delete_attempts(len(chunk)), chunk)
        return sorted(deleted)
