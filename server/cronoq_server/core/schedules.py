"""ScheduleService (put, delete, list) and the leader's service that fires due schedules.

Each slot's task is keyed `schedule:{pool}:{name}:{slot in Unix seconds}` and the schedule is
advanced in the same transaction, guarded by the next_fire_at it was read with: a slot never
fires twice, whoever leads when it comes. After downtime only the latest missed slot fires,
unless the schedule asks for every missed one (fire_all_missed, bounded by MAX_MISSED_SLOTS).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from zoneinfo import ZoneInfo

from cronoq.v1 import schedule_service_pb2 as pb

from ..auth import Principal
from ..config import Config
from ..errors import ApiError, invalid, not_found
from ..metrics import SCHEDULE_FIRES, TASKS_SUBMITTED
from ..store.base import NewTask, ScheduleRow, Store
from .convert import to_schedule
from .cron import Cron, CronError, latest_at_or_before, next_after, parse, zone
from .events import EventBus
from .limits import SCHEDULE_KEY_PREFIX
from .tasks import Tasks, now_us, trace_of

log = logging.getLogger("cronoq.schedules")

# Names appear in routes (/v1/pools/{pool}/schedules/{name}) and in task keys.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Schedules fired per step at most; more due ones are fired at once by the next step.
DUE_PER_STEP = 100
# fire_all_missed: slots fired per transaction, and the backlog past which only the latest fires.
SLOTS_PER_FIRE = 100
MAX_MISSED_SLOTS = 1000
# The fire step wakes this long after a slot, so a timer that fires a hair early does not spin.
WAKE_MARGIN_S = 0.001


def slot_key(pool: str, name: str, slot_us: int) -> str:
    """The key of a slot's task. Names hold no ':', so no two (pool, name, slot) share a key."""
    return f"{SCHEDULE_KEY_PREFIX}{pool}:{name}:{slot_us // 1_000_000}"


