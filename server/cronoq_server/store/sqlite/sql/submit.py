"""SQL of submit.py: new tasks, their dependencies, keys and requests, and the pending limits."""

from __future__ import annotations

from . import marks

# A task whose key's hold is over (logic.key_released) keeps the key it had, apart: the key is free.
RELEASE_KEY = "UPDATE tasks SET released_key = key, key = NULL WHERE seq = ?"
# A replacing submission's (logic.replaced) due time, payload and priority.
REPLACE = "UPDATE tasks SET payload = ?, content_type = ?, priority = ?, run_at = ? WHERE seq = ?"
# What a submission with this request id created (JSON, logic.encode_request).
REQUEST = "SELECT created FROM requests WHERE id = ?"
# A new task: its 23 columns in the order named.
INSERT_TASK = (
    "INSERT INTO tasks (pool, key, payload, content_type, priority, run_at, max_attempts, depends_on,"
    " resources, state, error, created_at, finished_at, blocked_on, timeout_ms, group_key, group_rank,"
    " res_key, trace, parent_seq, run_when, start_by, key_ttl_ms)"
    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
)
# A dependency (task_seq, dep_seq).
INSERT_DEP = "INSERT OR IGNORE INTO deps VALUES (?, ?)"
# A request's record (id, what it created, created_at).
INSERT_REQUEST = "INSERT INTO requests VALUES (?, ?, ?)"
COUNT_PENDING_BY_POOL = "SELECT pool, COUNT(*) FROM tasks WHERE state IN (1, 2) GROUP BY pool"
# What a dependent needs of a dependency: seq, state, pool and result bytes.
_DEP_COLUMNS = "seq, state, pool, coalesce(length(CAST(result AS BLOB)), 0)"
DEP_BY_KEY = f"SELECT {_DEP_COLUMNS} FROM tasks WHERE key = ?"


def deps_by_seq(seqs: int) -> str:
    return f"SELECT {_DEP_COLUMNS} FROM tasks WHERE seq IN ({marks(seqs)})"
