"""The statements of lease.py, and the fragments only leases build on."""

from __future__ import annotations

from ....core.limits import MAX_TIMEOUT_MS
from ...base import TASK_COLUMNS
from ...fair import RANK_BATCH
from ...logic import HEARTBEAT_COLUMNS
from . import _ONCE, events_of, startable

# TASK_COLUMNS of tasks t.
T_TASK_COLUMNS = ", ".join(f"t.{c.strip()}" for c in TASK_COLUMNS.split(","))


# What a task (alias t) weighs in a lease reply.
LEASE_SIZE = "octet_length(t.payload) + octet_length(coalesce(t.key, '')) + octet_length(t.content_type)"


def _free_for(entry: str) -> str:
    """SQL: what the lease's `free` ($8) has for a resources entry, as fair.free_for: its own,
    else its keyed resource's full size ("name:"), else 0."""
    return f"coalesce($8::jsonb ->> {entry}, $8::jsonb ->> left({entry}, strpos({entry}, ':')), '0')::bigint"


# A due task (of tasks, unaliased) fits alone: every amount it names is free ($8).
_FITS_ALONE = (
    f"NOT EXISTS (SELECT 1 FROM jsonb_each_text(resources::jsonb) r WHERE {_free_for('r.key')} < r.value::bigint)"
)


def _next_key(pool: str, after: str) -> str:
    """SQL: the key of a pool's PENDING tasks after the one given (one step of tasks_keyed)."""
    return (
        "(SELECT res_key FROM {s}.tasks WHERE state = 1 AND pool = "
        f"{pool} AND res_key > {after} ORDER BY res_key LIMIT 1)"
    )


# The keyed part of a lease's CTEs (the pools $4, each one's key to start after $11, KEY_SCAN
# $12): `keys`, the keys of each pool's PENDING tasks it visits in order (n) — those after
# the one given, then from the first again up to it — and `keyed`, of each key with room,
# its first due tasks that fit alone, as many as it has room for. A key without room costs
# one index step; its tasks are never read. (OFFSET 0: each step's look-up runs once, not
# once per use.) {place}: what a lease of several pools adds to each row (lease_ctes).
_KEYED = (
    " keys AS (WITH RECURSIVE k(pool, after, key, n, wrapped) AS ("
    " SELECT p.pool, p.after, coalesce(s.nx, CASE WHEN p.after <> '' THEN "
    + _next_key("p.pool", "''")
    + " END), 1, s.nx IS NULL FROM unnest($4::text[], $11::text[]) AS p(pool, after),"
    " LATERAL (SELECT " + _next_key("p.pool", "p.after") + " AS nx OFFSET 0) AS s"
    " UNION ALL SELECT k.pool, k.after, coalesce(s.nx, CASE WHEN NOT k.wrapped AND k.after <> '' THEN "
    + _next_key("k.pool", "''")
    + " END), k.n + 1, k.wrapped OR s.nx IS NULL FROM k, LATERAL (SELECT "
    + _next_key("k.pool", "k.key")
    + " AS nx OFFSET 0) AS s WHERE k.key IS NOT NULL AND k.n < $12 AND NOT (k.wrapped AND k.key > k.after))"
    " SELECT pool, key, n FROM k WHERE key IS NOT NULL AND NOT (wrapped AND key > after)),"
    f" keyed AS (SELECT x.*{{place}} FROM keys, LATERAL (SELECT seq, priority, run_at, {LEASE_SIZE} AS size, resources"
    " FROM {s}.tasks t"
    " WHERE state = 1 AND pool = keys.pool AND res_key = keys.key AND run_at <= $1 AND "
    + startable("$1")
    + " AND "
    + _FITS_ALONE
    + f" ORDER BY priority DESC, run_at, seq LIMIT least({_free_for('keys.key')}, $2) FOR UPDATE SKIP LOCKED)"
    f" AS x WHERE {_free_for('keys.key')} > 0 AND {{fence}})"
)


def _in_turns(rows: str, limit: str) -> str:
    """SQL: of these rows of several pools, each with its pool's place in turn order, the first
    limit dealt round robin: each pool's first in lease order (turn 1), then each one's second..."""
    return (
        "SELECT *, row_number() OVER (PARTITION BY place ORDER BY priority DESC, run_at, seq) AS turn"
        f" FROM ({rows}) AS d ORDER BY turn, place LIMIT {limit}"
    )


