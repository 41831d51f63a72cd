"""SQLite store: WAL mode, one connection on one dedicated thread.

Each Store method runs as one function on that thread inside one transaction, so
a batch costs one thread hop rather than one per statement (aiosqlite's model).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ..backup import settle_restored
from ..errors import ApiError, not_found
from ..ids import make_task_id
from .base import (
    ATTEMPT_COLUMNS,
    COUNTED_COLUMNS,
    EVENT_COLUMNS,
    EVENT_TASK_COLUMNS,
    TASK_COLUMNS,
    TERMINAL,
    AttemptRow,
    Changes,
    DependencyRow,
    EventColumns,
    EventRow,
    Held,
    NewTask,
    Outcome,
    OutcomeKind,
    OutcomeResult,
    PoolPause,
    Report,
    ScanTimedOut,
    ScheduleRow,
    State,
    StoreOwnedElsewhere,
    StoreSettings,
    Submitted,
    TaskFilter,
    TaskRow,
    WorkerRow,
    schema_too_new,
)
from .fair import (
    RANK_BATCH,
    Candidate,
    GroupRanks,
    choose,
    fair_window,
    first_rank,
    free_for,
    left_after,
    rank_keep,
    rank_reset,
    row_bytes,
    turn_share,
)
from .logic import (
    HEARTBEAT_COLUMNS,
    KEY_SCAN,
    OUTCOME_COLUMNS,
    POOL_PAUSE_COLUMNS,
    POOL_PAUSE_UPSERT,
    SCHEDULE_COLUMNS,
    SCHEDULE_UPSERT,
    Dialect,
    WorkflowTree,
    attempt_row,
    check_dependency_bytes,
    check_outcomes,
    check_pending_limits,
    current_reports,
    decide_heartbeat,
    decide_outcomes,
    decide_restore,
    decide_retry,
    dependency_error,
    descendants_changed,
    encode_request,
    event_row,
    event_task_values,
    expired_outcome,
    has_keyed,
    initial_state,
    key_in_another_pool,
    key_of_another_pool,
    keyed_entry,
    lease_scan,
    limits_apply,
    list_filter,
    match_sql,
    pool_pause,
    pool_pause_values,
    replay_request,
    report_columns,
    request_retention,
    request_seqs,
    scans_far,
    schedule_row,
    schedule_values,
    spawn_refused,
    task_row,
    trace_text,
)

T = TypeVar("T")

MIGRATIONS: dict[int, str] = {
    1: """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE tasks (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        pool TEXT NOT NULL,
        key TEXT UNIQUE,
        payload BLOB NOT NULL,
        content_type TEXT NOT NULL DEFAULT '',
        priority INTEGER NOT NULL DEFAULT 0,
        run_at INTEGER NOT NULL,
        max_attempts INTEGER NOT NULL,
        depends_on TEXT,
        resources TEXT,
        state INTEGER NOT NULL,
        attempt INTEGER NOT NULL DEFAULT 0,
        worker_id TEXT,
        result BLOB,
        result_content_type TEXT NOT NULL DEFAULT '',
        error TEXT NOT NULL DEFAULT '',
        created_at INTEGER NOT NULL,
        started_at INTEGER,
        finished_at INTEGER,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        lease_expires_at INTEGER,
        blocked_on INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX tasks_lease ON tasks (pool, priority DESC, run_at, seq) WHERE state = 1;
    CREATE INDEX tasks_running ON tasks (lease_expires_at) WHERE state = 3;
    CREATE INDEX tasks_finished ON tasks (finished_at) WHERE state IN (4, 5, 6);
    CREATE INDEX tasks_pool ON tasks (pool, seq);
    CREATE TABLE deps (task_seq INTEGER NOT NULL, dep_seq INTEGER NOT NULL, PRIMARY KEY (task_seq, dep_seq));
    CREATE INDEX deps_dependents ON deps (dep_seq);
    CREATE TABLE workers (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        pools TEXT NOT NULL,
        concurrency INTEGER NOT NULL,
        labels TEXT NOT NULL,
        registered_at INTEGER NOT NULL,
        last_seen_at INTEGER NOT NULL
    );
    """,
    2: """
    ALTER TABLE workers ADD COLUMN principal TEXT NOT NULL DEFAULT '';
    CREATE TABLE requests (id TEXT PRIMARY KEY, created TEXT NOT NULL, created_at INTEGER NOT NULL);
    CREATE INDEX requests_created_at ON requests (created_at);
    """,
    3: """
    ALTER TABLE tasks ADD COLUMN timeout_ms INTEGER NOT NULL DEFAULT 0;
    DROP INDEX tasks_lease;
    CREATE INDEX tasks_lease ON tasks (pool, priority DESC, run_at, seq) WHERE state = 1 AND resources IS NULL;
    CREATE INDEX tasks_lease_resources ON tasks (pool, priority DESC, run_at, seq)
        WHERE state = 1 AND resources IS NOT NULL;
    """,
    4: """
    CREATE TABLE schedules (
        pool TEXT NOT NULL,
        name TEXT NOT NULL,
        cron TEXT NOT NULL,
        timezone TEXT NOT NULL DEFAULT '',
        payload BLOB NOT NULL,
        content_type TEXT NOT NULL DEFAULT '',
        priority INTEGER NOT NULL DEFAULT 0,
        max_attempts INTEGER NOT NULL DEFAULT 0,
        resources TEXT,
        timeout_ms INTEGER NOT NULL DEFAULT 0,
        paused INTEGER NOT NULL DEFAULT 0,
        fire_all_missed INTEGER NOT NULL DEFAULT 0,
        next_fire_at INTEGER,
        last_fire_at INTEGER,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        PRIMARY KEY (pool, name)
    );
    CREATE INDEX schedules_due ON schedules (next_fire_at) WHERE paused = 0;
    """,
    5: """
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        task_seq INTEGER NOT NULL,
        pool TEXT NOT NULL,
        prev_state INTEGER NOT NULL,
        state INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        at INTEGER NOT NULL
    );
    CREATE TABLE event_log (id INTEGER PRIMARY KEY CHECK (id = 1), purged_through INTEGER NOT NULL DEFAULT 0);
    INSERT INTO event_log (id) VALUES (1);
    """,
    # An event shows its task as its change left it (EVENT_TASK_COLUMNS); NULL in the events
    # recorded before.
    6: """
    ALTER TABLE events ADD COLUMN run_at INTEGER;
    ALTER TABLE events ADD COLUMN worker_id TEXT;
    ALTER TABLE events ADD COLUMN error TEXT;
    ALTER TABLE events ADD COLUMN started_at INTEGER;
    ALTER TABLE events ADD COLUMN finished_at INTEGER;
    ALTER TABLE events ADD COLUMN lease_expires_at INTEGER;
    ALTER TABLE events ADD COLUMN cancel_requested INTEGER;
    """,
    # Every ended attempt of a task (outcome: cronoq.v1.AttemptOutcome), deleted with the task;
    # and the pools an operator paused (nothing of theirs is leased). tasks_due: each pool's
    # earliest-due PENDING task (cronoq_oldest_pending_age_seconds) in one index read. IF NOT
    # EXISTS: a 0.1.0 server started on the migrated store writes version 5 back (see _ADD_COLUMN).
    7: """
    CREATE INDEX IF NOT EXISTS tasks_due ON tasks (pool, run_at) WHERE state = 1;
    CREATE TABLE IF NOT EXISTS attempts (
        task_seq INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        worker_id TEXT,
        started_at INTEGER,
        ended_at INTEGER NOT NULL,
        outcome INTEGER NOT NULL,
        error TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX IF NOT EXISTS attempts_task ON attempts (task_seq, attempt);
    CREATE TABLE IF NOT EXISTS pools (
        name TEXT PRIMARY KEY,
        paused INTEGER NOT NULL DEFAULT 0,
        paused_at INTEGER,
        paused_by TEXT NOT NULL DEFAULT ''
    );
    """,
    # A task's group (SubmitTaskRequest.group_key), and the one a schedule gives its fired tasks;
    # its rank in a pool that caps its groups (store/fair.py: NULL elsewhere, 0 until due).
    8: """
    ALTER TABLE tasks ADD COLUMN group_key TEXT NOT NULL DEFAULT '';
    ALTER TABLE schedules ADD COLUMN group_key TEXT NOT NULL DEFAULT '';
    ALTER TABLE tasks ADD COLUMN group_rank INTEGER;
    CREATE INDEX IF NOT EXISTS tasks_fair ON tasks (pool, priority DESC, group_rank, seq)
        WHERE state = 1 AND group_rank > 0;
    CREATE INDEX IF NOT EXISTS tasks_unranked ON tasks (pool, run_at) WHERE state = 1 AND group_rank = 0;
    """,
    # The keyed entry a task is leased by (logic.keyed_entry: NULL when it names none), and its
    # index by key: a lease reads the tasks of the keys with room only. The index of tasks that
    # name resources keeps the others.
    9: """
    ALTER TABLE tasks ADD COLUMN res_key TEXT;
    UPDATE tasks SET res_key = (SELECT min(key) FROM json_each(tasks.resources) WHERE instr(key, ':') > 0)
        WHERE resources IS NOT NULL;
    DROP INDEX IF EXISTS tasks_lease_resources;
    CREATE INDEX tasks_lease_resources ON tasks (pool, priority DESC, run_at, seq)
        WHERE state = 1 AND resources IS NOT NULL AND res_key IS NULL;
    CREATE INDEX IF NOT EXISTS tasks_keyed ON tasks (pool, res_key, priority DESC, run_at, seq)
        WHERE state = 1 AND res_key IS NOT NULL;
    """,
    # Handlers' snoozes (not attempts), last progress (JSON text [value, message, at]) and last
    # checkpoint (given to the next attempt); the W3C trace context a task was submitted in, and
    # the one a schedule was put in (JSON text [traceparent, tracestate, link]).
    10: """
    ALTER TABLE tasks ADD COLUMN snoozes INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE tasks ADD COLUMN progress TEXT;
    ALTER TABLE tasks ADD COLUMN checkpoint BLOB;
    ALTER TABLE tasks ADD COLUMN trace TEXT;
    ALTER TABLE schedules ADD COLUMN trace TEXT;
    """,
    # Workflows: the task whose handler spawned a task (TaskSuccess.spawn), and when a task with
    # dependencies runs (RUN_WHEN_*; 0: not given).
    11: """
    ALTER TABLE tasks ADD COLUMN parent_seq INTEGER;
    ALTER TABLE tasks ADD COLUMN run_when INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX IF NOT EXISTS tasks_parent ON tasks (parent_seq) WHERE parent_seq IS NOT NULL;
    """,
}

# Release 0.1.0 wrote its own schema version (5) whenever it opened a store, also one a newer
# server had migrated: a migration may find its columns already added.
_ADD_COLUMN = re.compile(r"^\s*ALTER TABLE (\w+) ADD COLUMN (\w+)", re.IGNORECASE)

_INSERT_ATTEMPT = f"INSERT INTO attempts ({ATTEMPT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
# What a leased task counts against a lease's max_bytes, before the per-task overhead.
LEASE_SIZE = "length(payload) + length(coalesce(key, '')) + length(content_type)"
_INSERT_EVENT = f"INSERT INTO events ({EVENT_COLUMNS}) VALUES ({', '.join('?' * 13)})"
_RECORD_EVENT = (
    f"INSERT INTO events ({EVENT_COLUMNS})"
    f" SELECT seq, state, attempt, ?, pool, ?, {EVENT_TASK_COLUMNS} FROM tasks WHERE seq = ?"
)

_DIALECT = Dialect(
    mark=lambda n: "?",
    any_of=lambda column, mark, _type: f"{column} IN (SELECT value FROM json_each({mark}))",
    array=json.dumps,
    contains="instr({0}, {1}) > 0",
)

MAX_GROUP = 256  # writes committed together at most
MAX_VARS = 900  # well under SQLite's bound on host parameters per statement
PROGRESS_STEPS = 10_000  # VM steps between a timed read's looks at the clock (about a ms of a scan)


@dataclass(slots=True)
class _Op:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    write: bool
    fut: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.cancelled():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


def _chunks(items: list[T], size: int = MAX_VARS) -> Iterable[list[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _yield_cpu() -> None:
    """Makes this thread (a scan's) the lowest CPU priority: on a busy machine it leaves the cores
    to the store's thread and the event loop. Linux only, where a thread has a nice value of its own."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _free_for(entry: str) -> str:
    """SQL: what the lease's `free` has for a resources entry, as fair.free_for: its own, else
    its keyed resource's full size ("name:"), else 0."""
    own = f"(SELECT amount FROM free WHERE name = {entry})"
    default = f"(SELECT amount FROM free WHERE name = substr({entry}, 1, instr({entry}, ':')))"
    return f"coalesce({own}, {default}, 0)"


# A due task fits alone: every amount it names is free (in the lease's `free` table).
_FITS_ALONE = f"NOT EXISTS (SELECT 1 FROM json_each(tasks.resources) r WHERE r.value > {_free_for('r.key')})"
# When a pool's next PENDING task not yet due becomes due (pool, now): one step of tasks_due.
_NEXT_DUE = "SELECT min(run_at) FROM tasks INDEXED BY tasks_due WHERE state = 1 AND pool = ? AND run_at > ?"
# The key of a pool's PENDING tasks after the one given (logic.KEY_SCAN).
_NEXT_KEY = (
    "SELECT res_key FROM tasks INDEXED BY tasks_keyed WHERE state = 1 AND pool = ? AND res_key > ?"
    " ORDER BY res_key LIMIT 1"
)
# What a lease's `free` has (JSON, its parameter), for _free_for.
_FREE = "WITH free AS MATERIALIZED (SELECT key AS name, value AS amount FROM json_each(?))"
# A key's first due tasks (pool, key, now, how many) that fit alone in free (JSON, the first).
_KEY_HEAD = (
    f"{_FREE} SELECT seq FROM tasks INDEXED BY tasks_keyed WHERE state = 1 AND pool = ? AND res_key = ?"
    f" AND run_at <= ? AND {_FITS_ALONE} ORDER BY priority DESC, run_at, seq LIMIT ?"
)


# A lease's order within a pool.
_ORDER = "priority DESC, run_at, seq"
# Of a lease's candidates that name resources (cand), the running total of each resource they
# name, in lease order (need); those that fit beside the ones before them.
_NEED = (
    "need AS (SELECT c.seq, r.key AS name, sum(r.value) OVER (PARTITION BY r.key"
    " ORDER BY c.priority DESC, c.run_at, c.seq) AS upto FROM cand c, json_each(c.resources) r)"
)
_FITS_BESIDE = f"seq NOT IN (SELECT seq FROM need WHERE upto > {_free_for('need.name')})"


def _within_bytes(picked: str, order: str) -> str:
    """SQL: the seqs of the tasks picked (with their size), the first always, then as many as
    fit in max_bytes (the two parameters that follow picked's; <= 0: all) in this order."""
    return (
        f"SELECT seq FROM (SELECT seq, row_number() OVER w AS n, sum(size) OVER w AS upto FROM ({picked})"
        f" WINDOW w AS (ORDER BY {order})) WHERE n = 1 OR ? <= 0 OR upto <= ?"
    )


def _in_turns(picked: str) -> str:
    """SQL: the tasks picked (a table, or a query in parentheses) of several pools, each with its
    pool's place in turn order, dealt round robin: each pool's first in lease order (turn 1),
    then each one's second, ..."""
    return (
        f"SELECT *, row_number() OVER (PARTITION BY place ORDER BY {_ORDER}) AS turn FROM {picked} ORDER BY turn, place"
    )


def _marks(n: int) -> str:
    return ",".join("?" * n)


WORKER_COLUMNS = "id, name, pools, concurrency, labels, registered_at, last_seen_at, principal"


def _worker(r: tuple[Any, ...]) -> WorkerRow:
    return WorkerRow(r[0], r[1], json.loads(r[2]), r[3], json.loads(r[4]), r[5], r[6], r[7])


class SqliteStore:
    # The one writer thread runs a stream's steps one after the other anyway: one step of all
    # the worker's free slots commits more per transaction (burn-down 18.1-18.4k tasks/s
    # against 15.0-15.5k with two steps of half each).
    work_steps = 1
    # A caller queued behind a bulk action's batch waits for it: 2 ms batches keep another
    # caller's p99 at 1.1-1.9x its quiet value during a retry of 50,000 tasks, 5 ms ones at
    # 1.8-3.3x (bench/bulk.py).
    bulk_batch_s = 0.002

    def __init__(self, path: str, settings: StoreSettings, synchronous: str = "full"):
        self.path = path
        self.settings = settings
        self._synchronous = synchronous.upper()
        self._db: sqlite3.Connection | None = None
        self._ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        # Used on the store's thread only, as are the writes that rank.
        self._ranks = GroupRanks(settings.group_pools)
        self._key_after: dict[str, str] = {}  # pool -> the last key a lease visited (_keys)
        self._rank_reset = rank_reset(settings.group_pools)
        self._rank_keep = rank_keep(settings.group_pools)
        self._thread: threading.Thread | None = None
        # Bulk actions' scans run on threads of their own (settings.bulk_scans): however many
        # there are, the other reads aside keep the default executor's threads.
        self._scans: ThreadPoolExecutor | None = None

    # -- plumbing -------------------------------------------------------------
    #
    # One thread owns the connection. Writes queued while it works are committed
    # together (group commit): each runs inside its own SAVEPOINT, so one that fails
    # rolls back alone, and every caller hears back only after the shared COMMIT.

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._submit_op(fn, args, False)

    async def _tx(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._submit_op(fn, args, True)

    def _submit_op(self, fn: Callable[..., T], args: tuple[Any, ...], write: bool) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._ops.put(_Op(fn, args, write, fut, loop))
        return fut

    def _serve_ops(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            batch = [op]
            while len(batch) < MAX_GROUP:
                try:
                    nxt = self._ops.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._ops.put(None)
                    break
                batch.append(nxt)
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Op]) -> None:
        db = self._conn
        done: list[tuple[_Op, bool, Any]] = []
        writes = [op for op in batch if op.write]
        try:
            if writes:
                db.execute("BEGIN IMMEDIATE")
                for op in writes:
                    db.execute("SAVEPOINT op")
                    try:
                        done.append((op, True, op.fn(db, *op.args)))
                        db.execute("RELEASE op")
                    except Exception as err:
                        db.execute("ROLLBACK TO op")
                        db.execute("RELEASE op")
                        done.append((op, False, err))
                db.execute("COMMIT")
        except Exception as err:
            if db.in_transaction:
                db.execute("ROLLBACK")
            done = [(op, False, err) for op in writes]
        for op in batch:
            if not op.write:
                try:
                    done.append((op, True, op.fn(*op.args)))
                except Exception as err:
                    done.append((op, False, err))
        for op, ok, value in done:
            try:
                op.loop.call_soon_threadsafe(_settle, op.fut, ok, value)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting
                pass

    @property
    def _conn(self) -> sqlite3.Connection:
        assert self._db is not None, "store is not open"
        return self._db

    def _full_id(self, seq: int) -> int:
        return make_task_id(self.settings.shard_number, seq)

    # -- lifecycle ------------------------------------------------------------

    async def open(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={self._synchronous}")
        self._db = db
        self._thread = threading.Thread(target=self._serve_ops, name="cronoq-sqlite", daemon=True)
        self._thread.start()
        self._scans = ThreadPoolExecutor(self.settings.bulk_scans, "cronoq-scan", _yield_cpu)
        await self._tx(self._migrate)

    def _migrate(self, db: sqlite3.Connection) -> None:
        has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE name='meta'").fetchone()
        version = 0
        if has_meta:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            version = int(meta.get("schema_version", "0"))
            self._check_version(version)
            owner = (meta.get("shard_name"), meta.get("shard_number"))
            mine = (self.settings.shard_name, str(self.settings.shard_number))
            if owner != mine:
                raise StoreOwnedElsewhere(
                    f"store {self.path} holds shard {owner[0]!r} (number {owner[1]}), "
                    f"not {mine[0]!r} (number {mine[1]})"
                )
        for v in sorted(MIGRATIONS):
            if v > version:
                for statement in MIGRATIONS[v].split(";"):
                    if statement.strip() and not _column_exists(db, statement):
                        db.execute(statement)
                db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(v),))
        db.execute("INSERT OR IGNORE INTO meta VALUES ('shard_name', ?)", (self.settings.shard_name,))
        db.execute("INSERT OR IGNORE INTO meta VALUES ('shard_number', ?)", (str(self.settings.shard_number),))
        settle_restored(db)  # a backup put in place by hand: no id the replaced store gave is given again

    def _check_version(self, version: int) -> None:
        if version > max(MIGRATIONS):
            raise schema_too_new(f"store {self.path}", version, max(MIGRATIONS))

    async def check_schema(self) -> None:
        sql = "SELECT value FROM meta WHERE key = 'schema_version'"
        self._check_version(int((await self._run(lambda: self._conn.execute(sql).fetchone()))[0]))

    async def close(self) -> None:
        if self._thread is not None:
            self._ops.put(None)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._scans is not None:
            self._scans.shutdown(wait=False, cancel_futures=True)
            self._scans = None

    # -- reads ----------------------------------------------------------------

    def _select(self, db: sqlite3.Connection, where: str, params: Iterable[Any] = ()) -> list[TaskRow]:
        return [task_row(r) for r in db.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE {where}", tuple(params))]

    def _select_seqs(self, db: sqlite3.Connection, seqs: list[int]) -> list[TaskRow]:
        rows: list[TaskRow] = []
        for chunk in _chunks(seqs):
            rows.extend(self._select(db, f"seq IN ({_marks(len(chunk))})", chunk))
        return rows

    async def get(self, seq: int) -> TaskRow | None:
        rows = await self._run(lambda: self._select(self._conn, "seq = ?", (seq,)))
        return rows[0] if rows else None

    async def get_by_key(self, key: str) -> TaskRow | None:
        rows = await self._run(lambda: self._select(self._conn, "key = ?", (key,)))
        return rows[0] if rows else None

    async def get_many(self, seqs: list[int]) -> list[TaskRow]:
        return await self._run(self._select_seqs, self._conn, seqs)

    async def dependents(self, seq: int, limit: int) -> list[tuple[int, str]]:
        sql = "SELECT d.task_seq, t.pool FROM deps d JOIN tasks t ON t.seq = d.task_seq WHERE d.dep_seq = ?"
        sql += " ORDER BY d.task_seq LIMIT ?"
        rows = await self._run(lambda: self._conn.execute(sql, (seq, limit)).fetchall())
        return [(s, p) for s, p in rows]

    async def dependency_rows(self, seqs: list[int]) -> dict[int, DependencyRow]:
        def read() -> dict[int, DependencyRow]:
            found: dict[int, DependencyRow] = {}
            for chunk in _chunks(seqs):
                sql = (
                    "SELECT seq, key, state, result, result_content_type, error FROM tasks"
                    f" WHERE seq IN ({_marks(len(chunk))})"
                )
                for r in self._conn.execute(sql, chunk):
                    found[r[0]] = DependencyRow(r[0], r[1], State(r[2]), r[3], r[4], r[5])
            return found

        return await self._run(read)

    async def cancel_workflow(
        self, seq: int, now: int, cancellable: frozenset[str] | None
    ) -> tuple[TaskRow | None, int, Changes]:
        def cancel(db: sqlite3.Connection) -> tuple[TaskRow | None, int, Changes]:
            def below(seqs: list[int]) -> list[tuple[int, str]]:
                found: list[tuple[int, str]] = []
                for chunk in _chunks(seqs, MAX_VARS // 2):
                    marks = _marks(len(chunk))
                    sql = (
                        f"SELECT seq, pool FROM tasks WHERE parent_seq IN ({marks}) UNION SELECT d.task_seq, t.pool"
                        f" FROM deps d JOIN tasks t ON t.seq = d.task_seq WHERE d.dep_seq IN ({marks})"
                    )
                    found += db.execute(sql, [*chunk, *chunk]).fetchall()
                return found

            tree = WorkflowTree(seq, cancellable)
            while tree.frontier:
                tree.add(below(tree.frontier))
            _, changes = self._cancel_tasks(db, [seq, *tree.found], now)
            rows = self._select(db, "seq = ?", (seq,))
            return (rows[0] if rows else None), descendants_changed(seq, changes), changes

        return await self._tx(cancel)

    async def list_tasks(
        self, pools: list[str] | None, state: State | None, after_seq: int, limit: int, newest_first: bool = False
    ) -> list[TaskRow]:
        return await self.list_matching(list_filter(pools, state), after_seq, limit, newest_first)

    async def list_matching(
        self, match: TaskFilter, after_seq: int, limit: int, newest_first: bool = False
    ) -> list[TaskRow]:
        where, params = match_sql(match, after_seq, limit, _DIALECT, newest_first)
        if scans_far(match):  # as match_tasks: a filter few tasks match scans far
            return await self._scan(lambda db: self._select(db, where, params))
        if match == list_filter(match.pools, None):  # pools alone: an index walk, on the store's thread
            return await self._run(lambda: self._select(self._conn, where, params))
        return await self._read_aside(lambda db: self._select(db, where, params))

    async def oldest_due_pending(self, pools: list[str], now: int) -> dict[str, int]:
        sql = (
            "SELECT max(run_at, created_at) FROM tasks WHERE state = 1 AND pool = ? AND run_at <= ?"
            " ORDER BY run_at LIMIT 1"
        )

        def oldest() -> dict[str, int]:
            found = {p: self._conn.execute(sql, (p, now)).fetchone() for p in pools}
            return {p: r[0] for p, r in found.items() if r is not None}

        return await self._run(oldest)

    async def _read_aside(
        self, fn: Callable[[sqlite3.Connection], T], on: Executor | None = None, timeout_us: int | None = None
    ) -> T:
        """fn on a read-only connection of its own, off the store's thread: a long scan must not
        hold up the calls queued there (WAL lets it read beside them); it sees committed data.

        on: the executor to run it (None: the default one); timeout_us: its statements are
        interrupted (sqlite3.OperationalError, SQLITE_INTERRUPT) once it has run this long."""

        def read() -> T:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=30)
            try:
                db.execute("PRAGMA query_only = 1")
                if timeout_us is not None:
                    deadline = time.monotonic() + timeout_us / 1e6
                    db.set_progress_handler(lambda: time.monotonic() > deadline, PROGRESS_STEPS)
                return fn(db)
            finally:
                db.close()

        return await asyncio.get_running_loop().run_in_executor(on, read)

    async def count_by_pool_and_state(self) -> dict[tuple[str, State], int]:
        sql = "SELECT pool, state, COUNT(*) FROM tasks GROUP BY pool, state"
        return await self._read_aside(lambda db: {(p, State(s)): n for p, s, n in db.execute(sql)})

    async def pending_by_group(self, pool: str, most: int, also: list[str]) -> dict[str, int]:
        pending = "SELECT group_key, count(*) AS n FROM tasks WHERE state = 1 AND pool = ?"
        sql = (
            f"SELECT * FROM ({pending} GROUP BY group_key ORDER BY n DESC, group_key LIMIT ?)"
            f" UNION SELECT * FROM ({pending} AND group_key IN (SELECT value FROM json_each(?)) GROUP BY group_key)"
        )
        params = (pool, most, pool, json.dumps(also))
        return await self._read_aside(lambda db: dict(db.execute(sql, params).fetchall()))

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
            known = db.execute("SELECT created FROM requests WHERE id = ?", (request_id,)).fetchone()
            if known is not None:
                return replay_request(known[0], self._select_seqs(db, request_seqs(known[0]))), []
        out: list[Submitted] = []
        changes: Changes = []
        for task in tasks:
            if task.key is not None:
                existing = self._select(db, "key = ?", (task.key,))
                if existing:
                    key_of_another_pool(task.key, task.pool, existing[0].pool)
                    out.append(Submitted(existing[0], True))
                    continue
            deps, dep_bytes = self._resolve_deps(db, task, out, visible)
            check_dependency_bytes(
                repr(task.key) if task.key else "the task",
                dep_bytes,
                self.settings.max_dependency_results_bytes,
                self._full_id,
            )
            state, error, blocked_on = initial_state(deps, self._full_id, task.run_when)
            finished_at = now if state in TERMINAL else None
            run_at = task.run_at if task.run_at is not None else now
            dep_list = [s for s, _ in deps]
            cur = db.execute(
                "INSERT INTO tasks (pool, key, payload, content_type, priority, run_at, max_attempts, depends_on,"
                " resources, state, error, created_at, finished_at, blocked_on, timeout_ms, group_key, group_rank,"
                " res_key, trace, parent_seq, run_when) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
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
                ),
            )
            seq = cur.lastrowid
            assert seq is not None
            if dep_list:
                db.executemany("INSERT OR IGNORE INTO deps VALUES (?, ?)", [(seq, d) for d in dep_list])
            out.append(Submitted(self._select(db, "seq = ?", (seq,))[0], False))
            changes.append((seq, state))
        self._check_limits(db, tasks, out)
        self._record_events(db, changes, [0] * len(changes), now)
        if request_id is not None:
            db.execute("INSERT INTO requests VALUES (?, ?, ?)", (request_id, encode_request(out), now))
        return out, changes

    def _resolve_deps(
        self, db: sqlite3.Connection, task: NewTask, earlier: list[Submitted], visible: frozenset[str] | None
    ) -> tuple[list[tuple[int, State]], list[tuple[int, int]]]:
        """The task's dependencies' (seq, state), and (seq, result bytes)."""
        found: dict[int, State] = {}
        sizes: dict[int, int] = {}
        columns = "seq, state, pool, coalesce(length(CAST(result AS BLOB)), 0)"
        if task.dep_seqs:
            sql = f"SELECT {columns} FROM tasks WHERE seq IN ({_marks(len(task.dep_seqs))})"
            rows = {r[0]: r for r in db.execute(sql, task.dep_seqs)}
            for seq in task.dep_seqs:
                if seq not in rows or (visible is not None and rows[seq][2] not in visible):
                    raise not_found(f"depends_on: task {self._full_id(seq)} not found")
                found[seq], sizes[seq] = State(rows[seq][1]), rows[seq][3]
        for key in task.dep_keys:
            row = db.execute(f"SELECT {columns} FROM tasks WHERE key = ?", (key,)).fetchone()
            if row is None or (visible is not None and row[2] not in visible):
                raise not_found(f"depends_on: no task with key {key!r}")
            found[row[0]], sizes[row[0]] = State(row[1]), row[3]
        for index in task.dep_batch:
            dep = earlier[index].row
            found[dep.seq] = dep.state
        return list(found.items()), list(sizes.items())

    def _check_limits(self, db: sqlite3.Connection, tasks: list[NewTask], out: list[Submitted]) -> None:
        created = [r.row.pool for r in out if not r.deduplicated]
        if created and limits_apply(self.settings):
            counts = dict(db.execute("SELECT pool, COUNT(*) FROM tasks WHERE state IN (1, 2) GROUP BY pool"))
            check_pending_limits(self.settings, counts, created)

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
            taken = self._take(db, worker_id, fair, now, f"{_marks(len(chosen))}", tuple(chosen))
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
        due = [db.execute(_NEXT_DUE, (p, now)).fetchone()[0] for p in others]
        if fair:
            unranked = (
                f"SELECT min(run_at) FROM tasks WHERE state = 1 AND group_rank = 0 AND pool IN ({_marks(len(fair))})"
            )
            due.append(db.execute(unranked, fair).fetchone()[0])
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
        marks = _marks(len(pools))
        sql = (
            f"SELECT seq, pool, group_key FROM tasks WHERE state = 1 AND group_rank = 0 AND pool IN ({marks})"
            f" AND run_at <= ? ORDER BY run_at, seq LIMIT {RANK_BATCH}"
        )
        due = db.execute(sql, (*pools, now)).fetchall()
        ranked = [(self._ranks.rank(pool, group), seq) for seq, pool, group in due]
        db.executemany("UPDATE tasks SET group_rank = ? WHERE seq = ?", ranked)
        size = f"{LEASE_SIZE} + {int(self.settings.lease_overhead_bytes)}"
        head = " UNION ALL ".join(
            f"SELECT * FROM (SELECT seq, pool, group_key, {size}, resources, priority, group_rank FROM tasks"
            " INDEXED BY tasks_fair"
            " WHERE state = 1 AND group_rank > 0 AND pool = ? AND run_at <= ?"
            " ORDER BY priority DESC, group_rank, seq LIMIT ?)"
            for _ in pools
        )
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
        size = f"{LEASE_SIZE} + {int(self.settings.lease_overhead_bytes)}"
        due = f"state = 1 AND pool IN ({_marks(len(pools))}) AND run_at <= ?"
        order = _ORDER
        # Tasks that name no resources, and those that do, are in indexes of their own: the
        # first never wait behind the second.
        # INDEXED BY: the planner would rather range over tasks_due (pool, run_at) and sort every
        # due task (a lease of 64 among 60,000 pending cost 30% of the burn-down).
        plain = (
            f"SELECT seq, priority, run_at, {size} AS size FROM tasks INDEXED BY tasks_lease"
            f" WHERE {due} AND resources IS NULL"
        )
        ok = f"{plain} ORDER BY {order} LIMIT ?"
        params: tuple[Any, ...] = (*pools, now, limit)
        if free:
            # Of the due tasks that name resources, the first whose every amount is available
            # alone (in index order, checked only until enough are found: those of a resource
            # used up never fill the window), and those of the keys with room a keyed resource
            # names (_keyed); of those, the ones that still fit beside the tasks before them
            # (running totals per resource).
            keyed = self._keyed(db, pools, now, limit, free) if has_keyed(free) else []
            ok = (
                f"{_FREE}, cand AS (SELECT * FROM (SELECT seq, priority, run_at, resources, {size} AS size FROM tasks"
                f" INDEXED BY tasks_lease_resources WHERE {due} AND resources IS NOT NULL AND res_key IS NULL"
                f" AND {_FITS_ALONE} ORDER BY {order} LIMIT ?)"
                f" UNION ALL SELECT seq, priority, run_at, resources, {size} FROM tasks"
                f" WHERE seq IN (SELECT value FROM json_each(?)) ORDER BY {order} LIMIT ?),"
                f" {_NEED} SELECT * FROM (SELECT * FROM ({ok})"
                f" UNION ALL SELECT seq, priority, run_at, size FROM cand WHERE {_FITS_BESIDE})"
                f" ORDER BY {order} LIMIT ?"
            )
            scan = lease_scan(limit)
            params = (json.dumps(dict(free)), *pools, now, scan, json.dumps(keyed), scan, *params, limit)
        return self._take(db, worker_id, pools, now, _within_bytes(ok, order), (*params, max_bytes, max_bytes))

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
        size = f"{LEASE_SIZE} + {int(self.settings.lease_overhead_bytes)}"

        def each(columns: str, index: str, where: str, count: int) -> tuple[str, list[Any]]:
            sql = " UNION ALL ".join(
                f"SELECT * FROM (SELECT {columns}, {place} AS place FROM tasks INDEXED BY {index}"
                f" WHERE state = 1 AND pool = ? AND run_at <= ? AND {where} ORDER BY {_ORDER} LIMIT ?)"
                for place in range(len(pools))
            )
            return sql, [v for p in pools for v in (p, now, count)]

        ok, params = each(f"seq, priority, run_at, {size} AS size", "tasks_lease", "resources IS NULL", limit)
        if free:
            # As _lease_plain's, each pool's own (those of a keyed resource by key: _keyed).
            scan = lease_scan(limit)
            where = f"resources IS NOT NULL AND res_key IS NULL AND {_FITS_ALONE}"
            cand, cand_params = each(
                f"seq, priority, run_at, resources, {size} AS size", "tasks_lease_resources", where, scan
            )
            if has_keyed(free):
                for place, pool in enumerate(pools):
                    cand += (
                        f" UNION ALL SELECT seq, priority, run_at, resources, {size}, {place} FROM tasks"
                        " WHERE seq IN (SELECT value FROM json_each(?))"
                    )
                    cand_params.append(json.dumps(self._keyed(db, [pool], now, limit, free)))
            ok = (
                f"{_FREE}, cand AS ({_in_turns(f'({cand})')} LIMIT ?), {_NEED},"
                f" picked AS ({ok} UNION ALL SELECT seq, priority, run_at, size, place FROM cand WHERE {_FITS_BESIDE})"
                f" {_in_turns('picked')} LIMIT ?"
            )
            params = [json.dumps(dict(free)), *cand_params, scan, *params]
        else:
            ok = f"{_in_turns(f'({ok})')} LIMIT ?"
        return self._take(
            db, worker_id, pools, now, _within_bytes(ok, "turn, place"), (*params, limit, max_bytes, max_bytes)
        )

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
                    seqs += [r[0] for r in db.execute(_KEY_HEAD, (free_json, pool, key, now, room))]
        return seqs

    def _keys(self, db: sqlite3.Connection, pool: str) -> list[str]:
        """The keys of the pool's PENDING tasks a lease visits (logic.KEY_SCAN): after those
        the last lease visited, then from the first again up to there."""
        after = self._key_after.pop(pool, "")
        keys: list[str] = []
        key, wrapped = after, False
        while len(keys) < KEY_SCAN:
            row = db.execute(_NEXT_KEY, (pool, key)).fetchone()
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
        expiry = "CASE pool " + " ".join("WHEN ? THEN ?" for _ in pools) + " END"
        expiry_params: list[Any] = []
        for p in pools:
            expiry_params += [p, now + ttl[p]]
        sql = (
            f"UPDATE tasks SET state = 3, attempt = attempt + 1, worker_id = ?, started_at = ?,"
            # Never past the attempt's deadline (started_at + timeout_ms).
            f" lease_expires_at = CASE WHEN timeout_ms > 0 THEN min({expiry}, ? + timeout_ms * 1000) ELSE {expiry} END"
            f" WHERE state = 1 AND seq IN ({chosen}) RETURNING {TASK_COLUMNS}"
        )
        all_params = (worker_id, now, *expiry_params, now, *expiry_params, *params)
        rows = [task_row(r) for r in db.execute(sql, all_params)]
        rows.sort(key=lambda r: (-r.priority, r.run_at, r.seq))
        running = int(State.RUNNING)
        pending = int(State.PENDING)
        events = [(r.seq, running, r.attempt, now, r.pool, pending, *event_task_values(r)) for r in rows]
        db.executemany(_INSERT_EVENT, events)
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
        db.execute("UPDATE workers SET last_seen_at = ? WHERE id = ?", (now, worker_id))
        current: dict[int, tuple[Any, ...]] = {}
        seqs = [s for s, _ in attempts] + [r.seq for r in reports]
        for chunk in _chunks(seqs):
            sql = f"SELECT {HEARTBEAT_COLUMNS} FROM tasks WHERE seq IN ({_marks(len(chunk))})"
            for r in db.execute(sql, chunk):
                current[r[0]] = r
        self._keep_reports(db, current_reports(reports, current, worker_id), now)
        cancelled, lost, extend = decide_heartbeat(worker_id, attempts, current, now, self.settings.lease_ttl_us)
        db.executemany("UPDATE tasks SET lease_expires_at = ? WHERE seq = ?", extend)
        return cancelled, lost

    def _keep_reports(self, db: sqlite3.Connection, reports: Sequence[Report], now: int) -> None:
        """Keeps the reports of current attempts with their tasks; a progress is an event."""
        seqs, progress, has_checkpoint, checkpoint = report_columns(reports, now)
        db.executemany(
            "UPDATE tasks SET progress = coalesce(?, progress), checkpoint = CASE WHEN ? THEN ? ELSE checkpoint END"
            " WHERE seq = ?",
            zip(progress, has_checkpoint, checkpoint, seqs, strict=True),
        )
        progressed: Changes = [(r.seq, State.RUNNING) for r in reports if r.progress is not None]
        self._record_events(db, progressed, [State.RUNNING] * len(progressed), now)

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
            sql = f"SELECT {OUTCOME_COLUMNS} FROM tasks WHERE seq IN ({_marks(len(chunk))})"
            for r in db.execute(sql, chunk):
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
                db.execute("SAVEPOINT spawn")
                try:
                    _, created = self._submit(db, outcome.spawn, now, None, outcome.spawn_visible)
                    changes += created
                except ApiError as err:
                    db.execute("ROLLBACK TO spawn")
                    outcome = spawn_refused(outcome, err)
                db.execute("RELEASE spawn")
            out.append((outcome, current))
        return out, changes

    def _apply_outcomes(
        self, db: sqlite3.Connection, accepted: list[tuple[Outcome, tuple[Any, ...]]], now: int
    ) -> Changes:
        self._keep_reports(db, [o.report for o, _ in accepted if o.report is not None], now)
        d = decide_outcomes(accepted, now, self.settings.retry_at, self.settings.max_snoozes)
        db.executemany(_INSERT_ATTEMPT, d.attempts)
        db.executemany(
            "UPDATE tasks SET state = ?, result = ?, result_content_type = ?, error = ?, finished_at = ?,"
            " lease_expires_at = NULL WHERE seq = ?",
            d.terminal,
        )
        db.executemany(
            "UPDATE tasks SET state = 1, run_at = ?, error = ?, worker_id = NULL, lease_expires_at = NULL,"
            f" {self._rank_reset} WHERE seq = ?",
            d.retries,
        )
        db.executemany(
            "UPDATE tasks SET state = 1, attempt = attempt - 1, worker_id = NULL, started_at = NULL,"
            f" lease_expires_at = NULL, {self._rank_keep} WHERE seq = ?",
            [(seq,) for seq in d.released],
        )
        db.executemany(
            "UPDATE tasks SET state = 1, run_at = ?, attempt = attempt - 1, snoozes = snoozes + 1, worker_id = NULL,"
            f" started_at = NULL, lease_expires_at = NULL, {self._rank_reset} WHERE seq = ?",
            d.snoozed,
        )
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
        done = [(seq, "") for seq in succeeded] + [(seq, " AND t.run_when = 2") for seq in ended]
        for kind in ("", " AND t.run_when = 2"):
            changes += self._count_done(db, [seq for seq, k in done if k == kind], kind)
        return changes

    def _count_done(self, db: sqlite3.Connection, done: list[int], only: str) -> Changes:
        changes: Changes = []
        for chunk in _chunks(done):
            marks = _marks(len(chunk))
            dependents = [
                r[0]
                for r in db.execute(
                    f"SELECT d.task_seq, COUNT(*) FROM deps d JOIN tasks t ON t.seq = d.task_seq"
                    f" WHERE d.dep_seq IN ({marks}) AND t.state = 2{only} GROUP BY d.task_seq",
                    chunk,
                )
            ]
            if not dependents:
                continue
            db.executemany(
                "UPDATE tasks SET blocked_on = blocked_on"
                f" - (SELECT COUNT(*) FROM deps WHERE task_seq = ? AND dep_seq IN ({marks}))"
                " WHERE seq = ?",
                [(d, *chunk, d) for d in dependents],
            )
            for part in _chunks(dependents):
                sql = (
                    f"UPDATE tasks SET state = 1, {self._rank_reset} WHERE state = 2 AND blocked_on <= 0"
                    f" AND seq IN ({_marks(len(part))}) RETURNING seq"
                )
                changes += [(r[0], State.PENDING) for r in db.execute(sql, part)]
        return changes

    def _end_dependents(self, db: sqlite3.Connection, ended: list[int], state: State, now: int) -> Changes:
        """Fails (or cancels) BLOCKED dependents of ended tasks, transitively; finalizers among
        them count those as done instead."""
        changes: Changes = []
        frontier = ended
        while frontier:
            changes += self._unblock_dependents(db, [], frontier)
            nxt: list[int] = []
            for chunk in _chunks(frontier):
                rows = db.execute(
                    f"SELECT d.task_seq, MIN(d.dep_seq) FROM deps d JOIN tasks t ON t.seq = d.task_seq"
                    f" WHERE d.dep_seq IN ({_marks(len(chunk))}) AND t.state = 2 AND t.run_when <> 2"
                    " GROUP BY d.task_seq",
                    chunk,
                ).fetchall()
                db.executemany(
                    "UPDATE tasks SET state = ?, error = ?, finished_at = ? WHERE seq = ? AND state = 2",
                    [(int(state), dependency_error(state, self._full_id(dep)), now, seq) for seq, dep in rows],
                )
                nxt += [seq for seq, _ in rows]
            changes += [(seq, state) for seq in nxt]
            frontier = nxt
        return changes

    async def expire_leases(self, now: int) -> tuple[Changes, list[tuple[int, int]]]:
        return await self._tx(self._expire_leases, now)

    def _expire_leases(self, db: sqlite3.Connection, now: int) -> tuple[Changes, list[tuple[int, int]]]:
        sql = f"SELECT {OUTCOME_COLUMNS} FROM tasks WHERE state = 3 AND lease_expires_at < ?"
        expired = [expired_outcome(r) for r in db.execute(sql, (now,))]
        if not expired:
            return [], []
        return self._apply_outcomes(db, expired, now), [(o.seq, o.attempt) for o, _ in expired]

    async def running_resources(self) -> list[tuple[str, Held]]:
        sql = (
            "SELECT worker_id, seq, attempt, resources, pool, group_key FROM tasks WHERE state = 3"
            f" AND (resources IS NOT NULL OR pool IN ({_marks(len(self.settings.group_pools))}))"
        )
        rows = await self._run(lambda: self._conn.execute(sql, sorted(self.settings.group_pools)).fetchall())
        return [(r[0], Held(r[1], r[2], json.loads(r[3]) if r[3] else {}, r[4], r[5])) for r in rows]

    async def load_ranks(self) -> None:
        await self._tx(self._load_ranks)

    def _load_ranks(self, db: sqlite3.Connection) -> None:
        for pool in sorted(self.settings.group_pools):
            # PENDING tasks stored before the pool capped its groups: ranked when due.
            db.execute("UPDATE tasks SET group_rank = 0 WHERE state = 1 AND pool = ? AND group_rank IS NULL", (pool,))
            sql = "SELECT min(group_rank) FROM tasks WHERE state = 1 AND group_rank > 0 AND pool = ?"
            lowest = db.execute(sql, (pool,)).fetchone()[0]
            sql = (
                "SELECT group_key, max(group_rank) FROM tasks WHERE state = 1 AND group_rank > 0 AND pool = ?"
                " GROUP BY group_key"
            )
            self._ranks.rebuild(pool, (lowest or 1) - 1, dict(db.execute(sql, (pool,)).fetchall()))

    async def cancel(self, seq: int, now: int) -> tuple[TaskRow | None, Changes]:
        def cancel(db: sqlite3.Connection) -> tuple[TaskRow | None, Changes]:
            _, changes = self._cancel_tasks(db, [seq], now)
            rows = self._select(db, "seq = ?", (seq,))
            return (rows[0] if rows else None), changes

        return await self._tx(cancel)

    async def cancel_tasks(self, seqs: list[int], now: int) -> tuple[list[int], Changes]:
        return await self._tx(self._cancel_tasks, seqs, now)

    def _cancel_tasks(self, db: sqlite3.Connection, seqs: list[int], now: int) -> tuple[list[int], Changes]:
        ended: list[tuple[int, State]] = []  # (seq, state it leaves)
        requested: list[int] = []
        for chunk in _chunks(sorted(set(seqs))):
            sql = (
                f"SELECT seq, state FROM tasks WHERE seq IN ({_marks(len(chunk))})"
                " AND (state IN (1, 2) OR (state = 3 AND cancel_requested = 0))"
            )
            for seq, state in db.execute(sql, chunk):
                if state == State.RUNNING:
                    requested.append(seq)
                else:
                    ended.append((seq, State(state)))
        db.executemany(
            "UPDATE tasks SET state = 6, error = 'cancelled', finished_at = ? WHERE seq = ?",
            [(now, seq) for seq, _ in ended],
        )
        db.executemany("UPDATE tasks SET cancel_requested = 1 WHERE seq = ?", [(seq,) for seq in requested])
        changes: Changes = [(seq, State.CANCELLED) for seq, _ in ended] + [(seq, State.RUNNING) for seq in requested]
        prev = [state for _, state in ended] + [State.RUNNING] * len(requested)
        dependents = self._end_dependents(db, [seq for seq, _ in ended], State.CANCELLED, now)
        changes += dependents
        prev += [State.BLOCKED] * len(dependents)
        self._record_events(db, changes, prev, now)
        return sorted([seq for seq, _ in ended] + requested), changes

    async def match_tasks(self, match: TaskFilter, after_seq: int, limit: int) -> list[tuple[int, State, str]]:
        where, params = match_sql(match, after_seq, limit, _DIALECT)
        sql = f"SELECT seq, state, pool FROM tasks WHERE {where}"
        rows = await self._scan(lambda db: db.execute(sql, params).fetchall())
        return [(seq, State(state), pool) for seq, state, pool in rows]

    async def _scan(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """fn, a read that may scan far (a filter few tasks match: 18 ms for 200,000 tasks),
        aside on the scans' threads, stopped past bulk_scan_timeout (ScanTimedOut): other calls
        would wait behind it on the store's thread."""
        timeout_us = self.settings.bulk_scan_timeout_us
        try:
            return await self._read_aside(fn, self._scans, timeout_us)
        except sqlite3.OperationalError as err:
            if err.sqlite_errorcode != sqlite3.SQLITE_INTERRUPT:
                raise
            raise ScanTimedOut(f"interrupted after {timeout_us / 1e6:g} s") from None

    async def purge(self, now: int) -> int:
        return await self._tx(self._purge, now)

    def _purge(self, db: sqlite3.Connection, now: int) -> int:
        purged = 0
        for pool, retention in self.settings.retention_us.items():
            cond = "pool = ? AND state IN (4, 5, 6) AND finished_at < ?"
            params = (pool, now - retention)
            for table in ("deps", "attempts"):
                db.execute(f"DELETE FROM {table} WHERE task_seq IN (SELECT seq FROM tasks WHERE {cond})", params)
            purged += db.execute(f"DELETE FROM tasks WHERE {cond}", params).rowcount
        # A request's record is kept as long as the tasks it created can be.
        db.execute("DELETE FROM requests WHERE created_at < ?", (now - request_retention(self.settings),))
        return purged

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
            sql = (
                "SELECT seq, state, attempt, max_attempts FROM tasks"
                f" WHERE seq IN ({_marks(len(chunk))}) AND state IN (5, 6)"
            )
            rows += [(r[0], State(r[1]), r[2], r[3]) for r in db.execute(sql, chunk)]
        plan = decide_retry(rows, self._dep_states(db, [r[0] for r in rows]), now, run_at, extra_attempts)
        db.executemany(
            "UPDATE tasks SET state = ?, run_at = ?, max_attempts = ?, blocked_on = ?, error = '', result = NULL,"
            " result_content_type = '', finished_at = NULL, worker_id = NULL, started_at = NULL,"
            f" lease_expires_at = NULL, cancel_requested = 0, {self._rank_reset} WHERE seq = ?",
            plan.retried,
        )
        # Each step's events are recorded after its writes: they read the task as it left it.
        self._record_events(db, plan.changes, plan.prev, now)
        retried = frontier = [r[-1] for r in plan.retried]
        while frontier:
            recorded, restored, renamed = len(plan.changes), len(plan.restored), len(plan.renamed)
            candidates: dict[int, tuple[int, State, str, str]] = {}
            for chunk in _chunks(frontier):
                sql = (
                    "SELECT t.seq, t.state, t.error, t.pool FROM deps d JOIN tasks t ON t.seq = d.task_seq"
                    f" WHERE d.dep_seq IN ({_marks(len(chunk))}) AND t.state IN (5, 6) AND t.attempt = 0"
                )
                candidates |= {r[0]: (r[0], State(r[1]), r[2], r[3]) for r in db.execute(sql, chunk)}
            deps = self._dep_states(db, list(candidates))
            frontier = decide_restore(plan, candidates.values(), frontier, deps, self._full_id, restorable)
            db.executemany(
                "UPDATE tasks SET state = 2, blocked_on = ?, error = '', finished_at = NULL WHERE seq = ?",
                plan.restored[restored:],
            )
            db.executemany("UPDATE tasks SET error = ? WHERE seq = ?", plan.renamed[renamed:])
            self._record_events(db, plan.changes[recorded:], plan.prev[recorded:], now)
        # A finalizer still waiting counted these as ended: it waits for them again.
        again = [seq for seq, _ in plan.changes]
        for chunk in _chunks(again):
            db.execute(
                "UPDATE tasks SET blocked_on = blocked_on + (SELECT COUNT(*) FROM deps"
                f" WHERE deps.task_seq = tasks.seq AND deps.dep_seq IN ({_marks(len(chunk))}))"
                " WHERE state = 2 AND run_when = 2 AND seq IN (SELECT task_seq FROM deps"
                f" WHERE dep_seq IN ({_marks(len(chunk))}))",
                [*chunk, *chunk],
            )
        return self._select_seqs(db, retried), len(plan.restored), plan.changes

    def _dep_states(self, db: sqlite3.Connection, seqs: list[int]) -> dict[int, list[tuple[int, State]]]:
        """The dependencies still stored of each of these tasks, with their states."""
        deps: dict[int, list[tuple[int, State]]] = {}
        for chunk in _chunks(seqs):
            sql = (
                "SELECT d.task_seq, d.dep_seq, t.state FROM deps d JOIN tasks t ON t.seq = d.dep_seq"
                f" WHERE d.task_seq IN ({_marks(len(chunk))})"
            )
            for seq, dep, state in db.execute(sql, chunk):
                deps.setdefault(seq, []).append((dep, State(state)))
        return deps

    async def delete_tasks(self, seqs: list[int], events_through: int | None) -> list[int]:
        return await self._tx(self._delete_tasks, seqs, events_through)

    def _delete_tasks(self, db: sqlite3.Connection, seqs: list[int], events_through: int | None) -> list[int]:
        deleted: list[int] = []
        for chunk in _chunks(seqs):
            sql = f"DELETE FROM tasks WHERE seq IN ({_marks(len(chunk))}) AND state IN (4, 5, 6) RETURNING seq"
            deleted += [r[0] for r in db.execute(sql, chunk)]
        for chunk in _chunks(deleted):
            marks = _marks(len(chunk))
            db.execute(f"DELETE FROM deps WHERE task_seq IN ({marks})", chunk)
            db.execute(f"DELETE FROM attempts WHERE task_seq IN ({marks})", chunk)
            if events_through is not None:
                db.execute(f"DELETE FROM events WHERE task_seq IN ({marks}) AND id <= ?", (*chunk, events_through))
        return sorted(deleted)

    async def attempts(self, seq: int) -> list[AttemptRow]:
        sql = f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE task_seq = ? ORDER BY attempt, ended_at"
        rows = await self._run(lambda: self._conn.execute(sql, (seq,)).fetchall())
        return [attempt_row(r) for r in rows]

    # -- events ---------------------------------------------------------------
    #
    # Written in the op that changes the task, so committed with it. One transaction commits at
    # a time, so ids are in commit order: they are the event sequence (dense, since a rolled
    # back op rolls back its ids too). Nothing to number: sequence_events reads the last id.

    def _record_events(self, db: sqlite3.Connection, changes: Changes, prev: Sequence[int], now: int) -> None:
        """An event per change, with the task's pool, state, attempt and EVENT_TASK_COLUMNS as the
        op left them, and prev: the state each change left (0: a new task)."""
        db.executemany(_RECORD_EVENT, [(now, int(p), seq) for (seq, _), p in zip(changes, prev, strict=True)])

    def _last_event(self, db: sqlite3.Connection) -> int:
        row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
        return row[0] if row else 0

    async def sequence_events(self) -> int:
        return await self._run(self._last_event, self._conn)

    async def read_events(self, after: int, limit: int) -> list[EventRow]:
        sql = f"SELECT id, {EVENT_COLUMNS} FROM events WHERE id > ? ORDER BY id LIMIT ?"
        rows = await self._run(lambda: self._conn.execute(sql, (after, limit)).fetchall())
        return [event_row(r) for r in rows]

    async def read_event_columns(self, after: int, limit: int) -> list[EventColumns]:
        sql = f"SELECT id, {COUNTED_COLUMNS} FROM events WHERE id > ? ORDER BY id LIMIT ?"
        rows = await self._run(lambda: self._conn.execute(sql, (after, limit)).fetchall())
        return [EventColumns(*zip(*rows, strict=True))] if rows else []

    async def count_unfinished(self) -> tuple[int, dict[tuple[str, State], int]]:
        """Read in one read transaction on a connection of its own (WAL: one snapshot, and the
        writes queued on the store's thread go on beside it)."""

        def count() -> tuple[int, dict[tuple[str, State], int]]:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=30)
            try:
                db.execute("PRAGMA query_only = 1")
                db.execute("BEGIN")
                last = self._last_event(db)
                sql = "SELECT pool, state, COUNT(*) FROM tasks WHERE state IN (1, 2, 3) GROUP BY pool, state"
                counts = {(p, State(s)): n for p, s, n in db.execute(sql)}
                db.execute("COMMIT")
                return last, counts
            finally:
                db.close()

        return await asyncio.get_running_loop().run_in_executor(None, count)

    async def event_bounds(self) -> tuple[int, int]:
        def bounds() -> tuple[int, int]:
            purged = self._conn.execute("SELECT purged_through FROM event_log WHERE id = 1").fetchone()[0]
            return purged, max(self._last_event(self._conn), purged)

        return await self._run(bounds)

    async def purge_events(self, before: int, limit: int) -> int:
        return await self._tx(self._purge_events, before, limit)

    def _purge_events(self, db: sqlite3.Connection, before: int, limit: int) -> int:
        # Only the oldest `limit` events are looked at: the scan never reaches into the window.
        sql = "SELECT max(id) FROM (SELECT id, at FROM events ORDER BY id LIMIT ?) WHERE at < ?"
        bound = db.execute(sql, (limit, before)).fetchone()[0]
        if bound is None:
            return 0
        deleted = db.execute("DELETE FROM events WHERE id <= ?", (bound,)).rowcount
        db.execute("UPDATE event_log SET purged_through = max(purged_through, ?) WHERE id = 1", (bound,))
        return deleted

    # -- workers --------------------------------------------------------------

    async def register_worker(self, worker: WorkerRow) -> None:
        def insert(db: sqlite3.Connection) -> None:
            db.execute(
                f"INSERT OR REPLACE INTO workers ({WORKER_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
                (
                    worker.id,
                    worker.name,
                    json.dumps(worker.pools),
                    worker.concurrency,
                    json.dumps(worker.labels),
                    worker.registered_at,
                    worker.last_seen_at,
                    worker.principal,
                ),
            )

        await self._tx(insert)

    async def deregister_worker(self, worker_id: str) -> None:
        await self._tx(lambda db: db.execute("DELETE FROM workers WHERE id = ?", (worker_id,)))

    async def get_worker(self, worker_id: str) -> WorkerRow | None:
        def get(db: sqlite3.Connection) -> WorkerRow | None:
            r = db.execute(f"SELECT {WORKER_COLUMNS} FROM workers WHERE id = ?", (worker_id,)).fetchone()
            return _worker(r) if r else None

        return await self._run(get, self._conn)

    async def list_workers(self) -> list[WorkerRow]:
        sql = f"SELECT {WORKER_COLUMNS} FROM workers ORDER BY id"
        return await self._run(lambda: [_worker(r) for r in self._conn.execute(sql)])

    async def running_by_worker(self) -> dict[str, int]:
        sql = "SELECT worker_id, COUNT(*) FROM tasks WHERE state = 3 GROUP BY worker_id"
        return await self._run(lambda: {r[0]: r[1] for r in self._conn.execute(sql)})

    async def reap_workers(self, seen_before: int) -> list[str]:
        sql = "DELETE FROM workers WHERE last_seen_at < ? RETURNING id"
        return await self._tx(lambda db: [r[0] for r in db.execute(sql, (seen_before,))])

    # -- paused pools ---------------------------------------------------------

    async def set_pool_paused(self, pool: str, paused: bool, now: int, by: str) -> PoolPause:
        sql = POOL_PAUSE_UPSERT.format(s="", p1="?", p2="?", p3="?", p4="?")
        values = pool_pause_values(pool, paused, now, by)
        return await self._tx(lambda db: pool_pause(db.execute(sql, values).fetchone()))

    async def paused_pools(self) -> list[PoolPause]:
        sql = f"SELECT {POOL_PAUSE_COLUMNS} FROM pools WHERE paused ORDER BY name"
        return await self._run(lambda: [pool_pause(r) for r in self._conn.execute(sql)])

    # -- schedules ------------------------------------------------------------

    async def put_schedule(self, schedule: ScheduleRow, now: int) -> ScheduleRow:
        values = schedule_values(schedule, now)
        sql = f"INSERT INTO schedules ({SCHEDULE_COLUMNS}) VALUES ({_marks(len(values))})" + SCHEDULE_UPSERT
        return await self._tx(lambda db: schedule_row(db.execute(sql, values).fetchone()))

    async def delete_schedule(self, pool: str, name: str) -> bool:
        sql = "DELETE FROM schedules WHERE pool = ? AND name = ?"
        return bool(await self._tx(lambda db: db.execute(sql, (pool, name)).rowcount))

    async def list_schedules(self, pools: list[str] | None) -> list[ScheduleRow]:
        where, params = "", list[Any]()
        if pools is not None:
            where, params = f" WHERE pool IN ({_marks(len(pools))})", list(pools)
        sql = f"SELECT {SCHEDULE_COLUMNS} FROM schedules{where} ORDER BY pool, name"
        return await self._run(lambda: [schedule_row(r) for r in self._conn.execute(sql, params)])

    async def due_schedules(self, now: int, limit: int) -> tuple[list[ScheduleRow], int | None]:
        def due() -> tuple[list[ScheduleRow], int | None]:
            db = self._conn
            sql = (
                f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE paused = 0 AND next_fire_at <= ?"
                " ORDER BY next_fire_at LIMIT ?"
            )
            rows = [schedule_row(r) for r in db.execute(sql, (now, limit))]
            sql = "SELECT MIN(next_fire_at) FROM schedules WHERE paused = 0 AND next_fire_at > ?"
            return rows, db.execute(sql, (now,)).fetchone()[0]

        return await self._run(due)

    async def fire_schedule(
        self, schedule: ScheduleRow, tasks: list[NewTask], last_fire_at: int, next_fire_at: int | None, now: int
    ) -> tuple[list[Submitted], Changes] | None:
        return await self._tx(self._fire_schedule, schedule, tasks, last_fire_at, next_fire_at, now)

    def _fire_schedule(
        self,
        db: sqlite3.Connection,
        schedule: ScheduleRow,
        tasks: list[NewTask],
        last_fire_at: int,
        next_fire_at: int | None,
        now: int,
    ) -> tuple[list[Submitted], Changes] | None:
        # The guard: a duplicate or stale fire, or a Put since the read, moves nothing.
        moved = db.execute(
            "UPDATE schedules SET last_fire_at = ?, next_fire_at = ? WHERE pool = ? AND name = ? AND paused = 0"
            " AND next_fire_at = ? AND updated_at = ?",
            (last_fire_at, next_fire_at, schedule.pool, schedule.name, schedule.next_fire_at, schedule.updated_at),
        ).rowcount
        if not moved:
            return None
        out: list[Submitted] = []
        changes: Changes = []
        for task in tasks:
            try:
                subs, created = self._submit(db, [task], now, None, None)
            except ApiError as err:
                if key_in_another_pool(err):
                    continue
                raise
            out += subs
            changes += created
        return out, changes


def _column_exists(db: sqlite3.Connection, statement: str) -> bool:
    """Whether statement adds a column its table already has (see _ADD_COLUMN)."""
    add = _ADD_COLUMN.match(statement)
    return add is not None and any(row[1] == add.group(2) for row in db.execute(f"PRAGMA table_info({add.group(1)})"))
