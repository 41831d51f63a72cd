"""The statements of bulk.py."""

from __future__ import annotations

from . import DELETE_WITH_TASKS

# The children (parent_seq) and dependents of the tasks $1: seq and pool.
CHILDREN_AND_DEPENDENTS = (
    "SELECT seq, pool FROM {s}.tasks WHERE parent_seq = ANY($1::bigint[])"
    " UNION SELECT d.task_seq, t.pool FROM {s}.deps d JOIN {s}.tasks t ON t.seq = d.task_seq"
    " WHERE d.dep_seq = ANY($1::bigint[])"
)

# The tasks $1 a cancel changes (not started, or RUNNING without a cancel requested): seq and
# state, locked in seq order, as every change of several tasks does: no deadlock between them.
LOCK_CANCELLABLE = (
    "SELECT seq, state FROM {s}.tasks WHERE seq = ANY($1::bigint[])"
    " AND (state IN (1, 2) OR (state = 3 AND NOT cancel_requested)) ORDER BY seq FOR UPDATE"
)

# The tasks $2, not started, end CANCELLED at $1.
CANCEL_UNSTARTED = "UPDATE {s}.tasks SET state = 6, error = 'cancelled', finished_at = $1 WHERE seq = ANY($2::bigint[])"

# The RUNNING tasks $1 are asked to stop.
REQUEST_CANCEL = "UPDATE {s}.tasks SET cancel_requested = true WHERE seq = ANY($1::bigint[])"

# The PENDING and BLOCKED tasks past their start_by (now $1, at most $2), earliest first, locked
# (a lease that holds one is taking it: it started in time); and ending them (error $2, seqs $3).
EXPIRING = (
    "SELECT seq, state FROM {s}.tasks WHERE start_by <= $1 AND state IN (1, 2)"
    " ORDER BY start_by, seq LIMIT $2 FOR UPDATE SKIP LOCKED"
)
EXPIRE = "UPDATE {s}.tasks SET state = 7, error = $2, finished_at = $1, blocked_on = 0 WHERE seq = ANY($3::bigint[])"


def matching(where: str) -> str:
    """The tasks (seq, state, pool) that meet the condition where (logic.match_sql's)."""
    return f"SELECT seq, state, pool FROM {{s}}.tasks WHERE {where}"


# The tasks $1 a retry may change (ended otherwise than SUCCEEDED), locked in seq order.
LOCK_RETRYABLE = (
    "SELECT seq, state, attempt, max_attempts FROM {s}.tasks WHERE seq = ANY($1::bigint[])"
    " AND state IN (5, 6, 7) ORDER BY seq FOR UPDATE"
)


def retry_ended(rank_reset: str) -> str:
    """Retried tasks: task $5[i] in state $1[i], due at $2[i], with $3[i] attempts at most and
    $4[i] dependencies to wait for (its rank as rank_reset sets it)."""
    return (
        "UPDATE {s}.tasks t SET state = u.state, run_at = u.run_at, max_attempts = u.max_attempts,"
        " blocked_on = u.blocked_on, error = '', result = NULL, result_content_type = '',"
        " finished_at = NULL, worker_id = NULL, started_at = NULL, lease_expires_at = NULL,"
        # An operator's retry means run it: its start deadline goes.
        f" cancel_requested = false, start_by = NULL, {rank_reset}"
        " FROM unnest($1::smallint[], $2::bigint[], $3::int[], $4::int[], $5::bigint[])"
        " AS u(state, run_at, max_attempts, blocked_on, seq)"
        " WHERE t.seq = u.seq"
    )


# The dependents of the tasks $1 that ended because of them (ended otherwise than SUCCEEDED,
# never started).
ENDED_DEPENDENTS = (
    "SELECT DISTINCT d.task_seq FROM {s}.deps d JOIN {s}.tasks t ON t.seq = d.task_seq"
    " WHERE d.dep_seq = ANY($1::bigint[]) AND t.state IN (5, 6, 7) AND t.attempt = 0"
)

# Of the tasks $1, those a retry may restore (ended, never started): seq, state, error and
# pool, locked in seq order.
LOCK_RESTORABLE = (
    "SELECT seq, state, error, pool FROM {s}.tasks WHERE seq = ANY($1::bigint[]) AND state IN (5, 6, 7)"
    " AND attempt = 0 ORDER BY seq FOR UPDATE"
)

# Restored tasks BLOCKED again: task $2[i] waiting for $1[i] dependencies.
RESTORE_BLOCKED = (
    "UPDATE {s}.tasks t SET state = 2, blocked_on = u.blocked_on, error = '', finished_at = NULL"
    " FROM unnest($1::int[], $2::bigint[]) AS u(blocked_on, seq) WHERE t.seq = u.seq"
)

# Task $2[i]'s error is now $1[i].
SET_ERRORS = (
    "UPDATE {s}.tasks t SET error = u.error FROM unnest($1::text[], $2::bigint[]) AS u(error, seq) WHERE t.seq = u.seq"
)

# A finalizer still waiting counted the tasks $1 as ended: it waits for them again.
WAIT_AGAIN = (
    "WITH inc AS (SELECT d.task_seq, count(*) AS n FROM {s}.deps d JOIN {s}.tasks w ON w.seq = d.task_seq"
    " WHERE d.dep_seq = ANY($1::bigint[]) AND w.state = 2 AND w.run_when = 2 GROUP BY d.task_seq)"
    " UPDATE {s}.tasks t SET blocked_on = t.blocked_on + inc.n FROM inc WHERE t.seq = inc.task_seq"
)

# The dependencies still stored of the tasks $1 (task, dependency, its state), share-locked.
DEPENDENCY_STATES = (
    "SELECT d.task_seq, d.dep_seq, t.state FROM {s}.deps d JOIN {s}.tasks t ON t.seq = d.dep_seq"
    " WHERE d.task_seq = ANY($1::bigint[]) ORDER BY t.seq FOR SHARE OF t"
)

# Deletes the ended tasks among $1, with their dependencies and attempts: their seqs, in order.
DELETE_TASKS = (
    "WITH gone AS (DELETE FROM {s}.tasks WHERE seq = ANY($1::bigint[]) AND state IN (4, 5, 6, 7)"
    f" RETURNING seq),{DELETE_WITH_TASKS}"
    " SELECT seq FROM gone ORDER BY seq"
)
