"""The SQL fragments statements of several modules build on: column lists, predicates, CTEs and
the event log's insert. Each module's statements are in sql/<module>.py."""

from __future__ import annotations

from ...base import ATTEMPT_COLUMNS, EVENT_COLUMNS, EVENT_TASK_COLUMNS
from ...logic import Dialect

_DIALECT = Dialect(
    mark=lambda n: f"${n}",
    any_of=lambda column, mark, sql_type: f"{column} = ANY({mark}::{sql_type}[])",
    array=list,
    contains="strpos({0}, {1}) > 0",
)


# Wakes the leases waiting on channel $1 (Store.channel): a task became PENDING.
NOTIFY = "SELECT pg_notify($1, '')"


WORKER_COLUMNS = "id, name, pools, concurrency, labels, registered_at, last_seen_at, principal"


_EVENT_ARRAYS = ", ".join(f"array_agg(e.{c})" for c in EVENT_COLUMNS.split(", "))


def events_of(state: str, attempt: str, at: str, prev: str, source: str) -> str:
    """insert_events of the rows of source (a CTE's RETURNING: seq, pool and EVENT_TASK_COLUMNS)."""
    return insert_events(f"SELECT seq, {state}, {attempt}, {at}, pool, {prev}, {EVENT_TASK_COLUMNS} FROM {source}")


def insert_events(select: str) -> str:
    """The statement that records the events select yields (EVENT_COLUMNS of the rows a change
    left, of a CTE's RETURNING or of tasks t) as one row of event_batches, or none for none."""
    return (
        f"INSERT INTO {{s}}.event_batches (n, last_at, {EVENT_COLUMNS})"
        f" SELECT count(*), max(e.at), {_EVENT_ARRAYS} FROM ({select}) AS e({EVENT_COLUMNS}) HAVING count(*) > 0"
    )


INSERT_ATTEMPTS = f"INSERT INTO {{s}}.attempts ({ATTEMPT_COLUMNS})"


T_EVENT_TASK_COLUMNS = ", ".join(f"t.{c}" for c in EVENT_TASK_COLUMNS.split(", "))


def startable(now: str) -> str:
    """SQL: a PENDING task (of tasks, unaliased or t) may still start at now: not past its start_by."""
    return f"(start_by IS NULL OR start_by > {now})"


# The CTEs that delete the dependencies and attempts of the tasks `gone` returns: looked up by
# their seqs (an index condition; a join planned from the CTE's estimate read every attempt).
DELETE_WITH_TASKS = (
    " deps AS (DELETE FROM {s}.deps WHERE task_seq = ANY(ARRAY(SELECT seq FROM gone))),"
    " attempts AS (DELETE FROM {s}.attempts WHERE task_seq = ANY(ARRAY(SELECT seq FROM gone)))"
)


# Two arrays a statement returns beside the rows it leased go in its first row only: in every
# row, a step of n outcomes and n tasks would send and decode n² elements.
_ONCE = "CASE WHEN row_number() OVER () = 1 THEN {} END"
