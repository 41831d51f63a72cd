"""SQL of schema.py (the migrations aside): opening a store, its version and its owner."""

from __future__ import annotations

JOURNAL_WAL = "PRAGMA journal_mode=WAL"
HAS_META = "SELECT 1 FROM sqlite_master WHERE name='meta'"
READ_META = "SELECT key, value FROM meta"
SCHEMA_VERSION = "SELECT value FROM meta WHERE key = 'schema_version'"
# The version migrated to (text).
SET_SCHEMA_VERSION = "INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)"
# The shard owning the store, written once (name; number as text).
CLAIM_SHARD_NAME = "INSERT OR IGNORE INTO meta VALUES ('shard_name', ?)"
CLAIM_SHARD_NUMBER = "INSERT OR IGNORE INTO meta VALUES ('shard_number', ?)"


def synchronous(mode: str) -> str:
    return f"PRAGMA synchronous={mode}"


def table_info(table: str) -> str:
    return f"PRAGMA table_info({table})"
