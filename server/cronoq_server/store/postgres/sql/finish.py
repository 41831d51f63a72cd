"""The statements of finish.py."""

from __future__ import annotations

from ...base import AttemptOutcome
from ...logic import OUTCOME_COLUMNS
from . import _ONCE, INSERT_ATTEMPTS, T_EVENT_TASK_COLUMNS, events_of


def success_ctes(first: int, now: str, worker: str) -> str:
    """The CTEs that end successes while no task is BLOCKED ($first to $first + 3: the
    seqs, attempts, results and their content types), fenced by worker and attempt in
    their WHERE: `ended` returns seq and state. A cancel requested meanwhile still ends
    the task CANCELLED, as decide_outcomes does."""
    a, b, c, d = (f"${first + i}" for i in range(4))
    return (
        "ended AS (UPDATE {s}.tasks t SET state = CASE WHEN t.cancel_requested THEN 6 ELSE 4 END,"
        " result = u.result, result_content_type = u.rct,"
        " error = CASE WHEN t.cancel_requested THEN 'cancelled' ELSE '' END,"
        f" finished_at = {now}, lease_expires_at = NULL"
        f" FROM unnest({a}::bigint[], {b}::int[], {c}::bytea[], {d}::text[]) AS u(seq, attempt, result, rct)"
        f" WHERE t.seq = ANY({a}::bigint[]) AND t.seq = u.seq AND t.state = 3 AND t.attempt = u.attempt"
        f" AND t.worker_id = {worker} AND {{fence}}"
        f" RETURNING t.seq, t.pool, t.state, t.attempt, {T_EVENT_TASK_COLUMNS}),"
        f" ended_ev AS ({events_of('state', 'attempt', f'{now}::bigint', '3', 'ended')}),"
        f" ended_attempts AS ({INSERT_ATTEMPTS} SELECT seq, attempt, worker_id, started_at, {now},"
        f" CASE WHEN state = 6 THEN {int(AttemptOutcome.CANCELLED)} ELSE {int(AttemptOutcome.SUCCEEDED)} END,"
        " error FROM ended)"
    )


# Successes of the fast path ($1 to $4: success_ctes' arrays) ended at $5 by worker $6.
FINISH_SUCCESSES = f"WITH {success_ctes(1, '$5', '$6')} SELECT seq, state FROM ended"


def finish_with(ctes: str, first: int, worker: str) -> str:
    """The statement of a lease's CTEs that also ends successes (success_ctes from $first, now
    at $1, the worker id at the parameter named): one row per leased task, or one without a
    task when none was; the ended tasks ride along as two arrays (_ONCE; none ended and none
    leased: no row, and the term is checked)."""
    return (
        f"WITH {ctes}, {success_ctes(first, '$1', worker)}"
        f" SELECT l.*, {_ONCE.format('e.seqs')}, {_ONCE.format('e.states')} FROM (SELECT array_agg(seq) AS seqs,"
        " array_agg(state) AS states FROM ended) AS e LEFT JOIN leased l ON true"
        " WHERE e.seqs IS NOT NULL OR l.seq IS NOT NULL"
    )


# What finish checks of the tasks $1, locked.
LOCK_OUTCOME_ROWS = f"SELECT {OUTCOME_COLUMNS} FROM {{s}}.tasks WHERE seq = ANY($1::bigint[]) FOR UPDATE"

# What finish checks of the RUNNING tasks whose lease expired before $1, locked (those another
# transaction holds are left to the next sweep).
EXPIRED_LEASES = (
    f"SELECT {OUTCOME_COLUMNS} FROM {{s}}.tasks WHERE state = 3 AND lease_expires_at < $1 FOR UPDATE SKIP LOCKED"
)


def release_unblocked(rank_reset: str) -> str:
    """BLOCKED dependents of the tasks $1 whose every dependency has succeeded become PENDING
    (their rank as rank_reset sets it), with their events at $2: their seqs."""
    return (
        f"WITH changed AS (UPDATE {{s}}.tasks t SET state = 1, blocked_on = 0, {rank_reset}"
        " WHERE t.state = 2 AND t.seq IN (SELECT task_seq FROM {s}.deps WHERE dep_seq = ANY($1::bigint[]))"
        " AND NOT EXISTS (SELECT 1 FROM {s}.deps d JOIN {s}.tasks x ON x.seq = d.dep_seq"
        " WHERE d.task_seq = t.seq AND x.state <> 4 AND (t.run_when <> 2 OR x.state NOT IN (5, 6, 7)))"
        f" RETURNING t.seq, t.pool, t.attempt, {T_EVENT_TASK_COLUMNS}),"
        f" ev AS ({events_of('1', 'attempt', '$2::bigint', '2', 'changed ORDER BY seq')})"
        " SELECT seq FROM changed"
    )


