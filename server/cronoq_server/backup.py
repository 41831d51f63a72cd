"""`cronoq-server backup` and `restore`: a consistent copy of a live SQLite store, and putting one
back in a stopped store's place (docs/operations.md).

SQLite's online backup API copies the store in one read transaction: the copy is the store as
of one commit, and in WAL mode the leader goes on writing meanwhile. PostgreSQL stores are
backed up with pg_dump.

A copy is marked as a backup (meta `backup_taken_at`). Tasks the store was given after the copy
are lost by a restore, but clients may still hold their ids: a restored store hands out ids from
past every id the replaced store could have given (`settle_restored`), whether `restore` put it
in place or the server finds the mark on its first start.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .config import Config
from .leader import FileLeadership

# meta key of a backup copy: when its snapshot was read (unix microseconds).
BACKUP_TAKEN_AT = "backup_taken_at"
# More task ids a second than a SQLite store submits (tens of thousands a second): a restored
# store skips this many for every second since its backup was taken...
RESTORE_IDS_PER_SECOND = 1_000_000
# ...and this many more, so a restore moments after the backup also skips ahead.
RESTORE_IDS_SKIPPED = 1_000_000
# The files SQLite keeps beside a database and the leadership's beside it (leader.py).
_STORE_FILES = {
    "-wal": "the store's write-ahead log",
    "-shm": "the store's shared-memory index",
    "-journal": "the store's rollback journal",
    ".leader": "the store's leadership lock",
}


class BackupError(Exception):
    """A backup or restore that cannot be made; the message is one line."""


def store_path(config: Config, shard: str | None, config_path: str) -> Path:
    """The SQLite file of the shard served with these --config and --shard."""
    if config.store.kind == "postgres":
        schema = (config.store.schema_ or ("cronoq_{shard}" if config.sharded else "cronoq")).replace(
            "{shard}", shard or "{shard}"
        )
        raise BackupError(
            f"store.kind is postgres: back up its schema with pg_dump --schema={schema} --format=custom "
            "(see docs/operations.md)"
        )
    names = [s.name for s in config.shards]
    if names and shard not in names:
        raise BackupError(f"{config_path}: shards: --shard is required with [[shards]] (one of: {', '.join(names)})")
    if not names and shard is not None:
        raise BackupError(f"{config_path}: shards: --shard {shard!r} given but the file has no [[shards]]")
    return Path(config.store.path.replace("{shard}", shard or ""))


def _store_file(store: str, folder: str, name: str) -> tuple[str, str] | None:
    """What file of the store at `store` the entry `name` of `folder` is, and its path; None if none."""
    for where in {os.path.abspath(store), os.path.realpath(store)}:  # the lock is beside the path given
        if not _same_file(folder, os.path.dirname(where)):
            continue
        base = os.path.basename(where)
        if name == base:
            return "the store", where
        for suffix, what in _STORE_FILES.items():
            if name == base + suffix:
                return what, where + suffix
        if name.startswith(base + ".leader.standby-"):
            return "a standby's file of the store's leadership", os.path.join(os.path.dirname(where), name)
        if name.startswith(base + "-"):
            return "a file SQLite keeps beside the store", os.path.join(os.path.dirname(where), name)
    return None


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def refuse_store_files(config: Config, flag: str, path: Path, why: str) -> None:
    """Refuses a path that is, or resolves to (symlinks, `..`, a hard link), a file that a store
    of this config (any shard's) or its leadership uses."""
    folder, name = os.path.split(os.path.realpath(path))
    stores = [config.store.path.replace("{shard}", s.name) for s in config.shards] or [config.store.path]
    for store in stores:
        found = _store_file(store, folder, name)
        if found is None and os.path.exists(path):
            for where in {os.path.abspath(store), os.path.realpath(store)}:
                for suffix in ("", *_STORE_FILES):
                    if _same_file(path, where + suffix):
                        found = _store_file(store, os.path.dirname(where), os.path.basename(where) + suffix)
        if found is not None:
            raise BackupError(f"{flag} {path}: is {found[0]} {found[1]} ({why})")


@contextlib.contextmanager
def _private_file(beside: Path) -> Iterator[Path]:
    """A new empty file (mode 0600) in a folder of its own beside `beside`, removed with the
    folder unless renamed away: nothing planted in a shared folder is followed or written."""
    folder = tempfile.mkdtemp(prefix=f".{beside.name}.partial-", dir=beside.parent)
    try:
        path = Path(folder) / beside.name
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _fsync_into_place(partial: Path, target: Path) -> None:
    with open(partial, "rb") as f:
        os.fsync(f.fileno())
    os.replace(partial, target)
    with contextlib.suppress(OSError):
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _blames_target(err: sqlite3.Error) -> bool:
    """Whether a failed backup step failed writing the copy: the store is only read."""
    code = getattr(err, "sqlite_errorcode", 0)
    return code & 0xFF == sqlite3.SQLITE_FULL or code in _WRITE_ERRORS


_WRITE_ERRORS = {
    getattr(sqlite3, name, -1)
    for name in ("SQLITE_IOERR_WRITE", "SQLITE_IOERR_FSYNC", "SQLITE_IOERR_TRUNCATE", "SQLITE_IOERR_DIR_FSYNC")
}


def backup_sqlite(source: Path, target: Path, force: bool = False) -> str:
    """Copies source to target (written beside it, then renamed into place); returns a summary."""
    if not source.is_file():
        raise BackupError(f"store {source}: no such file (is --config the server's?)")
    if os.path.lexists(target) and not force:
        raise BackupError(f"--to {target}: exists (give --force to replace it)")
    blame = f"store {source}"
    try:
        with _private_file(target) as partial:
            # mode=rw: never create an empty store where the path is wrong.
            uri = f"{source.absolute().as_uri()}?mode=rw"
            with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=30)) as src:
                src.execute("PRAGMA query_only = 1")
                with contextlib.closing(sqlite3.connect(partial, isolation_level=None)) as dst:
                    taken_at = time.time_ns() // 1000  # before the snapshot: an earlier time skips more ids
                    try:
                        src.backup(dst)  # every page in one step: one snapshot, not restarted by writes
                    except sqlite3.Error as err:
                        if _blames_target(err):
                            blame = f"--to {target}"
                        raise
                    blame = f"--to {target}"
                    check = dst.execute("PRAGMA integrity_check").fetchone()[0]
                    if check != "ok":
                        raise BackupError(f"--to {target}: the copy fails integrity_check: {check}")
                    version = dst.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
                    tasks = dst.execute("SELECT count(*) FROM tasks").fetchone()[0]
                    dst.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (BACKUP_TAKEN_AT, str(taken_at)))
                    dst.execute("PRAGMA journal_mode = DELETE")  # one file: no -wal to lose beside it
            _fsync_into_place(partial, target)
    except sqlite3.Error as err:
        raise BackupError(f"{blame}: {err}") from None
    except OSError as err:
        raise BackupError(f"--to {target}: {(err.strerror or type(err).__name__).lower()}") from None
    return f"backed up store {source} to {target}: {tasks} tasks, schema version {version}"


