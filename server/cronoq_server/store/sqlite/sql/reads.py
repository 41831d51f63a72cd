"""SQL of reads.py: tasks by seq, key or filter, their dependencies, attempts and counts."""

from __future__ import annotations

from ...base import ATTEMPT_COLUMNS, TASK_COLUMNS
from . import marks

# A task's dependents (its seq, how many), with their pools, in seq order.
DEPENDENTS = (
    "SELECT d.task_seq, t.pool FROM deps d JOIN tasks t ON t.seq = d.task_seq WHERE d.dep_seq = ?"
    " ORDER BY d.task_seq LIMIT ?"
)
# A pool's earliest due PENDING task's age from (pool, now): when it was due or created, the later.
OLDEST_DUE = (
    "SELECT max(run_at, created_at) FROM tasks WHERE state = 1 AND pool = ? AND run_at <= ? ORDER BY run_at LIMIT 1"
)
COUNT_BY_POOL_AND_STATE = "SELECT pool, state, COUNT(*) FROM tasks GROUP BY pool, state"
_PENDING_BY_GROUP = "SELECT group_key, count(*) AS n FROM tasks WHERE state = 1 AND pool = ?"
# A pool's PENDING tasks by group: the groups with most (pool, how many), and those asked for
# (pool, their names as JSON).
PENDING_BY_GROUP = (
    f"SELECT * FROM ({_PENDING_BY_GROUP} GROUP BY group_key ORDER BY n DESC, group_key LIMIT ?)"
    f" UNION SELECT * FROM ({_PENDING_BY_GROUP} AND group_key IN (SELECT value FROM json_each(?)) GROUP BY group_key)"
)
ATTEMPTS = f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE task_seq = ? ORDER BY attempt, ended_at"


def select_tasks(where: str) -> str:
    """The tasks a where-clause picks, as task rows."""
    return f"SELECT {TASK_COLUMNS} FROM tasks WHERE {where}"


def seq_in(seqs: int) -> str:
    """Where-clause: the tasks of these seqs."""
    return f"seq IN ({marks(seqs)})"


def dependency_rows(seqs: int) -> str:
    """What a dependent reads of these tasks (their seqs)."""
    return f"SELECT seq, key, state, result, result_content_type, error FROM tasks WHERE seq IN ({marks(seqs)})"
