"""The SQLite store's submit path: new tasks, their dependencies and the pending limits."""

from __future__ import annotations

import json
import sqlite3

from ...errors import not_found
from ..base import TERMINAL, Changes, NewTask, State, Submitted
from ..fair import first_rank
from ..logic import (
    check_dependency_bytes,
    check_pending_limits,
    encode_request,
    initial_state,
    key_of_another_pool,
    key_released,
    keyed_entry,
    keyed_run_at,
    limits_apply,
    new_task_row,
    replaced,
    replaces,
    replay_request,
    request_seqs,
    trace_text,
)
from .events import Events
from .reads import Reads
from .sql import BY_KEY
from .sql.submit import (
    COUNT_PENDING_BY_POOL,
    DEP_BY_KEY,
    INSERT_DEP,
    INSERT_REQUEST,
    INSERT_TASK,
    RELEASE_KEY,
    REPLACE,
    REQUEST,
    deps_by_seq,
)


class Submit(Reads, Events):
    # -- submit ---------------------------------------------------------------

    async def submit(
        self, tasks: list[NewTask], now: int, request_id: str | None = None, visible: frozenset[str] | None = None
    ) -> tuple[list[Submitted], Changes]:
        return await self._tx(self._submit, tasks, now, request_id, visible)

    def _submit(
        self,
        db: sqlite3.Connection,
        tasks: list[NewTask],
        now: int,
        request_id: str | None,
        visible: frozenset[str] | None,
    ) -> tuple[list[Submitted], Changes]:
        if request_id is not None:
            known = db.execute(REQUEST, (request_id,)).fetchone()
            if known is not None:
                return replay_request(known[0], self._select_seqs(db, request_seqs(known[0]))), []
        out: list[Submitted] = []
        changes: Changes = []
        prev: list[int] = []  # of each change, the state it left (0: a new task)
        for task in tasks:
            if task.key is not None:
                existing = self._select(db, BY_KEY, (task.key,))
                if existing and key_released(existing[0], now):
                    db.execute(RELEASE_KEY, (existing[0].seq,))
                elif existing and replaces(task, existing[0]):
                    row = replaced(existing[0], task, now)
                    db.execute(REPLACE, (row.payload, row.content_type, row.priority, row.run_at, row.seq))
                    out.append(Submitted(row, False, replaced=True))
                    changes.append((row.seq, row.state))
                    prev.append(int(row.state))
                    continue
                elif existing:
                    key_of_another_pool(task.key, task.pool, existing[0].pool)
                    out.append(Submitted(existing[0], True))
                    continue
            deps: list[tuple[int, State]] = []
            if task.dep_seqs or task.dep_keys or task.dep_batch:
                deps, dep_bytes = self._resolve_deps(db, task, out, visible)
                check_dependency_bytes(
                    repr(task.key) if task.key else "the task",
                    dep_bytes,
                    self.settings.max_dependency_results_bytes,
                    self._full_id,
                )
            state, error, blocked_on = initial_state(deps, self._full_id, task.run_when)
            finished_at = now if state in TERMINAL else None
            run_at = keyed_run_at(task, now)
            dep_list = [s for s, _ in deps]
            cur = db.execute(
                INSERT_TASK,
                (
                    task.pool,
                    task.key,
                    task.payload,
                    task.content_type,
                    task.priority,
                    run_at,
                    task.max_attempts,
                    json.dumps(dep_list) if dep_list else None,
                    json.dumps(task.resources) if task.resources else None,
                    int(state),
                    error,
                    now,
                    finished_at,
                    blocked_on,
                    task.timeout_ms,
                    task.group_key,
                    first_rank(self._ranks, task.pool, task.group_key, state == State.PENDING, run_at, now),
                    keyed_entry(task.resources),
                    trace_text(task.trace),
                    task.parent_seq,
                    task.run_when,
                    task.start_by,
                    task.key_ttl_ms,
                ),
            )
            seq = cur.lastrowid
            assert seq is not None
            if dep_list:
                db.executemany(INSERT_DEP, [(seq, d) for d in dep_list])
            out.append(Submitted(new_task_row(seq, task, run_at, now, state, dep_list, error), False))
            changes.append((seq, state))
            prev.append(0)
        self._check_limits(db, tasks, out)
        self._record_events(db, changes, prev, now)
        if request_id is not None:
            db.execute(INSERT_REQUEST, (request_id, encode_request(out), now))
        return out, changes

    def _resolve_deps(
        self, db: sqlite3.Connection, task: NewTask, earlier: list[Submitted], visible: frozenset[str] | None
    ) -> tuple[list[tuple[int, State]], list[tuple[int, int]]]:
        """The task's dependencies' (seq, state), and (seq, result bytes)."""
        found: dict[int, State] = {}
        sizes: dict[int, int] = {}
        if task.dep_seqs:
            rows = {r[0]: r for r in db.execute(deps_by_seq(len(task.dep_seqs)), task.dep_seqs)}
            for seq in task.dep_seqs:
                if seq not in rows or (visible is not None and rows[seq][2] not in visible):
                    raise not_found(f"depends_on: task {self._full_id(seq)} not found")
                found[seq], sizes[seq] = State(rows[seq][1]), rows[seq][3]
        for key in task.dep_keys:
            row = db.execute(DEP_BY_KEY, (key,)).fetchone()
            if row is None or (visible is not None and row[2] not in visible):
                raise not_found(f"depends_on: no task with key {key!r}")
            found[row[0]], sizes[row[0]] = State(row[1]), row[3]
        for index in task.dep_batch:
            dep = earlier[index].row
            found[dep.seq] = dep.state
        return list(found.items()), list(sizes.items())

    def _check_limits(self, db: sqlite3.Connection, tasks: list[NewTask], out: list[Submitted]) -> None:
        created = [r.row.pool for r in out if not (r.deduplicated or r.replaced)]
        if created and limits_apply(self.settings):
            counts = dict(db.execute(COUNT_PENDING_BY_POOL))
            check_pending_limits(self.settings, counts, created)