def settle_restored(db: sqlite3.Connection, at_least: int = 0) -> int | None:
    """On a backup copy: moves the task id sequence past every id the store it was copied from
    could have given since (and past `at_least`), and unmarks it; returns the new highest seq.
    None (nothing done) on a store that is not a backup."""
    row = db.execute("SELECT value FROM meta WHERE key = ?", (BACKUP_TAKEN_AT,)).fetchone()
    if row is None:
        return None
    seconds = max(0, time.time_ns() // 1000 - int(row[0])) // 1_000_000 + 1
    found = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'tasks'").fetchone()
    highest = max((found[0] if found else 0) + RESTORE_IDS_SKIPPED + RESTORE_IDS_PER_SECOND * seconds, at_least)
    if found:
        db.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'tasks'", (highest,))
    else:
        db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('tasks', ?)", (highest,))
    db.execute("DELETE FROM meta WHERE key = ?", (BACKUP_TAKEN_AT,))
    return int(highest)


def _replaced_seq(store: Path) -> tuple[int, str]:
    """The highest task seq the store being replaced gave, folding its WAL into the file so it can
    be moved aside whole; (0, why) when it cannot be read."""
    try:
        with contextlib.closing(sqlite3.connect(f"{store.absolute().as_uri()}?mode=rw", uri=True, timeout=5)) as db:
            found = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'tasks'").fetchone()
            db.execute("PRAGMA journal_mode = DELETE")
            return (int(found[0]) if found else 0), ""
    except sqlite3.Error as err:
        return 0, f" (unreadable: {err}; ids skipped by time since the backup alone)"


def _move_aside(store: Path) -> Path | None:
    """Renames the store and the files SQLite keeps beside it to STORE.replaced-TIME (None: none)."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    aside = store.with_name(f"{store.name}.replaced-{stamp}")
    moved = False
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.rename(f"{store}{suffix}", f"{aside}{suffix}")
            moved = True
    return aside if moved else None


def restore_sqlite(store: Path, source: Path) -> str:
    """Puts the backup `source` in the stopped store's place; returns a summary."""
    if not source.is_file():
        raise BackupError(f"--from {source}: no such file")
    lock = FileLeadership(str(store), advertise="")
    blame = f"--from {source}"
    try:
        with _private_file(store) as partial:
            with open(source, "rb") as src, open(partial, "r+b") as dst:
                shutil.copyfileobj(src, dst)
            if not asyncio.run(lock.try_acquire()):
                raise BackupError(
                    f"store {store}: a server of the shard holds its leadership lock {lock.path} "
                    "(stop every server of the shard first)"
                )
            try:
                standbys = asyncio.run(lock.standbys())
                if standbys:
                    raise BackupError(
                        f"store {store}: standby {standbys[0]} is waiting for its leadership "
                        "(stop every server of the shard first)"
                    )
                with contextlib.closing(sqlite3.connect(partial, isolation_level=None)) as db:
                    check = db.execute("PRAGMA integrity_check").fetchone()[0]
                    if check != "ok":
                        raise BackupError(f"--from {source}: fails integrity_check: {check}")
                    marked = db.execute("SELECT 1 FROM meta WHERE key = ?", (BACKUP_TAKEN_AT,)).fetchone()
                    if marked is None:
                        raise BackupError(
                            f"--from {source}: not a cronoq-server backup (its meta has no {BACKUP_TAKEN_AT})"
                        )
                    tasks = db.execute("SELECT count(*) FROM tasks").fetchone()[0]
                    replaced, unreadable = _replaced_seq(store) if store.exists() else (0, "")
                    blame = f"store {store}"
                    db.execute("BEGIN IMMEDIATE")
                    highest = settle_restored(db, replaced)
                    db.execute("COMMIT")
                aside = _move_aside(store)
                _fsync_into_place(partial, store)
            finally:
                asyncio.run(lock.release())
    except sqlite3.Error as err:
        raise BackupError(f"{blame}: {err}") from None
    except OSError as err:
        raise BackupError(f"store {store}: {(err.strerror or type(err).__name__).lower()}") from None
    kept = f"the replaced store is {aside}{unreadable}" if aside else "there was no store to replace"
    return f"restored store {store} from {source}: {tasks} tasks; {kept}; task seqs continue after {highest}"


def run_backup(config: Config, config_path: str, shard: str | None, target: str, force: bool) -> int:
    """The subcommand: 0 when the copy is in place, 2 when refused (one line on stderr)."""
    try:
        why = "a backup never replaces a file of a store or of its leadership, even with --force"
        refuse_store_files(config, "--to", Path(target), why)
        print(backup_sqlite(store_path(config, shard, config_path), Path(target), force))
    except BackupError as err:
        print(f"cronoq-server backup: {err}", file=sys.stderr)
        return 2
    return 0


def run_restore(config: Config, config_path: str, shard: str | None, source: str) -> int:
    """The subcommand: 0 when the backup is in the store's place, 2 when refused (one line on stderr)."""
    try:
        if config.store.kind == "postgres":
            raise BackupError("store.kind is postgres: restore its schema with pg_restore (see docs/operations.md)")
        store = store_path(config, shard, config_path)
        refuse_store_files(config, "--from", Path(source), "restore from a backup, never from a file the store uses")
        print(restore_sqlite(store, Path(source)))
    except BackupError as err:
        print(f"cronoq-server restore: {err}", file=sys.stderr)
        return 2
    return 0