# Ended attempts, one a row of the arrays $1..$7 (ATTEMPT_COLUMNS in order).
INSERT_ATTEMPT_ROWS = (
    f"{INSERT_ATTEMPTS} SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::bigint[],"
    " $5::bigint[], $6::smallint[], $7::text[])"
)

# Tasks ended: task $6[i] in state $1[i] with result $2[i] ($3[i] its content type), error $4[i],
# finished at $5[i].
END_TASKS = (
    "UPDATE {s}.tasks t SET state = u.state, result = u.result, result_content_type = u.rct,"
    " error = u.error, finished_at = u.fin, lease_expires_at = NULL"
    " FROM unnest($1::smallint[], $2::bytea[], $3::text[], $4::text[], $5::bigint[], $6::bigint[])"
    " AS u(state, result, rct, error, fin, seq) WHERE t.seq = u.seq"
)


def retry_later(rank_reset: str) -> str:
    """Tasks PENDING again after a failed attempt: task $3[i] due at $1[i] with error $2[i]."""
    return (
        "UPDATE {s}.tasks t SET state = 1, run_at = u.run_at, error = u.error, worker_id = NULL,"
        f" lease_expires_at = NULL, {rank_reset} FROM unnest($1::bigint[], $2::text[], $3::bigint[])"
        " AS u(run_at, error, seq) WHERE t.seq = u.seq"
    )


def release_attempts(rank_keep: str) -> str:
    """Tasks $1 PENDING again as if their attempt had never started (their rank kept)."""
    return (
        "UPDATE {s}.tasks SET state = 1, attempt = attempt - 1, worker_id = NULL, started_at = NULL,"
        f" lease_expires_at = NULL, {rank_keep} WHERE seq = ANY($1::bigint[])"
    )


def snooze(rank_reset: str) -> str:
    """Snoozed tasks PENDING again, their attempt not counted: task $2[i] due at $1[i]."""
    return (
        "UPDATE {s}.tasks t SET state = 1, run_at = u.run_at, attempt = t.attempt - 1,"
        " snoozes = t.snoozes + 1, worker_id = NULL, started_at = NULL, lease_expires_at = NULL,"
        f" {rank_reset} FROM unnest($1::bigint[], $2::bigint[]) AS u(run_at, seq) WHERE t.seq = u.seq"
    )


# BLOCKED dependents count the tasks done: those $1 (that succeeded) for every one, and those $2
# (ended otherwise) for finalizers; at 0 they are PENDING. Their seqs and states.
UNBLOCK_DEPENDENTS = (
    "WITH dec AS (SELECT d.task_seq, count(*) AS n FROM {s}.deps d"
    " JOIN {s}.tasks w ON w.seq = d.task_seq WHERE w.state = 2"
    " AND (d.dep_seq = ANY($1::bigint[]) OR (w.run_when = 2 AND d.dep_seq = ANY($2::bigint[])))"
    " GROUP BY d.task_seq)"
    " UPDATE {s}.tasks t SET blocked_on = t.blocked_on - dec.n,"
    " state = CASE WHEN t.blocked_on - dec.n <= 0 THEN 1 ELSE 2 END"
    " FROM dec WHERE t.seq = dec.task_seq AND t.state = 2 RETURNING t.seq, t.state"
)

# The BLOCKED dependents (not finalizers) of the tasks $1, each with its first dependency of them.
ENDING_DEPENDENTS = (
    "SELECT d.task_seq, min(d.dep_seq) FROM {s}.deps d JOIN {s}.tasks t ON t.seq = d.task_seq"
    " WHERE d.dep_seq = ANY($1::bigint[]) AND t.state = 2 AND t.run_when <> 2 GROUP BY d.task_seq"
)

# BLOCKED tasks $3 ended in state $1 at $2, task $3[i] with error $4[i].
END_DEPENDENTS = (
    "UPDATE {s}.tasks t SET state = $1, error = u.error, finished_at = $2"
    " FROM unnest($3::bigint[], $4::text[]) AS u(seq, error) WHERE t.seq = u.seq AND t.state = 2"
)

ANY_BLOCKED = "SELECT EXISTS (SELECT 1 FROM {s}.tasks WHERE state = 2)"