def select_leased(ctes: str) -> str:
    """The statement of a lease's CTEs that returns what `leased` took."""
    return f"WITH {ctes} SELECT * FROM leased"


def lease_keyed(ctes: str) -> str:
    """The statement of a keyed lease's CTEs: the leased tasks, and the key each pool's visit
    ended at when it visited KEY_SCAN keys (the next lease starts after it), as two arrays
    (_ONCE); a row without a task when none was leased (none leased and no such key: no row,
    and the term is checked)."""
    return (
        f"WITH {ctes} SELECT l.*, {_ONCE.format('e.pools')}, {_ONCE.format('e.keys')}"
        " FROM (SELECT array_agg(pool) AS pools, array_agg(key) AS keys FROM keys WHERE n = $12"
        " AND {fence}) AS e LEFT JOIN leased l ON true WHERE l.seq IS NOT NULL OR e.pools IS NOT NULL"
    )


# When the next PENDING task of the pools $1 not due at $3 becomes due, or the next not yet
# ranked of the pools $2 that cap their groups: one index step per pool (tasks_due; "pool = ANY"
# would read every PENDING task).
NEXT_DUE = (
    "SELECT least((SELECT min(x.run_at) FROM unnest($1::text[]) AS p(pool), LATERAL (SELECT run_at"
    " FROM {s}.tasks WHERE state = 1 AND pool = p.pool AND run_at > $3 ORDER BY run_at LIMIT 1) AS x),"
    " (SELECT min(run_at) FROM {s}.tasks WHERE state = 1 AND group_rank = 0 AND pool = ANY($2::text[])))"
)

# The candidates of a lease of the pools $1 that cap their groups, due at $2 (size with the
# overhead $3): the first RANK_BATCH not yet ranked, by due time, and of each pool the first $4
# ranked (seq, pool, group, size, resources, priority, rank or 0, attempt).
FAIR_CANDIDATES = (
    f"(SELECT seq, pool, group_key, {LEASE_SIZE} + $3, resources, priority, 0::bigint, attempt"
    " FROM {s}.tasks t WHERE state = 1 AND group_rank = 0 AND pool = ANY($1::text[]) AND run_at <= $2"
    f" AND {startable('$2')}"
    f" ORDER BY run_at, seq LIMIT {RANK_BATCH})"
    " UNION ALL (SELECT x.* FROM unnest($1::text[]) AS p(pool), LATERAL (SELECT t.seq, t.pool, t.group_key,"
    f" {LEASE_SIZE} + $3, t.resources, t.priority, t.group_rank, t.attempt FROM {{s}}.tasks t"
    f" WHERE t.state = 1 AND t.group_rank > 0 AND t.pool = p.pool AND t.run_at <= $2 AND {startable('$2')}"
    " ORDER BY t.priority DESC, t.group_rank, t.seq LIMIT $4) AS x)"
)


def leased_cte(worker: str, ttl: str, source: str, rank: str = "") -> str:
    """`leased`, that leases the tasks of source (now is $1) for their TTL, and `lease_ev`."""
    keep_rank = f" group_rank = {rank}," if rank else ""
    return (
        " leased AS (UPDATE {s}.tasks t SET state = 3, attempt = t.attempt + 1,"
        f" worker_id = {worker}, started_at = $1,{keep_rank}"
        # Never past the attempt's deadline (started_at + timeout_ms); a timeout stored before the
        # API bounded it is taken at that bound, so its product fits a bigint.
        " lease_expires_at = $1 + CASE WHEN t.timeout_ms > 0"
        f" THEN least({ttl}, least(t.timeout_ms, {MAX_TIMEOUT_MS}) * 1000)"
        f" ELSE {ttl} END {source}"
        f" RETURNING {T_TASK_COLUMNS}),"
        f" lease_ev AS ({events_of('3', 'attempt', '$1::bigint', '1', 'leased')})"
    )


