"""SQLite store: WAL mode, one connection on one dedicated thread.

Each Store method runs as one function on that thread inside one transaction, so
a batch costs one thread hop rather than one per statement (aiosqlite's model).
One mixin per concern over the plumbing (core.SqliteCore); their SQL is in sql/, a module a concern.
"""

from __future__ import annotations

from .bulk import Bulk
from .events import Events
from .finish import Finish
from .lease import Lease
from .maintenance import Maintenance
from .reads import Reads
from .schema import MIGRATIONS, Schema
from .submit import Submit

__all__ = ["MIGRATIONS", "SqliteStore"]


# Each mixin before those it builds on (Bulk on Finish, Finish on Lease and Submit, ...).
class SqliteStore(Schema, Bulk, Maintenance, Finish, Lease, Submit, Reads, Events):
    pass
