"""Cron expressions evaluated in an IANA timezone.

Five fields (minute hour day-of-month month day-of-week; seconds 0) or six with seconds
first, as Quartz and Spring read them (`*/5 * * * * *` is every five seconds). Each field
takes `*`, numbers, ranges `a-b`, steps `*/n` and `a-b/n` (and `a/n`: from a to the end),
lists `x,y`, and names JAN-DEC and SUN-SAT; `?` is `*`; day-of-week 0 and 7 are Sunday.
@yearly, @monthly, @weekly, @daily and @hourly are the usual shorthands.

Day-of-month and day-of-week follow Vixie cron: when both are restricted (neither starts
with `*`), a day matching either fires; otherwise both must match.

Slots are wall-clock times in the zone. A wall time that does not exist (the gap when
clocks spring forward) is skipped; one that happens twice (when clocks fall back) fires
once, at its first occurrence.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

UTC = dt.UTC
ONE_SECOND = dt.timedelta(seconds=1)
# A cron whose next slot is further than this is refused (e.g. "0 0 30 2 *" never fires).
SEARCH_YEARS = 30
MAX_CRON_LENGTH = 256
MAX_ZONE_LENGTH = 64  # the longest IANA name has 32 characters

_MONTHS = {n: i for i, n in enumerate("JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split(), 1)}
_DAYS = {n: i for i, n in enumerate("SUN MON TUE WED THU FRI SAT".split())}
_SHORTHANDS = {
    "@yearly": "0 0 0 1 1 *",
    "@annually": "0 0 0 1 1 *",
    "@monthly": "0 0 0 1 * *",
    "@weekly": "0 0 0 * * 0",
    "@daily": "0 0 0 * * *",
    "@midnight": "0 0 0 * * *",
    "@hourly": "0 0 * * * *",
}
# (name, low, high, names) of the six fields, seconds first.
_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("second", 0, 59, {}),
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day-of-month", 1, 31, {}),
    ("month", 1, 12, _MONTHS),
    ("day-of-week", 0, 7, _DAYS),
)


class CronError(ValueError):
    """An expression or zone that cannot be used; the message names the field and value."""


@dataclass(frozen=True, slots=True)
class Cron:
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool  # day-of-month starts with "*"
    any_weekday: bool  # day-of-week starts with "*"

    def day_matches(self, day: dt.date) -> bool:
        in_month = day.day in self.days
        in_week = (day.isoweekday() % 7) in self.weekdays
        if self.any_day or self.any_weekday:
            return in_month and in_week
        return in_month or in_week


def parse(expr: str) -> Cron:
    """Raises CronError naming the field and value that are wrong."""
    if len(expr) > MAX_CRON_LENGTH:
        raise CronError(f"{len(expr)} characters, more than {MAX_CRON_LENGTH}")
    # ASCII only: str.isdigit(), int(), upper() and split() each accept more than cron means.
    bad = next((c for c in expr if not (" " <= c <= "~" or c == "\t")), None)
    if bad is not None:
        raise CronError(f"{_shown(expr)!r}: character {bad!r}; use ASCII letters, digits, spaces and * ? , - / @")
    text = expr.strip()
    text = _SHORTHANDS.get(text.lower(), text)
    if text.startswith("@"):
        raise CronError(f"unknown shorthand {text!r} (known: {', '.join(_SHORTHANDS)})")
    parts = text.split()
    if len(parts) == 5:
        parts = ["0", *parts]
    elif len(parts) != 6:
        raise CronError(
            f"{expr!r} has {len(parts)} fields; give five (minute hour day-of-month month day-of-week) "
            "or six with seconds first"
        )
    sets = [_field(part, *spec) for part, spec in zip(parts, _FIELDS, strict=True)]
    weekdays = frozenset(d % 7 for d in sets[5])
    return Cron(sets[0], sets[1], sets[2], sets[3], sets[4], weekdays, parts[3][0] in "*?", parts[5][0] in "*?")


def _field(text: str, name: str, low: int, high: int, names: dict[str, int]) -> frozenset[int]:
    values: set[int] = set()
    for item in text.split(","):
        where = f"{name} field {text!r}"
        base, _, step_text = item.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit():
                raise CronError(f"{where}: step {step_text!r} is not a positive number")
            step = int(step_text)
            if not 1 <= step <= high - low + 1:
                raise CronError(f"{where}: step {step} is not between 1 and {high - low + 1}")
        if base in ("*", "?"):
            start, end = low, high
        elif "-" in base:
            a, _, b = base.partition("-")
            start, end = _value(a, where, low, high, names), _value(b, where, low, high, names)
            if start > end:
                raise CronError(f"{where}: range {base!r} runs backwards")
        else:
            start = _value(base, where, low, high, names)
            end = high if step_text else start
        values.update(range(start, end + 1, step))
    return frozenset(values)


def _value(text: str, where: str, low: int, high: int, names: dict[str, int]) -> int:
    if text.upper() in names:
        return names[text.upper()]
    if not (text.isascii() and text.isdigit()):
        raise CronError(f"{where}: {text!r} is not a number" + (f" or a name ({', '.join(names)})" if names else ""))
    value = int(text)
    if not low <= value <= high:
        raise CronError(f"{where}: {value} is not between {low} and {high}")
    return value


def zone(name: str) -> ZoneInfo:
    """The IANA zone (UTC when empty); raises CronError when unknown."""
    if not name:
        return ZoneInfo("UTC")
    try:
        if len(name) > MAX_ZONE_LENGTH or not name.isascii():
            raise ValueError(name)
        return ZoneInfo(name)
    # OSError: a name of the database's directories ("Europe"), or too long a file name.
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise CronError(f"unknown IANA zone {_shown(name)!r} (e.g. 'Europe/Paris', 'UTC')") from None


def _shown(text: str) -> str:
    return text if len(text) <= 64 else text[:64] + "…"


def _next_wall(cron: Cron, t: dt.datetime, last_year: int) -> dt.datetime | None:
    """The first wall-clock time at or after t (naive, whole seconds) that matches."""
    while t.year <= last_year:
        if t.month not in cron.months:
            t = _first_of_next_month(t)
            continue
        if not cron.day_matches(t.date()):
            t = dt.datetime(t.year, t.month, t.day) + dt.timedelta(days=1)
            continue
        if t.hour not in cron.hours:
            t = t.replace(minute=0, second=0) + dt.timedelta(hours=1)
            continue
        if t.minute not in cron.minutes:
            t = t.replace(second=0) + dt.timedelta(minutes=1)
            continue
        if t.second not in cron.seconds:
            t += ONE_SECOND
            continue
        return t
    return None


def _first_of_next_month(t: dt.datetime) -> dt.datetime:
    return dt.datetime(t.year + 1, 1, 1) if t.month == 12 else dt.datetime(t.year, t.month + 1, 1)


def _instant_us(wall: dt.datetime, tz: ZoneInfo) -> int | None:
    """The wall time's first occurrence in µs since the epoch; None when it does not exist."""
    aware = wall.replace(tzinfo=tz, fold=0)
    utc = aware.astimezone(UTC)
    if utc.astimezone(tz).replace(tzinfo=None) != wall:
        return None  # in a gap: the clocks skipped it
    return (utc - dt.datetime(1970, 1, 1, tzinfo=UTC)) // dt.timedelta(microseconds=1)