# The CTEs that store the new ranks ($6 seqs, $7 ranks) of what a fair read found and take the
# chosen ($3 seqs, $4 ranks, $5 TTLs) for worker $2 at $1, each only while still PENDING.
# Taken only while still PENDING (they were read without a lock): the state written as an
# expression, so that no partial index on state = 1 applies, and the seqs named again as
# an index condition: the tasks are looked up by seq, whatever the table's statistics.
FAIR_TAKE_CTES = (
    "ranked AS (UPDATE {s}.tasks t SET group_rank = u.rank FROM unnest($6::bigint[], $7::bigint[])"
    " AS u(seq, rank) WHERE t.seq = u.seq AND t.state = 1 AND t.group_rank = 0 AND {fence}),"
    " chosen AS (SELECT * FROM unnest($3::bigint[], $4::bigint[], $5::bigint[]) AS c(seq, rank, ttl)"
    " WHERE {fence}),"
    + leased_cte(
        "$2",
        "chosen.ttl",
        "FROM chosen WHERE t.seq = chosen.seq AND t.seq = ANY($3::bigint[]) AND t.state::int = 1"
        f" AND {startable('$1')}",
        rank="chosen.rank",
    )
)

# The CTEs that lease the tasks `chosen` names (now is $1; the worker id $3, the pools $4
# and their lease TTLs $5): `leased` returns them in TASK_COLUMNS order, and their events
# are inserted. The tasks by their seqs (an index condition whatever the plan expects of `chosen`).
_TAKE_CTES = leased_cte(
    "$3", "($5::bigint[])[array_position($4::text[], t.pool)]", "WHERE t.seq = ANY(ARRAY(SELECT seq FROM chosen))"
)


def lease_ctes(multi: bool, resources: bool, keyed: bool) -> str:
    """The CTEs of a lease (Lease._lease_ctes: $1 to $7, $8 to $10 with resources, $11 and $12
    with keyed resources) of several pools or one, of tasks that name resources or not."""
    # Several pools are dealt round robin (in the order given): each task carries its pool's
    # place, and those picked are each pool's first in lease order, then each one's second...
    place, unnest = ", p.place", "unnest($4::text[]) WITH ORDINALITY AS p(pool, place)"
    if not multi:
        place, unnest = "", "unnest($4::text[]) AS p(pool)"
    # One index-ordered scan per pool ("pool = ANY" would sort every pending row).
    # Tasks that name no resources, and those that do, are in indexes of their own: the
    # first never wait behind the second.
    plain = (
        f"SELECT x.seq, x.priority, x.run_at, x.size{place} FROM {unnest}, LATERAL"
        f" (SELECT seq, priority, run_at, {LEASE_SIZE} AS size FROM {{s}}.tasks t"
        f" WHERE state = 1 AND pool = p.pool AND run_at <= $1 AND {startable('$1')}"
        " AND resources IS NULL ORDER BY priority DESC, run_at, seq LIMIT $2 FOR UPDATE SKIP LOCKED) AS x"
        " WHERE {fence}"
    )
    if multi:
        picked = f"picked AS ({_in_turns(plain, '$2')})"
    else:
        picked = f"picked AS ({plain} ORDER BY x.priority DESC, x.run_at, x.seq LIMIT $2)"
    if resources:
        # Of the due tasks that name resources, the first whose every amount is available
        # alone (those of a resource used up are passed over in the index scan, so they
        # never hold back the tasks behind), and those of the keys with room a keyed
        # resource names (_KEYED); of those, the ones that still fit beside the tasks before
        # them (running totals per resource).
        # Per pool, in index order, locked as they are read.
        cand = (
            f"SELECT x.seq, x.priority, x.run_at, x.size, x.resources{place}"
            f" FROM {unnest}, LATERAL (SELECT seq, priority, run_at,"
            f" {LEASE_SIZE} AS size, resources FROM {{s}}.tasks t"
            f" WHERE state = 1 AND pool = p.pool AND run_at <= $1 AND {startable('$1')}"
            " AND resources IS NOT NULL AND res_key IS NULL"
            # A task naming an entry with nothing free ($10) is passed over by one look-up,
            # not a row per entry.
            f" AND NOT resources::jsonb ?| $10::text[] AND {_FITS_ALONE}"
            " ORDER BY priority DESC, run_at, seq LIMIT $9 FOR UPDATE SKIP LOCKED) AS x WHERE {fence}"
            + (" UNION ALL SELECT * FROM keyed" if keyed else "")
        )
        need = (
            " need AS (SELECT c.seq, r.key AS name, sum(r.value::bigint) OVER (PARTITION BY r.key"
            " ORDER BY c.priority DESC, c.run_at, c.seq) AS upto"
            " FROM cand c, jsonb_each_text(c.resources::jsonb) r),"
        )
        fits = (
            f"SELECT seq, priority, run_at, size{', place' if multi else ''} FROM cand WHERE seq NOT IN"
            f" (SELECT seq FROM need WHERE upto > {_free_for('need.name')})"
        )
        if multi:
            picked = (
                f" cand AS ({_in_turns(cand, '$9')}),{need}"
                f" picked AS ({_in_turns(f'SELECT * FROM ({plain}) AS plain UNION ALL {fits}', '$2')})"
            )
        else:
            picked = (
                f" cand AS (SELECT * FROM ({cand}) AS c ORDER BY priority DESC, run_at, seq LIMIT $9),{need}"
                f" picked AS (SELECT * FROM ({plain}) AS plain UNION ALL {fits}"
                " ORDER BY priority DESC, run_at, seq LIMIT $2)"
            )
        if keyed:
            by_place = ", array_position($4::text[], keys.pool) AS place" if multi else ""
            picked = _KEYED.replace("{place}", by_place) + "," + picked
    # Of the rows picked, the first always and then as many as fit in max_bytes (each row's
    # size is read as it is picked: octet_length reads a stored value's size without
    # decompressing it).
    return (
        f"{picked},"
        f" sized AS (SELECT p.seq, row_number() OVER w AS n, sum(p.size + $7) OVER w"
        " AS upto FROM picked p"
        f" WINDOW w AS (ORDER BY {'p.turn, p.place' if multi else 'p.priority DESC, p.run_at, p.seq'})),"
        " chosen AS (SELECT seq FROM sized WHERE n = 1 OR $6::bigint <= 0 OR upto <= $6::bigint)," + _TAKE_CTES
    )


