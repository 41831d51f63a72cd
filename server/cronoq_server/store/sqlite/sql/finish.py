"""SQL of finish.py: ended attempts, retries, releases and snoozes, dependents and expired leases."""

from __future__ import annotations

from ...base import ATTEMPT_COLUMNS
from ...logic import OUTCOME_COLUMNS
from . import marks

# An ended attempt (ATTEMPT_COLUMNS).
INSERT_ATTEMPT = f"INSERT INTO attempts ({ATTEMPT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
# A task ended by its attempt (state, result, result_content_type, error, finished_at, seq).
END_TASK = (
    "UPDATE tasks SET state = ?, result = ?, result_content_type = ?, error = ?, finished_at = ?,"
    " lease_expires_at = NULL WHERE seq = ?"
)
# Failed BLOCKED dependents, unless already ended (state, error, finished_at, seq).
END_DEPENDENT = "UPDATE tasks SET state = ?, error = ?, finished_at = ? WHERE seq = ? AND state = 2"
# The RUNNING tasks whose lease expired before now.
EXPIRED_LEASES = f"SELECT {OUTCOME_COLUMNS} FROM tasks WHERE state = 3 AND lease_expires_at < ?"
# A success's spawned tasks are created, or none of them, in a savepoint of their own.
SAVEPOINT_SPAWN = "SAVEPOINT spawn"
ROLLBACK_TO_SPAWN = "ROLLBACK TO spawn"
RELEASE_SPAWN = "RELEASE spawn"
# For count_done: of the dependents, the finalizers only (run_when 2).
FINALIZERS_ONLY = " AND t.run_when = 2"


def outcome_rows(seqs: int) -> str:
    """What deciding an outcome reads of these tasks (their seqs)."""
    return f"SELECT {OUTCOME_COLUMNS} FROM tasks WHERE seq IN ({marks(seqs)})"


def retry_later(rank_reset: str) -> str:
    """A failed attempt retried: PENDING at (run_at, error, seq); rank_reset: fair.rank_reset."""
    return (
        "UPDATE tasks SET state = 1, run_at = ?, error = ?, worker_id = NULL, lease_expires_at = NULL,"
        f" {rank_reset} WHERE seq = ?"
    )


def release(rank_keep: str) -> str:
    """A released attempt never ran (seq): PENDING again, its attempt not counted; rank_keep: fair.rank_keep."""
    return (
        "UPDATE tasks SET state = 1, attempt = attempt - 1, worker_id = NULL, started_at = NULL,"
        f" lease_expires_at = NULL, {rank_keep} WHERE seq = ?"
    )


def snooze(rank_reset: str) -> str:
    """A snoozed attempt (run_at, seq): PENDING later, counted as a snooze, not an attempt."""
    return (
        "UPDATE tasks SET state = 1, run_at = ?, attempt = attempt - 1, snoozes = snoozes + 1, worker_id = NULL,"
        f" started_at = NULL, lease_expires_at = NULL, {rank_reset} WHERE seq = ?"
    )


def done_dependents(seqs: int, only: str) -> str:
    """The BLOCKED dependents of these tasks (their seqs), with how many of them they depend on;
    only: "" or FINALIZERS_ONLY."""
    return (
        f"SELECT d.task_seq, COUNT(*) FROM deps d JOIN tasks t ON t.seq = d.task_seq"
        f" WHERE d.dep_seq IN ({marks(seqs)}) AND t.state = 2{only} GROUP BY d.task_seq"
    )


def count_done(seqs: int) -> str:
    """A dependent (its seq, then these tasks' seqs, then its seq again) waits for these tasks no more."""
    return (
        "UPDATE tasks SET blocked_on = blocked_on"
        f" - (SELECT COUNT(*) FROM deps WHERE task_seq = ? AND dep_seq IN ({marks(seqs)}))"
        " WHERE seq = ?"
    )


def unblock(seqs: int, rank_reset: str) -> str:
    """Those of these BLOCKED tasks (their seqs) that wait for nothing more become PENDING."""
    return (
        f"UPDATE tasks SET state = 1, {rank_reset} WHERE state = 2 AND blocked_on <= 0"
        f" AND seq IN ({marks(seqs)}) RETURNING seq"
    )


def failing_dependents(seqs: int) -> str:
    """The BLOCKED dependents of these ended tasks (their seqs) but finalizers, each with the first
    of them it depends on."""
    return (
        f"SELECT d.task_seq, MIN(d.dep_seq) FROM deps d JOIN tasks t ON t.seq = d.task_seq"
        f" WHERE d.dep_seq IN ({marks(seqs)}) AND t.state = 2 AND t.run_when <> 2"
        " GROUP BY d.task_seq"
    )
