"""The PostgreSQL store's submissions (group commit)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import asyncpg

from ...errors import not_found
from ..base import KEY_RETURN_EXISTING, Changes, NewTask, State, Submitted, TaskRow
from ..fair import first_rank
from ..logic import (
    check_dependency_bytes,
    check_pending_limits,
    encode_request,
    initial_state,
    key_released,
    keyed_entry,
    keyed_run_at,
    limits_apply,
    new_task_row,
    replaced,
    replaces,
    replay_request,
    request_seqs,
    task_row,
    trace_text,
)
from .core import CONNECTION_ERRORS, _Core
from .sql import NOTIFY
from .sql.core import BY_SEQS
from .sql.submit import (
    ANALYZE_TASKS,
    INSERT_DEPS,
    INSERT_PLAINS,
    INSERT_TASKS,
    KEYED_ROWS,
    LOCK_DEPENDENCIES,
    NEXT_SEQS,
    RECORD_REQUEST,
    RELEASE_KEY,
    REPLACE,
    REQUEST_CREATED,
    UPDATE_REQUEST,
    WAITING_BY_POOL,
)

log = logging.getLogger("cronoq.store.postgres")


# Submissions committed together at most (group commit), and their tasks at most (one
# submission alone may exceed it).
MAX_GROUP = 64


MAX_GROUP_TASKS = 4096


# Retried in a fresh savepoint of the same group: a concurrent submission took a key (the retry
# deduplicates it), or this group's locks met another transaction's in a deadlock.
RETRYABLE = (asyncpg.exceptions.UniqueViolationError, asyncpg.exceptions.DeadlockDetectedError)


SubmitResult = tuple[list[Submitted], Changes]


# PostgreSQL's autovacuum visits a table at most once a minute (autovacuum_naptime): after a
# burst of submissions, leases would meanwhile be planned from the statistics of a far smaller
# table (reading every PENDING task of the pool and sorting them, 30 ms for 100,000, instead of
# an index range). The store analyzes its tasks itself once the submissions since it last did
# reach half the PENDING tasks it counted then, and at least ANALYZE_AFTER_ROWS; a table with no
# PENDING task, once ANALYZE_FIRST_ROWS were: without statistics, a keyed lease's step from one
# key to the next read every PENDING task of the pool (6 ms a lease for 500 tasks of 50 keys).
# PENDING tasks, not the table's rows: beside 1,000,000 ended tasks, 100,000 submissions never
# reached half the table, and the drain ran at a third of its rate on an empty store.
ANALYZE_GROWTH = 0.5


ANALYZE_AFTER_ROWS = 5000


ANALYZE_FIRST_ROWS = 100


@dataclass(slots=True)
class _SubmitOp:
    """One submit call waiting for its group's commit."""

    tasks: list[NewTask]
    now: int
    request_id: str | None
    visible: frozenset[str] | None
    plain: bool  # no keys, no dependencies, no limits: merged into the group's one INSERT
    # The call's answer; None: a plain call whose request_id was already recorded (the caller
    # reads the first call's tasks back once the group has committed).
    fut: asyncio.Future[SubmitResult | None]


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # its caller was cancelled
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class Submit(_Core):
    """Submissions, committed in groups."""

    async def submit(
        self, tasks: list[NewTask], now: int, request_id: str | None = None, visible: frozenset[str] | None = None
    ) -> tuple[list[Submitted], Changes]:
        may_block = any(t.dep_seqs or t.dep_keys or t.dep_batch for t in tasks)
        plain = (
            not limits_apply(self.settings)
            and not may_block
            and all(t.key is None and not t.run_when and t.parent_seq is None for t in tasks)
        )
        with self._may_block() if may_block else contextlib.nullcontext():
            fut: asyncio.Future[SubmitResult | None] = asyncio.get_running_loop().create_future()
            self._submits.append(_SubmitOp(tasks, now, request_id, visible, plain, fut))
            if self._committer is None or self._committer.done():
                self._committer = asyncio.create_task(self._commit_submits())
            result = await fut
        if result is not None:
            return result
        # A plain call repeating a recorded request_id: answer as the first time.
        sql = self._sql(REQUEST_CREATED)

        async def replay(conn: asyncpg.Connection) -> list[Submitted]:
            created = await conn.fetchval(sql, request_id)
            return await self._replay(conn, created) if created is not None else []

        return await self._read(replay), []

    # Group commit. A lone call is committed at once; calls made while a group commits wait
    # for it, then go together: one transaction, one WAL flush. Each call's answer is given only
    # after that commit. The plain calls of a group are one multi-row INSERT; every other call
    # runs in a savepoint of its own, so one that fails (a missing dependency, a limit, a key
    # of another pool) rolls back alone and gets its own error, and later calls of the group see
    # what earlier ones wrote (keys to deduplicate against, pending counts, request_ids). When
    # the transaction fails (connection lost, fenced, the commit itself), every call of the
    # group gets that error.

    async def _commit_submits(self) -> None:
        while self._submits:
            group = self._take_group()
            if group:
                await self._commit_group(group)

    def _take_group(self) -> list[_SubmitOp]:
        group: list[_SubmitOp] = []
        deferred: list[_SubmitOp] = []
        request_ids: set[str] = set()
        tasks = 0
        while self._submits and len(group) < MAX_GROUP:
            op = self._submits[0]
            if group and tasks + len(op.tasks) > MAX_GROUP_TASKS:
                break
            self._submits.popleft()
            if op.fut.done():  # its caller gave up before it started
                continue
            if op.request_id is not None:
                if op.request_id in request_ids:
                    # A repeat of a call of this group: it goes in the next one, and replays.
                    deferred.append(op)
                    continue
                request_ids.add(op.request_id)
            group.append(op)
            tasks += len(op.tasks)
        self._submits.extendleft(reversed(deferred))
        return group

    async def _commit_group(self, group: list[_SubmitOp]) -> None:
        plain = [op for op in group if op.plain]

        async def run(conn: asyncpg.Connection) -> list[tuple[_SubmitOp, bool, Any]]:
            done = await self._submit_plains(conn, plain) if plain else []
            for op in group:
                if not op.plain:
                    done.append(await self._submit_in_savepoint(conn, op))
            return done

        try:
            # Plain calls alone: their one statement is the transaction (one round trip).
            done = await (self._submit_plains(None, plain) if len(plain) == len(group) else self._tx(run))
        except Exception as err:
            for op in group:
                _settle(op.fut, False, err)
            return
        except BaseException:  # the committer itself is cancelled (the loop is closing)
            for op in group:
                op.fut.cancel()
            raise
        for op, ok, value in done:
            _settle(op.fut, ok, value)
        self._submitted(sum(len(op.tasks) for op, ok, _ in done if ok))

    def _submitted(self, n: int) -> None:
        """n more tasks were submitted: analyze the table in the background when they are many."""
        self._submitted_since += n
        least = ANALYZE_AFTER_ROWS if self._analyzed_rows else ANALYZE_FIRST_ROWS
        if self._submitted_since < max(least, self._analyzed_rows * ANALYZE_GROWTH):
            return
        if self._analyzer is not None and not self._analyzer.done():
            return
        self._analyzed_rows += self._submitted_since
        self._submitted_since = 0
        self._analyzer = asyncio.create_task(self._analyze())

    async def _analyze(self) -> None:
        try:
            await self._read(lambda c: c.execute(self._sql(ANALYZE_TASKS)))
        except Exception as err:  # not the table's owner, or the store is away: autovacuum will
            log.warning("could not analyze the tasks table: %s", err)

    async def _submit_in_savepoint(self, conn: asyncpg.Connection, op: _SubmitOp) -> tuple[_SubmitOp, bool, Any]:
        for attempt in range(3):
            try:
                async with conn.transaction():  # a savepoint
                    return op, True, await self._submit(conn, op.tasks, op.now, op.request_id, op.visible)
            except CONNECTION_ERRORS:
                raise  # the transaction is lost: the whole group fails
            except RETRYABLE as err:
                if attempt == 2:
                    return op, False, err
            except Exception as err:
                return op, False, err
        raise AssertionError("unreachable")

    async def _replay(self, conn: asyncpg.Connection, created: str) -> list[Submitted]:
        return replay_request(created, await self._select(conn, BY_SEQS, request_seqs(created)))

    async def _submit_plains(
        self, conn: asyncpg.Connection | None, ops: list[_SubmitOp]
    ) -> list[tuple[_SubmitOp, bool, Any]]:
        """Plain calls (tasks without keys, dependencies or limits): one multi-row INSERT for all,
        in conn's transaction (fenced there), or else in its own (fenced in the statement).

        Each call's request_id is recorded by the same statement; a call whose request_id is
        already recorded inserts nothing and is answered None (read back after the commit).
        Two calls of a group never share a request_id (_take_group defers the repeat).
        """
        tasks = [(i, op, t) for i, op in enumerate(ops, 1) for t in op.tasks]
        run_at = [keyed_run_at(t, op.now) for _, op, t in tasks]
        sql = self._sql(INSERT_PLAINS)
        args = (
            [t.pool for _, _, t in tasks],
            [t.payload for _, _, t in tasks],
            [t.content_type for _, _, t in tasks],
            [t.priority for _, _, t in tasks],
            run_at,
            [t.max_attempts for _, _, t in tasks],
            [json.dumps(t.resources) if t.resources else None for _, _, t in tasks],
            [op.now for _, op, _ in tasks],
            self.channel,
            len(tasks),
            [op.request_id for op in ops],
            [t.timeout_ms for _, _, t in tasks],
            [i for i, _, _ in tasks],
            [op.now for op in ops],
            [t.group_key for _, _, t in tasks],
            [
                first_rank(self._ranks, t.pool, t.group_key, True, at, op.now)
                for (_, op, t), at in zip(tasks, run_at, strict=True)
            ],
            [keyed_entry(t.resources) for _, _, t in tasks],
            [trace_text(t.trace) for _, _, t in tasks],
            [t.start_by for _, _, t in tasks],
        )
        if conn is None:
            rows = await self._fenced_fetch(sql, *args)
        else:
            rows = await conn.fetch(sql.replace("{fence}", "true"), *args)
        seqs = {r[0]: r[1] for r in rows}
        done: list[tuple[_SubmitOp, bool, Any]] = []
        n = 0
        for op in ops:
            first, n = n + 1, n + len(op.tasks)
            if first not in seqs:  # its request_id was recorded before: nothing inserted
                done.append((op, True, None))
                continue
            out = [
                Submitted(new_task_row(seqs[first + j], t, run_at[first + j - 1], op.now), False)
                for j, t in enumerate(op.tasks)
            ]
            done.append((op, True, (out, [(s.row.seq, State.PENDING) for s in out])))
        return done

    async def _submit(
        self,
        conn: asyncpg.Connection,
        tasks: list[NewTask],
        now: int,
        request_id: str | None,
        visible: frozenset[str] | None,
    ) -> tuple[list[Submitted], Changes]:
        if request_id is not None:
            # Recorded first: a concurrent call with the same request_id waits here for this one.
            sql = self._sql(RECORD_REQUEST)
            if await conn.fetchval(sql, request_id, now) is None:
                created = await conn.fetchval(self._sql(REQUEST_CREATED), request_id)
                return await self._replay(conn, created), []
        by_key = await self._keyed(conn, tasks, now)
        dep_seqs = list({s for t in tasks for s in t.dep_seqs})
        dep_state: dict[int, State] = {}
        dep_bytes: dict[int, int] = {}  # of each dependency, its result's
        if dep_seqs:
            sql = self._sql(LOCK_DEPENDENCIES)
            for r in await conn.fetch(sql, dep_seqs):
                if visible is None or r[2] in visible:
                    dep_state[r[0]], dep_bytes[r[0]] = State(r[1]), r[3]
        fresh = sum(1 for t in tasks if t.key is None or t.key not in by_key or key_released(by_key[t.key], now))
        seq_sql = self._sql(NEXT_SEQS)
        new_seqs = iter([r[0] for r in await conn.fetch(seq_sql, fresh)] if fresh else [])
        out: list[Submitted] = []
        changes: Changes = []
        inserts: list[tuple[Any, ...]] = []
        dep_rows: list[tuple[int, int]] = []
        replacements: dict[int, TaskRow] = {}  # by seq, as the last submission of this call left it
        for task in tasks:
            if task.key is not None and task.key in by_key:
                existing = by_key[task.key]
                if key_released(existing, now):  # then created as if the key were free
                    await conn.execute(self._sql(RELEASE_KEY), existing.seq)
                elif replaces(task, existing):
                    row = replacements[existing.seq] = by_key[task.key] = replaced(existing, task, now)
                    out.append(Submitted(row, False, replaced=True))
                    changes.append((row.seq, row.state))
                    continue
                else:
                    out.append(Submitted(existing, True))
                    continue
            deps: dict[int, State] = {}
            for seq in task.dep_seqs:
                if seq not in dep_state:
                    raise not_found(f"depends_on: task {self._full_id(seq)} not found")
                deps[seq] = dep_state[seq]
            for key in task.dep_keys:
                if key not in by_key or (visible is not None and by_key[key].pool not in visible):
                    raise not_found(f"depends_on: no task with key {key!r}")
                named = by_key[key]
                deps[named.seq] = named.state
                dep_bytes[named.seq] = len(named.result or b"")
            for index in task.dep_batch:
                deps[out[index].row.seq] = out[index].row.state
            check_dependency_bytes(
                repr(task.key) if task.key else "the task",
                [(seq, dep_bytes.get(seq, 0)) for seq in deps],
                self.settings.max_dependency_results_bytes,
                self._full_id,
            )
            state, error, blocked_on = initial_state(deps.items(), self._full_id, task.run_when)
            seq = next(new_seqs)
            dep_list = list(deps)
            row = new_task_row(seq, task, keyed_run_at(task, now), now, state, dep_list, error)
            inserts.append((
                seq, row.pool, row.key, row.payload, row.content_type, row.priority, row.run_at, row.max_attempts,
                json.dumps(dep_list) if dep_list else None, json.dumps(row.resources) if row.resources else None,
                int(state), error, now, row.finished_at, blocked_on, task.timeout_ms, task.group_key,
                first_rank(self._ranks, row.pool, row.group_key, state == State.PENDING, row.run_at, now),
                keyed_entry(row.resources), trace_text(task.trace), task.parent_seq, task.run_when, task.start_by,
                task.key_ttl_ms,
            ))  # fmt: skip
            dep_rows += [(seq, d) for d in dep_list]
            dep_state[seq] = state  # later tasks of this call may name it by id or key
            if row.key is not None:
                by_key[row.key] = row
            out.append(Submitted(row, False))
            changes.append((seq, state))
        if inserts:
            columns = list(zip(*inserts, strict=True))
            await conn.execute(
                self._sql(INSERT_TASKS),
                *[list(c) for c in columns],
                now,
            )
        if dep_rows:
            await conn.execute(
                self._sql(INSERT_DEPS),
                [a for a, _ in dep_rows],
                [b for _, b in dep_rows],
            )
        if replacements:  # after the inserts: a task of this call may be among them
            kept = list(replacements.values())
            await conn.execute(
                self._sql(REPLACE),
                [r.seq for r in kept],
                [r.payload for r in kept],
                [r.content_type for r in kept],
                [r.priority for r in kept],
                [r.run_at for r in kept],
                now,
            )
        if inserts:
            await self._check_limits(conn, [s.row.pool for s in out if not (s.deduplicated or s.replaced)])
        if any(state == State.PENDING for _, state in changes):  # a replaced task may be due sooner
            await conn.execute(NOTIFY, self.channel)
        if request_id is not None:
            sql = self._sql(UPDATE_REQUEST)
            await conn.execute(sql, request_id, encode_request(out))
        return out, changes

    async def _keyed(self, conn: asyncpg.Connection, tasks: list[NewTask], now: int) -> dict[str, TaskRow]:
        """The tasks named by these tasks' keys and their dependencies' keys, by key.

        Dependencies are read under a share lock: a dependency cannot end between this read and
        this commit, so its ending always sees the dependents created here. A task this call may
        change (replace, or take the key of) is locked for update: a lease skips it until this
        commits (never taking it half replaced), and a lease that took it first commits before
        this reads it (RUNNING: returned as it is)."""
        own = {t.key for t in tasks if t.key is not None}
        keys = own | {k for t in tasks for k in t.dep_keys}
        if not keys:
            return {}
        replacing = [t.key for t in tasks if t.key is not None and t.key_mode != KEY_RETURN_EXISTING]
        rows = await conn.fetch(self._sql(KEYED_ROWS), list(keys), list(own), replacing, now)
        return {r.key: r for r in map(task_row, rows) if r.key}

    async def _check_limits(self, conn: asyncpg.Connection, created: list[str]) -> None:
        if created and limits_apply(self.settings):
            sql = self._sql(WAITING_BY_POOL)
            check_pending_limits(self.settings, {r[0]: r[1] for r in await conn.fetch(sql)}, created)