def next_after(cron: Cron, tz: ZoneInfo, instant_us: int) -> int | None:
    """The first slot strictly after instant_us (µs UTC), in µs UTC; None if none comes within
    SEARCH_YEARS. Wall times map to instants in increasing order (gaps skipped, repeated times
    at their first occurrence), so the search walks wall time from the instant's own."""
    start = dt.datetime.fromtimestamp(instant_us // 1_000_000, tz).replace(tzinfo=None)
    last_year = min(start.year + SEARCH_YEARS, dt.MAXYEAR - 1)
    wall = _next_wall(cron, start, last_year)
    while wall is not None:
        at = _instant_us(wall, tz)
        if at is not None and at > instant_us:
            return at
        wall = _next_wall(cron, wall + ONE_SECOND, last_year)
    return None


def latest_at_or_before(cron: Cron, tz: ZoneInfo, after_us: int, instant_us: int) -> int | None:
    """The last slot in (after_us, instant_us], or None when there is none. Looks back over
    windows that double in size, so a long downtime costs a few searches, not one per slot."""
    window = 1_000_000
    while True:
        since = max(after_us, instant_us - window)
        slot = next_after(cron, tz, since)
        if slot is not None and slot <= instant_us:
            while (later := next_after(cron, tz, slot)) is not None and later <= instant_us:
                slot = later
            return slot
        if since == after_us:
            return None
        window *= 2
