"""SQL of events.py: the event log recorded, read, counted and purged."""

from __future__ import annotations

from ...base import COUNTED_COLUMNS, EVENT_COLUMNS, EVENT_TASK_COLUMNS

# An event of a task as it is now (at, prev_state, seq).
RECORD_EVENT = (
    f"INSERT INTO events ({EVENT_COLUMNS})"
    f" SELECT seq, state, attempt, ?, pool, ?, {EVENT_TASK_COLUMNS} FROM tasks WHERE seq = ?"
)
# The events of the tasks seq $3 to $4 as they are now, in seq order (at, prev_state, first, last).
RECORD_EVENTS_OF_RANGE = (
    f"INSERT INTO events ({EVENT_COLUMNS})"
    f" SELECT seq, state, attempt, ?, pool, ?, {EVENT_TASK_COLUMNS} FROM tasks WHERE seq BETWEEN ? AND ?"
    " ORDER BY seq"
)
# The last event id given (AUTOINCREMENT's), none when no event was recorded yet.
LAST_EVENT = "SELECT seq FROM sqlite_sequence WHERE name = 'events'"
# The events after an id (after, how many), as event rows; as the columns counted.
READ_EVENTS = f"SELECT id, {EVENT_COLUMNS} FROM events WHERE id > ? ORDER BY id LIMIT ?"
READ_EVENT_COLUMNS = f"SELECT id, {COUNTED_COLUMNS} FROM events WHERE id > ? ORDER BY id LIMIT ?"
BEGIN = "BEGIN"
COUNT_UNFINISHED = "SELECT pool, state, COUNT(*) FROM tasks WHERE state IN (1, 2, 3) GROUP BY pool, state"
PURGED_THROUGH = "SELECT purged_through FROM event_log WHERE id = 1"
# The last of the oldest events (how many) recorded before a time (before).
PURGE_BOUND = "SELECT max(id) FROM (SELECT id, at FROM events ORDER BY id LIMIT ?) WHERE at < ?"
DELETE_EVENTS_THROUGH = "DELETE FROM events WHERE id <= ?"
MARK_PURGED = "UPDATE event_log SET purged_through = max(purged_through, ?) WHERE id = 1"
