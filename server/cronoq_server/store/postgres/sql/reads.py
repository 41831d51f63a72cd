"""The statements of reads.py."""

from __future__ import annotations

from ...base import ATTEMPT_COLUMNS

# The dependents of task $1 (seq and pool), in seq order, at most $2.
DEPENDENTS = (
    "SELECT d.task_seq, t.pool FROM {s}.deps d JOIN {s}.tasks t ON t.seq = d.task_seq"
    " WHERE d.dep_seq = $1 ORDER BY d.task_seq LIMIT $2"
)

# What a dependent reads of the tasks $1 it depends on.
DEPENDENCY_ROWS = (
    "SELECT seq, key, state, result, result_content_type, error FROM {s}.tasks WHERE seq = ANY($1::bigint[])"
)

# When the oldest due PENDING task of pool $1 (due at $2) became due.
OLDEST_DUE_PENDING = (
    "SELECT greatest(run_at, created_at) FROM {s}.tasks WHERE state = 1 AND pool = $1 AND run_at <= $2"
    " ORDER BY run_at LIMIT 1"
)

COUNT_BY_POOL_AND_STATE = "SELECT pool, state, count(*) FROM {s}.tasks GROUP BY pool, state"

_PENDING_BY_GROUP = "SELECT group_key, count(*) AS n FROM {s}.tasks WHERE state = 1 AND pool = $1"
# The PENDING tasks of pool $1 counted by group: the $2 largest groups, and those named in $3.
PENDING_BY_GROUP = (
    f"(SELECT * FROM ({_PENDING_BY_GROUP} GROUP BY group_key ORDER BY n DESC, group_key LIMIT $2) AS top)"
    f" UNION (SELECT * FROM ({_PENDING_BY_GROUP} AND group_key = ANY($3::text[]) GROUP BY group_key) AS named)"
)

# The attempts of task $1, in order.
ATTEMPTS = f"SELECT {ATTEMPT_COLUMNS} FROM {{s}}.attempts WHERE task_seq = $1 ORDER BY attempt, ended_at"
