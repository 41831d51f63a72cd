"""PostgreSQL store (asyncpg): one schema per shard, set-based hot paths.

Leases take rows with FOR UPDATE SKIP LOCKED and a limit in one statement; batches are
multi-row inserts (unnest); finish reports are applied with one statement per kind of
change. Every method is one transaction. With a fencing term set (by the leader), every
write transaction first checks the term in the store under a share lock, so a deposed
leader's writes fail instead of landing.

One module a concern, each a mixin of PostgresStore over core._Core (the connection and
transaction plumbing); the statements each one runs are in sql/<module>.py, and the
fragments several of them build on in sql/__init__.py.
"""

from .bulk import Bulk
from .core import CONNECTION_ERRORS, STEP_SETTINGS, notify_channel, quote_ident
from .events import READ_ROWS, Events, unbatched
from .finish import Finish
from .lease import Lease
from .maintenance import Maintenance
from .reads import Reads
from .schema import MIGRATIONS, Schema
from .sql import INSERT_ATTEMPTS, T_EVENT_TASK_COLUMNS, WORKER_COLUMNS, events_of, insert_events
from .sql.lease import LEASE_SIZE
from .submit import (
    ANALYZE_AFTER_ROWS,
    ANALYZE_FIRST_ROWS,
    ANALYZE_GROWTH,
    MAX_GROUP,
    MAX_GROUP_TASKS,
    RETRYABLE,
    Submit,
    SubmitResult,
)

__all__ = [
    "ANALYZE_AFTER_ROWS",
    "ANALYZE_FIRST_ROWS",
    "ANALYZE_GROWTH",
    "CONNECTION_ERRORS",
    "INSERT_ATTEMPTS",
    "LEASE_SIZE",
    "MAX_GROUP",
    "MAX_GROUP_TASKS",
    "MIGRATIONS",
    "READ_ROWS",
    "RETRYABLE",
    "STEP_SETTINGS",
    "T_EVENT_TASK_COLUMNS",
    "WORKER_COLUMNS",
    "PostgresStore",
    "SubmitResult",
    "events_of",
    "insert_events",
    "notify_channel",
    "quote_ident",
    "unbatched",
]


class PostgresStore(Schema, Reads, Maintenance, Bulk, Finish, Lease, Events, Submit):
    """One shard's tasks in a PostgreSQL schema (the mixins each build on those they call)."""
