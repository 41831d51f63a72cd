"""The SQLite store's SQL, apart from the Python that runs it.

One module a concern, named as the store module that runs its statements (sql/lease.py: lease.py's),
each statement a named constant, or a builder function when part of it is sized or chosen per call;
here, what several concerns run.
"""

from __future__ import annotations

import json

from ...logic import Dialect

DIALECT = Dialect(
    mark=lambda n: "?",
    any_of=lambda column, mark, _type: f"{column} IN (SELECT value FROM json_each({mark}))",
    array=json.dumps,
    contains="instr({0}, {1}) > 0",
)

# A read-only connection's first statement.
QUERY_ONLY = "PRAGMA query_only = 1"
COMMIT = "COMMIT"
# Where-clauses for Reads._select: the task of a seq, of a key.
BY_SEQ = "seq = ?"
BY_KEY = "key = ?"


def marks(n: int) -> str:
    return ",".join("?" * n)


def delete_deps(tasks: int) -> str:
    """The dependencies of these tasks (their seqs)."""
    return f"DELETE FROM deps WHERE task_seq IN ({marks(tasks)})"


def delete_attempts(tasks: int) -> str:
    """The ended attempts of these tasks (their seqs)."""
    return f"DELETE FROM attempts WHERE task_seq IN ({marks(tasks)})"
