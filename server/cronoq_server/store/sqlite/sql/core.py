"""SQL of core.py: the group commit's transaction and each write's savepoint."""

from __future__ import annotations

BEGIN_IMMEDIATE = "BEGIN IMMEDIATE"
SAVEPOINT_OP = "SAVEPOINT op"
RELEASE_OP = "RELEASE op"
ROLLBACK_TO_OP = "ROLLBACK TO op"
ROLLBACK = "ROLLBACK"