# What the running tasks hold: of each that names resources or is of a pool $1 that caps its
# groups, its worker, seq, attempt, resources, pool and group.
RUNNING_RESOURCES = (
    "SELECT worker_id, seq, attempt, resources, pool, group_key FROM {s}.tasks WHERE state = 3"
    " AND (resources IS NOT NULL OR pool = ANY($1::text[]))"
)

# PENDING tasks of pool $1 stored before the pool capped its groups: ranked when due.
UNRANK_UNSTORED = "UPDATE {s}.tasks SET group_rank = 0 WHERE state = 1 AND pool = $1 AND group_rank IS NULL"

# The lowest rank of pool $1's ranked PENDING tasks.
LOWEST_RANK = "SELECT min(group_rank) FROM {s}.tasks WHERE state = 1 AND group_rank > 0 AND pool = $1"

# Of each group of pool $1, the highest rank of its PENDING tasks.
LAST_RANKS = (
    "SELECT group_key, max(group_rank) FROM {s}.tasks WHERE state = 1 AND group_rank > 0"
    " AND pool = $1 GROUP BY group_key"
)

# Worker $2 was seen at $1.
TOUCH_WORKER = "UPDATE {s}.workers SET last_seen_at = $1 WHERE id = $2"

# What a heartbeat reads of the tasks $1.
HEARTBEAT_ROWS = f"SELECT {HEARTBEAT_COLUMNS} FROM {{s}}.tasks WHERE seq = ANY($1::bigint[])"

# Each lease's new expiry: $1[i] for task $2[i].
EXTEND_LEASES = (
    "UPDATE {s}.tasks t SET lease_expires_at = u.expiry"
    " FROM unnest($1::bigint[], $2::bigint[]) AS u(expiry, seq) WHERE t.seq = u.seq"
)

# The reports of current attempts, kept with their tasks: of task $1[i], progress $2[i] (if
# any), and checkpoint $4[i] if $3[i].
KEEP_REPORTS = (
    "UPDATE {s}.tasks t SET progress = coalesce(u.progress, t.progress),"
    " checkpoint = CASE WHEN u.has_checkpoint THEN u.checkpoint ELSE t.checkpoint END"
    " FROM unnest($1::bigint[], $2::text[], $3::boolean[], $4::bytea[])"
    " AS u(seq, progress, has_checkpoint, checkpoint) WHERE t.seq = u.seq"
)
