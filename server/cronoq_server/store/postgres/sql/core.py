"""The statements of core.py: the fencing term's checks and the read of tasks by a condition."""

from __future__ import annotations

from ...base import TASK_COLUMNS

# The store's leadership term, share-locked: a write transaction's first statement when fenced.
LEADER_TERM_FOR_SHARE = "SELECT term FROM {s}.leader WHERE id = 1 FOR SHARE"

# The store's leadership term, read after a fenced statement that returned nothing.
LEADER_TERM = "SELECT term FROM {s}.leader WHERE id = 1"


def term_holds(param: int) -> str:
    """SQL: the store's term is the one in parameter `param` (a statement's `{fence}`)."""
    return f"EXISTS (SELECT 1 FROM {{s}}.leader WHERE id = 1 AND term = ${param} FOR SHARE)"


def select_tasks(where: str) -> str:
    """The tasks (TASK_COLUMNS) that meet the condition where."""
    return f"SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE {where}"


# Conditions of select_tasks (Store._select): a task by seq ($1), by key ($1), and of the seqs $1.
BY_SEQ = "seq = $1"
BY_KEY = "key = $1 AND key IS NOT NULL"
BY_SEQS = "seq = ANY($1::bigint[])"
