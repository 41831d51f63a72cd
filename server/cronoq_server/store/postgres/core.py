"""The PostgreSQL store's connection and transaction plumbing."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg

from ...ids import make_task_id
from ..base import Fenced, ScanTimedOut, StoreSettings, StoreUnavailable, TaskRow
from ..fair import GroupRanks, rank_keep, rank_reset
from ..logic import task_row
from .sql.core import LEADER_TERM, LEADER_TERM_FOR_SHARE, select_tasks, term_holds

if TYPE_CHECKING:
    from .submit import _SubmitOp


T = TypeVar("T")


# The step pool's connections keep the generic plan of the plain lease and finish statements:
# planning one took about 0.9 ms, a third of its run at 32 tasks. Their shape makes that plan
# right whatever it expects of the limit and the arrays: the tasks are found by their seqs (an
# index condition), and with nested loops off the outcomes are hashed, never compared with every
# task the worker runs (the only nested loops left are those nothing else can do: the lease's
# per-pool scan, a cross join of one row). JIT off: the cost nested loops are given would start
# it (0.7 s to compile a step), and such short statements never gain from it.
STEP_SETTINGS = {"plan_cache_mode": "force_generic_plan", "enable_nestloop": "off", "jit": "off"}


# Errors that mean "the database is not reachable right now".
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.InternalClientError,  # a connection that broke mid-operation
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.TooManyConnectionsError,
)


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def notify_channel(schema: str) -> str:
    return f"cronoq_{schema}"[:63]


class _Core:
    """The connection and transaction plumbing every part of the store runs on."""

    # Two steps of a Work stream at once, each leasing half the worker's slots: the database
    # works on one while the worker runs the tasks of the other.
    work_steps = 2
    # Other calls run beside a bulk action's batch, but one that records events waits for the
    # batch's commit (the event log's row): 30 ms batches keep another caller's p99 at 2.0-2.5x
    # its quiet value during a retry of 50,000 tasks, 100 ms ones at 1.5-3.3x, 10 ms ones are
    # no better and three times slower (bench/bulk.py).
    bulk_batch_s = 0.03

    def __init__(self, url: str, schema: str, settings: StoreSettings, pool_size: int = 8, step_pool_size: int = 2):
        self.url = url
        self.schema = schema
        self.settings = settings
        self._s = quote_ident(schema)
        self._pool_size = pool_size
        self._step_pool_size = step_pool_size
        self._pool: asyncpg.Pool | None = None
        # Connections whose statements keep PostgreSQL's generic plan: the plain lease and finish
        # (those of Work steps), planned once a connection instead of at every call (STEP_SETTINGS).
        self._step_pool: asyncpg.Pool | None = None
        # Bulk actions' scans run on connections of their own (settings.bulk_scans), each
        # statement stopped at settings.bulk_scan_timeout_us: none waits for a connection behind them.
        self._scan_pool: asyncpg.Pool | None = None
        self.term: int | None = None  # set by the leader: every write checks it
        self.on_fenced: Callable[[], None] | None = None
        # Finish reports skip the dependents query while no task is BLOCKED: the sweep
        # records the generation it saw none at. A submission that may create a BLOCKED
        # task moves the generation on when it starts and again once it has committed, and
        # while one is in flight the sweep records nothing: a sweep whose query ran before
        # that commit never turns the fast path on.
        self._blocked_generation = 1
        self._no_blocked_since = 0
        self._blocking_submits = 0
        self.channel = notify_channel(schema)
        # Group commit of submissions: calls queue here; one committer at a time takes all that
        # wait (up to MAX_GROUP) into one transaction, each in its own savepoint.
        self._submits: deque[_SubmitOp] = deque()
        self._committer: asyncio.Task[None] | None = None
        self._analyzed_rows = 0  # PENDING tasks when last analyzed (counted at open, then grown by submissions)
        self._submitted_since = 0  # tasks submitted since
        self._analyzer: asyncio.Task[None] | None = None
        # The leader's, used on its event loop (store/fair.py).
        self._ranks = GroupRanks(settings.group_pools)
        self._key_after: dict[str, str] = {}  # pool -> the last key a lease visited (_KEYED)
        self._rank_reset = rank_reset(settings.group_pools)
        self._taking: set[int] = set()  # of fair leases chosen and not yet written (_FairTake.seqs)
        self._rank_keep = rank_keep(settings.group_pools)

    def _full_id(self, seq: int) -> int:
        return make_task_id(self.settings.shard_number, seq)

    def _sql(self, text: str) -> str:
        return text.replace("{s}", self._s)

    @property
    def pool(self) -> asyncpg.Pool:
        assert self._pool is not None, "store is not open"
        return self._pool

    async def _tx(
        self, fn: Callable[[asyncpg.Connection], Awaitable[T]], *, fenced: bool = True, isolation: str | None = None
    ) -> T:
        """Runs fn in one transaction, first checking the fencing term for writes."""
        try:
            async with self.pool.acquire() as conn, conn.transaction(isolation=isolation):
                if fenced and self.term is not None:
                    term = await conn.fetchval(self._sql(LEADER_TERM_FOR_SHARE))
                    if term != self.term:
                        if self.on_fenced is not None:
                            self.on_fenced()
                        raise Fenced(f"leadership term {self.term} is over (store term {term}): write refused")
                return await fn(conn)
        except CONNECTION_ERRORS as err:
            raise StoreUnavailable(f"store unreachable: {type(err).__name__}: {err}") from None

    def _fence(self, param: int) -> str:
        """A condition that holds only while this server's term is the store's (true when unfenced)."""
        if self.term is None:
            return "true"
        return self._sql(term_holds(param))

    async def _fenced_fetch(self, sql: str, *args: Any, planned_once: bool = False) -> list[Any]:
        """One statement in its own transaction (one round trip), fenced by `{fence}` in sql; on
        a connection of the step pool when planned_once and one is free (STEP_SETTINGS).

        The statement does nothing when fenced; an empty result is then checked against the term.
        """
        fenced_sql = sql.replace("{fence}", self._fence(len(args) + 1))
        params = (*args, self.term) if self.term is not None else args
        pool = self.pool
        step = self._step_pool
        if planned_once and step is not None and (step.get_idle_size() or step.get_size() < step.get_max_size()):
            pool = step
        try:
            async with pool.acquire() as conn:
                rows = await conn.fetch(fenced_sql, *params)
                if not rows and self.term is not None:
                    term = await conn.fetchval(self._sql(LEADER_TERM))
                    if term != self.term:
                        if self.on_fenced is not None:
                            self.on_fenced()
                        raise Fenced(f"leadership term {self.term} is over (store term {term}): write refused")
                return list(rows)
        except CONNECTION_ERRORS as err:
            raise StoreUnavailable(f"store unreachable: {type(err).__name__}: {err}") from None

    async def _read(self, fn: Callable[[asyncpg.Connection], Awaitable[T]], pool: asyncpg.Pool | None = None) -> T:
        try:
            async with (pool or self.pool).acquire() as conn:
                return await fn(conn)
        except CONNECTION_ERRORS as err:
            raise StoreUnavailable(f"store unreachable: {type(err).__name__}: {err}") from None

    async def _select(self, conn: asyncpg.Connection, where: str, *args: Any) -> list[TaskRow]:
        rows = await conn.fetch(self._sql(select_tasks(where)), *args)
        return [task_row(r) for r in rows]

    def _nothing_blocked(self) -> bool:
        return self._blocking_submits == 0 and self._no_blocked_since == self._blocked_generation

    @contextlib.contextmanager
    def _may_block(self) -> Iterator[None]:
        """Around a call that may create BLOCKED tasks: the fast finish path is off meanwhile."""
        self._blocking_submits += 1
        self._blocked_generation += 1
        try:
            yield
        finally:
            self._blocking_submits -= 1
            self._blocked_generation += 1

    async def _scan(self, fn: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """fn, a read that may scan far, on the scans' own connections (whose statement_timeout
        is bulk_scan_timeout: ScanTimedOut past it), never on those the hot path needs."""
        assert self._scan_pool is not None, "store is not open"
        try:
            return await self._read(fn, self._scan_pool)
        except asyncpg.exceptions.QueryCanceledError as err:  # statement_timeout
            raise ScanTimedOut(str(err)) from None