class Schedules:
    def __init__(self, config: Config, store: Store, events: EventBus, tasks: Tasks, pools: list[str]):
        self._config = config
        self._store = store
        self._events = events
        self._tasks = tasks
        self._pools = set(pools)
        # Runs the fire step now (set by the node to its service's poke), so a new schedule's
        # first slot is not late.
        self.wake: Callable[[], None] = lambda: None
        self._orphans: set[tuple[str, str]] = set()

    # -- the API --------------------------------------------------------------

    def _check_pool(self, pool: str, caller: Principal, field: str) -> None:
        if not pool:
            raise invalid(f"{field}: required")
        caller.require("schedule", pool)
        if pool not in self._pools:
            raise invalid(f"{field}: unknown pool {pool!r}")

    @staticmethod
    def _check_name(name: str, field: str) -> None:
        if not NAME.fullmatch(name):
            raise invalid(
                f"{field}: {name[:64]!r} is not a schedule name (1 to 128 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit)"
            )

    async def put_schedule(self, req: pb.PutScheduleRequest, caller: Principal) -> pb.PutScheduleResponse:
        s = req.schedule
        self._check_pool(s.pool, caller, "schedule.pool")
        self._check_name(s.name, "schedule.name")
        try:
            cron = parse(s.cron)
        except CronError as err:
            raise invalid(f"schedule.cron: {err}") from None
        try:
            tz = zone(s.timezone)
        except CronError as err:
            raise invalid(f"schedule.timezone: {err}") from None
        self._tasks.check_template(s, "schedule.")
        now = now_us()
        next_fire_at = None if s.paused else next_after(cron, tz, now)
        if next_fire_at is None and not s.paused:
            raise invalid(f"schedule.cron: {s.cron!r} has no slot in the coming years")
        row = ScheduleRow(
            pool=s.pool,
            name=s.name,
            cron=s.cron.strip(),
            timezone=s.timezone,
            payload=s.payload,
            content_type=s.content_type,
            priority=s.priority,
            max_attempts=s.max_attempts,
            resources=dict(s.resources),
            timeout_ms=s.timeout_ms,
            paused=s.paused,
            fire_all_missed=s.fire_all_missed,
            next_fire_at=next_fire_at,
            group_key=s.group_key,
            trace=trace_of(s, link=True),
        )
        stored = await self._store.put_schedule(row, now)
        self.wake()
        return pb.PutScheduleResponse(schedule=to_schedule(stored))

    async def delete_schedule(self, req: pb.DeleteScheduleRequest, caller: Principal) -> pb.DeleteScheduleResponse:
        self._check_pool(req.pool, caller, "pool")
        self._check_name(req.name, "name")
        if not await self._store.delete_schedule(req.pool, req.name):
            raise not_found(f"no schedule {req.name!r} in pool {req.pool!r}")
        return pb.DeleteScheduleResponse()

    async def list_schedules(self, req: pb.ListSchedulesRequest, caller: Principal) -> pb.ListSchedulesResponse:
        pools = self._tasks.readable_pools(req.pool, caller)
        rows = await self._store.list_schedules(pools)
        return pb.ListSchedulesResponse(schedules=[to_schedule(r) for r in rows])

    # -- the leader's service -------------------------------------------------

    async def fire_due(self) -> float | None:
        """Fires every due schedule; returns the seconds until the next slot (None: no schedule)."""
        now = now_us()
        due, upcoming = await self._store.due_schedules(now, DUE_PER_STEP)
        nexts = [upcoming] if upcoming is not None else []
        for schedule in due:
            if schedule.pool not in self._pools:  # a pool no longer configured here: kept, not fired
                if (schedule.pool, schedule.name) not in self._orphans:
                    self._orphans.add((schedule.pool, schedule.name))
                    log.warning("schedule %r of pool %r: the pool is not configured here", schedule.name, schedule.pool)
                continue
            try:
                nxt = await self._fire(schedule, now)
            except (ApiError, CronError) as err:  # e.g. the pool's pending limit: tried again next step
                log.warning("schedule %r of pool %r not fired: %s", schedule.name, schedule.pool, err)
                continue
            if nxt is not None:
                nexts.append(nxt)
        if len(due) == DUE_PER_STEP:
            return 0.0
        if not nexts:
            return None
        return max((min(nexts) - now_us()) / 1e6, 0.0) + WAKE_MARGIN_S

    async def _fire(self, schedule: ScheduleRow, now: int) -> int | None:
        """Fires the schedule's due slot(s); returns its next_fire_at (None: the fire was stale)."""
        assert schedule.next_fire_at is not None
        cron, tz = parse(schedule.cron), zone(schedule.timezone)
        slots = self._missed_slots(schedule, cron, tz, now) if schedule.fire_all_missed else []
        if not slots:
            latest = latest_at_or_before(cron, tz, schedule.next_fire_at - 1, now)
            slots = [latest if latest is not None else schedule.next_fire_at]
        next_fire_at = next_after(cron, tz, slots[-1])
        max_attempts, timeout_ms = self._tasks.pool_defaults(schedule.pool, schedule.max_attempts, schedule.timeout_ms)
        tasks = [
            NewTask(
                pool=schedule.pool,
                key=slot_key(schedule.pool, schedule.name, slot),
                payload=schedule.payload,
                content_type=schedule.content_type,
                priority=schedule.priority,
                run_at=slot,
                max_attempts=max_attempts,
                resources=dict(schedule.resources),
                timeout_ms=timeout_ms,
                group_key=schedule.group_key,
                trace=schedule.trace,
            )
            for slot in slots
        ]
        fired = await self._store.fire_schedule(schedule, tasks, slots[-1], next_fire_at, now)
        if fired is None:
            return None  # a Put, pause or delete came between: the next step reads it anew
        subs, changes = fired
        created = [s.row for s in subs if not s.deduplicated]
        if created:
            SCHEDULE_FIRES.labels(pool=schedule.pool).inc(len(created))
            TASKS_SUBMITTED.labels(pool=schedule.pool).inc(len(created))
        await self._events.publish(changes, created)
        return next_fire_at

    @staticmethod
    def _missed_slots(schedule: ScheduleRow, cron: Cron, tz: ZoneInfo, now: int) -> list[int]:
        """fire_all_missed: the oldest SLOTS_PER_FIRE due slots, or [] when more than
        MAX_MISSED_SLOTS are due (then only the latest fires, as without the option)."""
        assert schedule.next_fire_at is not None
        due = [schedule.next_fire_at]
        while len(due) <= MAX_MISSED_SLOTS:
            nxt = next_after(cron, tz, due[-1])
            if nxt is None or nxt > now:
                return due[:SLOTS_PER_FIRE]
            due.append(nxt)
        log.warning(
            "schedule %r of pool %r missed more than %d slots: only the latest fires",
            schedule.name, schedule.pool, MAX_MISSED_SLOTS,
        )  # fmt: skip
        return []
