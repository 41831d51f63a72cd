"""`cronoq-server backup`: a consistent copy of a live SQLite store (docs/operations.md).

SQLite's online backup API copies the store in one read transaction: the copy is the store as
of one commit, and in WAL mode the leader goes on writing meanwhile. PostgreSQL stores are
backed up with pg_dump.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sys
from pathlib import Path

from .config import Config


class BackupError(Exception):
    """A backup that cannot be made; the message is one line."""


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


def backup_sqlite(source: Path, target: Path, force: bool = False) -> str:
    """Copies source to target (written beside it, then renamed into place); returns a summary."""
    if not source.is_file():
        raise BackupError(f"store {source}: no such file (is --config the server's?)")
    if target.exists() and not force:
        raise BackupError(f"--to {target}: exists (give --force to replace it)")
    if target.exists() and target.resolve() == source.resolve():
        raise BackupError(f"--to {target}: is the store itself")
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        # mode=rw: never create an empty store where the path is wrong.
        with contextlib.closing(sqlite3.connect(f"{source.absolute().as_uri()}?mode=rw", uri=True, timeout=30)) as src:
            src.execute("PRAGMA query_only = 1")
            with contextlib.closing(sqlite3.connect(partial)) as dst:
                src.backup(dst)  # every page in one step: one snapshot, not restarted by writes
                check = dst.execute("PRAGMA integrity_check").fetchone()[0]
                if check != "ok":
                    raise BackupError(f"--to {target}: the copy fails integrity_check: {check}")
                version = dst.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
                tasks = dst.execute("SELECT count(*) FROM tasks").fetchone()[0]
                dst.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, target)
        with contextlib.suppress(OSError):
            directory = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
    except sqlite3.Error as err:
        raise BackupError(f"store {source}: {err}") from None
    except OSError as err:
        raise BackupError(f"--to {target}: {(err.strerror or type(err).__name__).lower()}") from None
    finally:
        for leftover in (partial, Path(f"{partial}-wal"), Path(f"{partial}-shm"), Path(f"{partial}-journal")):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    return f"backed up store {source} to {target}: {tasks} tasks, schema version {version}"


def run_backup(config: Config, config_path: str, shard: str | None, target: str, force: bool) -> int:
    """The subcommand: 0 when the copy is in place, 2 when refused (one line on stderr)."""
    try:
        print(backup_sqlite(store_path(config, shard, config_path), Path(target), force))
    except BackupError as err:
        print(f"cronoq-server backup: {err}", file=sys.stderr)
        return 2
    return 0
