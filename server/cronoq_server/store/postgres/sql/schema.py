"""The statements of schema.py that open the store (its MIGRATIONS are data there)."""

from __future__ import annotations

# The estimated rows of table $1 (0 when never analyzed).
# The PENDING tasks (up to 1,000,000: what the analyzer compares submissions with), by tasks_due.
PENDING_ROWS = "SELECT count(*) FROM (SELECT 1 FROM {s}.tasks WHERE state = 1 LIMIT 1000000) AS p"

# Migrations of schema $1 (its name, hashed) go one at a time, until this transaction ends.
MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"

CREATE_SCHEMA = "CREATE SCHEMA IF NOT EXISTS {s}"

CREATE_MIGRATIONS = (
    "CREATE TABLE IF NOT EXISTS {s}.migrations (version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
)

APPLIED_VERSIONS = "SELECT version FROM {s}.migrations"

# Migration $1 is applied.
RECORD_MIGRATION = "INSERT INTO {s}.migrations (version) VALUES ($1)"

SCHEMA_VERSION = "SELECT max(version) FROM {s}.migrations"

READ_META = "SELECT key, value FROM {s}.meta"

# Records meta key $1 as $2 unless it has a value.
WRITE_META = "INSERT INTO {s}.meta VALUES ($1, $2) ON CONFLICT DO NOTHING"
