"""The SQLite store's schema: its migrations, and opening, checking and closing a store."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor

from ...backup import settle_restored
from ..base import StoreOwnedElsewhere, schema_too_new
from .core import SqliteCore, _yield_cpu
from .sql.schema import (
    CLAIM_SHARD_NAME,
    CLAIM_SHARD_NUMBER,
    HAS_META,
    JOURNAL_WAL,
    READ_META,
    SCHEMA_VERSION,
    SET_SCHEMA_VERSION,
    synchronous,
    table_info,
)

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
    # Key modes and start deadlines: a task's start_by (it ends EXPIRED, state 7, unless an
    # attempt starts before), how long its key is held after it ended, and the key it had once
    # that hold is over (key NULL: the key names a newer task). Ended tasks by pool, state and
    # end: retention reads each pool's oldest of a state as one index range.
    12: """
    ALTER TABLE tasks ADD COLUMN start_by INTEGER;
    ALTER TABLE tasks ADD COLUMN key_ttl_ms INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE tasks ADD COLUMN released_key TEXT;
    CREATE INDEX IF NOT EXISTS tasks_start_by ON tasks (start_by) WHERE start_by IS NOT NULL AND state IN (1, 2);
    DROP INDEX IF EXISTS tasks_finished;
    CREATE INDEX tasks_finished ON tasks (pool, state, finished_at) WHERE state IN (4, 5, 6, 7);
    """,
}

# Release 0.1.0 wrote its own schema version (5) whenever it opened a store, also one a newer
# server had migrated: a migration may find its columns already added.
_ADD_COLUMN = re.compile(r"^\s*ALTER TABLE (\w+) ADD COLUMN (\w+)", re.IGNORECASE)


def _column_exists(db: sqlite3.Connection, statement: str) -> bool:
    """Whether statement adds a column its table already has (see _ADD_COLUMN)."""
    add = _ADD_COLUMN.match(statement)
    return add is not None and any(row[1] == add.group(2) for row in db.execute(table_info(add.group(1))))


class Schema(SqliteCore):
    # -- lifecycle ------------------------------------------------------------

    async def open(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        db.execute(JOURNAL_WAL)
        db.execute(synchronous(self._synchronous))
        self._db = db
        self._thread = threading.Thread(target=self._serve_ops, name="cronoq-sqlite", daemon=True)
        self._thread.start()
        self._scans = ThreadPoolExecutor(self.settings.bulk_scans, "cronoq-scan", _yield_cpu)
        await self._tx(self._migrate)

    def _migrate(self, db: sqlite3.Connection) -> None:
        has_meta = db.execute(HAS_META).fetchone()
        version = 0
        if has_meta:
            meta = dict(db.execute(READ_META).fetchall())
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
                db.execute(SET_SCHEMA_VERSION, (str(v),))
        db.execute(CLAIM_SHARD_NAME, (self.settings.shard_name,))
        db.execute(CLAIM_SHARD_NUMBER, (str(self.settings.shard_number),))
        settle_restored(db)  # a backup put in place by hand: no id the replaced store gave is given again

    def _check_version(self, version: int) -> None:
        if version > max(MIGRATIONS):
            raise schema_too_new(f"store {self.path}", version, max(MIGRATIONS))

    async def check_schema(self) -> None:
        self._check_version(int((await self._run(lambda: self._conn.execute(SCHEMA_VERSION).fetchone()))[0]))

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
