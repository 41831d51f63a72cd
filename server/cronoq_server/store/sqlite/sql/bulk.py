"""SQL of bulk.py: actions on many tasks (cancel, expire, match, retry, delete)."""

from __future__ import annotations

from . import marks

# The PENDING and BLOCKED tasks past their start_by (now, how many), earliest first; and ending one.
EXPIRED_NOW = (
    "SELECT seq, state FROM tasks INDEXED BY tasks_start_by WHERE start_by <= ? AND state IN (1, 2)"
    " ORDER BY start_by, seq LIMIT ?"
)
EXPIRE = "UPDATE tasks SET state = 7, error = ?, finished_at = ?, blocked_on = 0 WHERE seq = ?"
# A task not started ends CANCELLED (finished_at, seq); a RUNNING one is asked to stop (seq).
CANCEL_UNSTARTED = "UPDATE tasks SET state = 6, error = 'cancelled', finished_at = ? WHERE seq = ?"
REQUEST_CANCEL = "UPDATE tasks SET cancel_requested = 1 WHERE seq = ?"
# A restored dependent waits again (blocked_on, seq); a renamed one's error (error, seq).
RESTORE = "UPDATE tasks SET state = 2, blocked_on = ?, error = '', finished_at = NULL WHERE seq = ?"
SET_ERROR = "UPDATE tasks SET error = ? WHERE seq = ?"


def workflow_below(seqs: int) -> str:
    """The tasks these (their seqs, twice) spawned or that depend on them, with their pools."""
    in_seqs = marks(seqs)
    return (
        f"SELECT seq, pool FROM tasks WHERE parent_seq IN ({in_seqs}) UNION SELECT d.task_seq, t.pool"
        f" FROM deps d JOIN tasks t ON t.seq = d.task_seq WHERE d.dep_seq IN ({in_seqs})"
    )


def cancellable(seqs: int) -> str:
    """Those of these tasks (their seqs) a cancel changes: not started, or RUNNING and not yet asked."""
    return (
        f"SELECT seq, state FROM tasks WHERE seq IN ({marks(seqs)})"
        " AND (state IN (1, 2) OR (state = 3 AND cancel_requested = 0))"
    )


def matching(where: str) -> str:
    """The tasks a filter's where-clause (logic.match_sql) picks: seq, state and pool."""
    return f"SELECT seq, state, pool FROM tasks WHERE {where}"


def retryable(seqs: int) -> str:
    """Those of these tasks (their seqs) that ended otherwise than in success."""
    return f"SELECT seq, state, attempt, max_attempts FROM tasks WHERE seq IN ({marks(seqs)}) AND state IN (5, 6, 7)"


def retry(rank_reset: str) -> str:
    """An ended task starts over (state, run_at, max_attempts, blocked_on, seq); rank_reset: fair.rank_reset."""
    return (
        "UPDATE tasks SET state = ?, run_at = ?, max_attempts = ?, blocked_on = ?, error = '', result = NULL,"
        " result_content_type = '', finished_at = NULL, worker_id = NULL, started_at = NULL,"
        f" lease_expires_at = NULL, cancel_requested = 0, start_by = NULL, {rank_reset} WHERE seq = ?"
    )


def restorable_dependents(seqs: int) -> str:
    """The dependents of these tasks (their seqs) that ended never started."""
    return (
        "SELECT t.seq, t.state, t.error, t.pool FROM deps d JOIN tasks t ON t.seq = d.task_seq"
        f" WHERE d.dep_seq IN ({marks(seqs)}) AND t.state IN (5, 6, 7) AND t.attempt = 0"
    )


def wait_again(seqs: int) -> str:
    """The waiting finalizers of these retried tasks (their seqs, twice) count them as not done."""
    in_seqs = marks(seqs)
    return (
        "UPDATE tasks SET blocked_on = blocked_on + (SELECT COUNT(*) FROM deps"
        f" WHERE deps.task_seq = tasks.seq AND deps.dep_seq IN ({in_seqs}))"
        " WHERE state = 2 AND run_when = 2 AND seq IN (SELECT task_seq FROM deps"
        f" WHERE dep_seq IN ({in_seqs}))"
    )


def dep_states(seqs: int) -> str:
    """The stored dependencies of these tasks (their seqs), with their states."""
    return (
        "SELECT d.task_seq, d.dep_seq, t.state FROM deps d JOIN tasks t ON t.seq = d.dep_seq"
        f" WHERE d.task_seq IN ({marks(seqs)})"
    )


def delete_ended(seqs: int) -> str:
    """Those of these tasks (their seqs) that ended."""
    return f"DELETE FROM tasks WHERE seq IN ({marks(seqs)}) AND state IN (4, 5, 6, 7) RETURNING seq"
