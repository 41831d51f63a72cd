"""The statements of submit.py."""

from __future__ import annotations

from ...base import EVENT_TASK_COLUMNS, TASK_COLUMNS
from . import T_EVENT_TASK_COLUMNS, events_of

# What request $1 created (encode_request's text), if it was recorded.
REQUEST_CREATED = "SELECT created FROM {s}.requests WHERE id = $1"

# Records request $1 at $2, unless recorded already (then no row).
RECORD_REQUEST = (
    "INSERT INTO {s}.requests (id, created, created_at) VALUES ($1, '[]', $2) ON CONFLICT (id) DO NOTHING RETURNING 1"
)

# What request $1 created ($2), once its tasks are.
UPDATE_REQUEST = "UPDATE {s}.requests SET created = $2 WHERE id = $1"

ANALYZE_TASKS = "ANALYZE {s}.tasks"

# Plain calls' tasks, one row per task in the arrays $1..$8, $12, $13, $15..$19 (pool, payload,
# content type, priority, run_at, max_attempts, resources, now, timeout, call number, group,
# rank, keyed entry, trace, start_by), inserted with their events and their calls' request_ids
# ($11, at $14); $9 the channel to notify, $10 how many tasks. ids maps each input position
# to its sequence number, whatever order rows are inserted in.
INSERT_PLAINS = (
    "WITH ids AS MATERIALIZED (SELECT n, nextval(pg_get_serial_sequence('{s}.tasks', 'seq')) AS seq"
    " FROM generate_series(1, $10::int) AS n),"
    " u AS (SELECT * FROM unnest($1::text[], $2::bytea[], $3::text[], $4::int[], $5::bigint[], $6::int[],"
    " $7::text[], $12::bigint[], $15::text[], $16::bigint[], $13::int[], $8::bigint[], $17::text[],"
    " $18::text[], $19::bigint[])"
    " WITH ORDINALITY AS u(pool, payload, content_type, priority, run_at, max_attempts, resources, timeout_ms,"
    " group_key, group_rank, op, now, res_key, trace, start_by, n)),"
    " ops AS (SELECT * FROM unnest($11::text[], $14::bigint[]) WITH ORDINALITY AS o(rid, now, op)),"
    " req AS (INSERT INTO {s}.requests (id, created, created_at)"
    " SELECT o.rid, (SELECT json_agg(json_build_array(ids.seq, false, false) ORDER BY ids.n) FROM u"
    " JOIN ids ON ids.n = u.n WHERE u.op = o.op)::text, o.now FROM ops o WHERE o.rid IS NOT NULL AND {fence}"
    " ON CONFLICT (id) DO NOTHING RETURNING id),"
    " ins AS (INSERT INTO {s}.tasks (seq, pool, payload, content_type, priority, run_at, max_attempts,"
    " resources, state, created_at, timeout_ms, group_key, group_rank, res_key, trace, start_by)"
    " SELECT ids.seq, u.pool, u.payload, u.content_type, u.priority, u.run_at, u.max_attempts,"
    " u.resources, 1, u.now, u.timeout_ms, u.group_key, u.group_rank, u.res_key, u.trace, u.start_by"
    " FROM u JOIN ids ON ids.n = u.n JOIN ops ON ops.op = u.op"
    " WHERE {fence} AND (ops.rid IS NULL OR ops.rid IN (SELECT id FROM req))"
    f" RETURNING seq, pool, created_at, {EVENT_TASK_COLUMNS}),"
    f" ev AS ({events_of('1', '0', 'created_at', '0', 'ins ORDER BY seq')})"
    " SELECT ids.n, ids.seq, (SELECT pg_notify($9, '')) FROM ins JOIN ids ON ids.seq = ins.seq"
)

# The dependencies $1 (seq, state, pool, result size), share-locked: none ends before this commits.
LOCK_DEPENDENCIES = (
    "SELECT seq, state, pool, coalesce(octet_length(result), 0) FROM {s}.tasks WHERE seq = ANY($1::bigint[]) FOR SHARE"
)

# $1 new sequence numbers of tasks.
NEXT_SEQS = "SELECT nextval(pg_get_serial_sequence('{s}.tasks', 'seq')) FROM generate_series(1, $1)"

# Tasks, one row per task in the arrays $1..$24 (the columns named, in order), with their events
# at $25.
INSERT_TASKS = (
    "WITH ins AS (INSERT INTO {s}.tasks (seq, pool, key, payload, content_type, priority, run_at,"
    " max_attempts, depends_on, resources, state, error, created_at, finished_at, blocked_on,"
    " timeout_ms, group_key, group_rank, res_key, trace, parent_seq, run_when, start_by, key_ttl_ms)"
    " SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::int[],"
    " $7::bigint[], $8::int[], $9::text[], $10::text[], $11::smallint[], $12::text[], $13::bigint[],"
    " $14::bigint[], $15::int[], $16::bigint[], $17::text[], $18::bigint[], $19::text[], $20::text[],"
    " $21::bigint[], $22::smallint[], $23::bigint[], $24::bigint[])"
    f" RETURNING seq, pool, state, {EVENT_TASK_COLUMNS})"
    f" {events_of('state', '0', '$25::bigint', '0', 'ins ORDER BY seq')}"
)

# Dependencies: task $1[i] depends on task $2[i].
INSERT_DEPS = "INSERT INTO {s}.deps SELECT * FROM unnest($1::bigint[], $2::bigint[]) ON CONFLICT DO NOTHING"

# The tasks of the keys $1: those a submission may change locked for update, the others for share.
# It may change those of its own keys ($2) that it replaces (keys $3) or whose hold is over at $4
# (as logic.key_released decides): each lock taken at once (share then update could deadlock).
_CHANGES = (
    "(key = ANY($2::text[]) AND (key = ANY($3::text[]) OR (key_ttl_ms > 0 AND state IN (4, 5, 6, 7)"
    " AND coalesce(finished_at + key_ttl_ms * 1000 <= $4, false))))"
)
KEYED_ROWS = (
    f"WITH changed AS (SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE key = ANY($1::text[]) AND {_CHANGES} FOR UPDATE),"
    f" named AS (SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE key = ANY($1::text[]) AND NOT {_CHANGES} FOR SHARE)"
    " SELECT * FROM changed UNION ALL SELECT * FROM named"
)

# A task whose key's hold is over (logic.key_released) keeps the key it had apart: the key is free.
RELEASE_KEY = "UPDATE {s}.tasks SET released_key = key, key = NULL WHERE seq = $1"

# Replacing submissions (logic.replaced): each task's payload, content type, priority and due
# time, with an event that keeps its state (now $6).
REPLACE = (
    "WITH r AS (UPDATE {s}.tasks t SET payload = u.payload, content_type = u.content_type,"
    " priority = u.priority, run_at = u.run_at FROM unnest($1::bigint[], $2::bytea[], $3::text[], $4::int[],"
    " $5::bigint[]) AS u(seq, payload, content_type, priority, run_at) WHERE t.seq = u.seq"
    f" RETURNING t.seq, t.pool, t.state, t.attempt, {T_EVENT_TASK_COLUMNS})"
    f" {events_of('state', 'attempt', '$6::bigint', 'state', 'r ORDER BY seq')}"
)

# The tasks waiting to run (PENDING or BLOCKED) of each pool: what the pending limits count.
WAITING_BY_POOL = "SELECT pool, count(*) FROM {s}.tasks WHERE state IN (1, 2) GROUP BY pool"
