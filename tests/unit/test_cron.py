"""core.cron: parsing (five fields or six with seconds first), the Vixie day rule, and slots
around DST changes checked against explicit tables of UTC instants."""

from __future__ import annotations

import datetime as dt

import pytest

from cronoq_server.core.cron import CronError, latest_at_or_before, next_after, parse, zone


def us(text: str) -> int:
    """µs since the epoch of an ISO time with its offset (or Z)."""
    return int(dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1_000_000)


def iso(at_us: int) -> str:
    return dt.datetime.fromtimestamp(at_us / 1e6, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def slots(expr: str, tz: str, start: str, n: int) -> list[str]:
    cron, zi, at = parse(expr), zone(tz), us(start)
    out = []
    for _ in range(n):
        nxt = next_after(cron, zi, at)
        assert nxt is not None
        out.append(iso(nxt))
        at = nxt
    return out


@pytest.mark.parametrize(
    ("expr", "field"),
    [
        ("* * * *", "has 4 fields"),
        ("* * * * * * *", "has 7 fields"),
        ("", "has 0 fields"),
        ("60 * * * *", "minute field '60': 60 is not between 0 and 59"),
        ("* 24 * * *", "hour field '24'"),
        ("* * 0 * *", "day-of-month field '0'"),
        ("* * * 13 *", "month field '13'"),
        ("* * * * 8", "day-of-week field '8'"),
        ("* * * FOO *", "month field 'FOO': 'FOO' is not a number or a name"),
        ("*/0 * * * *", "step 0 is not between 1 and 60"),
        ("5-1 * * * *", "range '5-1' runs backwards"),
        ("61 * * * * *", "second field '61'"),
        ("x * * * *", "minute field 'x'"),
        ("@often", "unknown shorthand"),
    ],
)
def test_bad_expressions_name_the_field(expr: str, field: str) -> None:
    with pytest.raises(CronError, match=None) as err:
        parse(expr)
    assert field in str(err.value)


def test_unknown_zone() -> None:
    with pytest.raises(CronError, match="unknown IANA zone 'Mars/Olympus'"):
        zone("Mars/Olympus")
    assert str(zone("")) == "UTC"


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("*/\u00b2 * * * *", "'\u00b2'"),  # superscript two: isdigit(), yet not a number int() reads
        ("*/\u0661 * * * *", "'\u0661'"),  # Arabic-Indic one: int() would read it as 1
        ("*/\uff15 * * * *", "'\uff15'"),  # fullwidth five
        ("0-5/\u0661 * * * *", "'\u0661'"),
        ("* * * * \u017fun", "'\u017f'"),  # long s: upper() makes it SUN
        ("*\x1c*\x1c*\x1c*\x1c*", "'\\x1c'"),  # str.split() takes it for a space
        ("* * * * *\x00", "'\\x00'"),
        ("* * * * *\n", "'\\n'"),
        ("*/99999999999999999999999 * * * *", "step 99999999999999999999999 is not between 1 and 60"),
        ("*/61 * * * *", "step 61 is not between 1 and 60"),
        ("0 0 */32 * *", "step 32 is not between 1 and 31"),
        ("*/-1 * * * *", "step '-1'"),
        ("0-99999999999999999999 * * * *", "99999999999999999999 is not between 0 and 59"),
        ("1-2-3 * * * *", "minute field '1-2-3'"),
        ("1" + ",1" * 200, "more than 256"),
    ],
)
def test_hostile_expressions_are_refused(expr: str, problem: str) -> None:
    with pytest.raises(CronError) as err:
        parse(expr)
    assert problem in str(err.value), str(err.value)


def test_steps_up_to_the_field_span_are_kept() -> None:
    assert parse("*/60 * * * *").minutes == {0}
    assert parse("*/1 * * * *").minutes == set(range(60))


@pytest.mark.parametrize(
    "name",
    [
        "Europe",  # a directory of the zone database
        "America/Argentina",
        "x" * 300,  # longer than a file name may be
        "Europe/" + "a" * 250,
        "../etc/passwd",
        "/etc/localtime",
        "Europe/../UTC",
        "UTC\x00",
        "Europe/Paris\n",
        "\uff35\uff34\uff23",  # fullwidth UTC
        "zone.tab",
        "utc",
        " UTC",
    ],
)
def test_hostile_zones_are_unknown(name: str) -> None:
    with pytest.raises(CronError, match="unknown IANA zone"):
        zone(name)


def test_five_fields_fire_at_second_zero_and_six_take_seconds_first() -> None:
    assert slots("*/15 * * * *", "UTC", "2026-01-01T00:00:00Z", 3) == [
        "2026-01-01T00:15:00Z",
        "2026-01-01T00:30:00Z",
        "2026-01-01T00:45:00Z",
    ]
    assert slots("*/5 * * * * *", "UTC", "2026-01-01T00:00:03Z", 3) == [
        "2026-01-01T00:00:05Z",
        "2026-01-01T00:00:10Z",
        "2026-01-01T00:00:15Z",
    ]
    assert slots("30 0 12 * * *", "UTC", "2026-01-01T12:00:30Z", 1) == ["2026-01-02T12:00:30Z"]


def test_strictly_after_a_sub_second_instant() -> None:
    cron = parse("* * * * * *")
    assert iso(next_after(cron, zone("UTC"), us("2026-01-01T00:00:00Z") + 1) or 0) == "2026-01-01T00:00:01Z"
    assert iso(next_after(cron, zone("UTC"), us("2026-01-01T00:00:00Z") - 1) or 0) == "2026-01-01T00:00:00Z"


def test_lists_ranges_steps_and_names() -> None:
    assert slots("0 9-17/4,20 * * MON-FRI", "UTC", "2026-03-06T12:00:00Z", 5) == [
        "2026-03-06T13:00:00Z",  # Friday
        "2026-03-06T17:00:00Z",
        "2026-03-06T20:00:00Z",
        "2026-03-09T09:00:00Z",  # Monday
        "2026-03-09T13:00:00Z",
    ]
    assert slots("0 0 1 jan,Jul *", "UTC", "2026-01-01T00:00:00Z", 2) == [
        "2026-07-01T00:00:00Z",
        "2027-01-01T00:00:00Z",
    ]
    assert slots("0 0 * * 7", "UTC", "2026-03-01T00:00:00Z", 1) == ["2026-03-08T00:00:00Z"]  # 7 is Sunday
    assert slots("0 0 10/10 * *", "UTC", "2026-03-01T00:00:00Z", 3) == [
        "2026-03-10T00:00:00Z",
        "2026-03-20T00:00:00Z",
        "2026-03-30T00:00:00Z",
    ]
    assert slots("@hourly", "UTC", "2026-03-01T00:30:00Z", 1) == ["2026-03-01T01:00:00Z"]
    assert slots("0 0 ? * SAT", "UTC", "2026-03-01T00:00:00Z", 1) == ["2026-03-07T00:00:00Z"]


def test_day_of_month_or_day_of_week_when_both_are_restricted() -> None:
    # The 13th, and every Friday (Vixie cron): 2026-03-06 is a Friday.
    assert slots("0 0 13 * FRI", "UTC", "2026-03-01T00:00:00Z", 4) == [
        "2026-03-06T00:00:00Z",
        "2026-03-13T00:00:00Z",
        "2026-03-20T00:00:00Z",
        "2026-03-27T00:00:00Z",
    ]
    # A star (even stepped) in one of them: both must match.
    assert slots("0 0 */1 * FRI", "UTC", "2026-03-01T00:00:00Z", 1) == ["2026-03-06T00:00:00Z"]
    assert slots("0 0 13 * *", "UTC", "2026-03-01T00:00:00Z", 1) == ["2026-03-13T00:00:00Z"]


def test_rare_and_impossible_dates() -> None:
    assert slots("0 0 29 2 *", "UTC", "2026-01-01T00:00:00Z", 2) == ["2028-02-29T00:00:00Z", "2032-02-29T00:00:00Z"]
    assert next_after(parse("0 0 30 2 *"), zone("UTC"), us("2026-01-01T00:00:00Z")) is None


# -- DST: America/New_York springs forward 2026-03-08 02:00 EST (07:00Z) to 03:00 EDT, and falls
# back 2026-11-01 02:00 EDT (06:00Z) to 01:00 EST.

DST_TABLE = [
    # The 02:30 of 2026-03-08 does not exist: skipped.
    ("30 2 * * *", "America/New_York", "2026-03-06T12:00:00Z", [
        "2026-03-07T07:30:00Z",  # 02:30 EST
        "2026-03-09T06:30:00Z",  # 02:30 EDT
        "2026-03-10T06:30:00Z",
    ]),
    # The 01:30 of 2026-11-01 happens twice: fires once, at the first (EDT).
    ("30 1 * * *", "America/New_York", "2026-10-30T12:00:00Z", [
        "2026-10-31T05:30:00Z",  # 01:30 EDT
        "2026-11-01T05:30:00Z",  # 01:30 EDT, the first of two
        "2026-11-02T06:30:00Z",  # 01:30 EST
    ]),
    # Hourly across the spring change: 00:00 EST, 01:00 EST, (02:00 missing), 03:00 EDT, 04:00 EDT.
    ("0 * * * *", "America/New_York", "2026-03-08T04:30:00Z", [
        "2026-03-08T05:00:00Z",
        "2026-03-08T06:00:00Z",
        "2026-03-08T07:00:00Z",
        "2026-03-08T08:00:00Z",
    ]),
    # Hourly across the fall change: 00:00 EDT, 01:00 EDT, (01:00 EST again: not fired), 02:00 EST.
    ("0 * * * *", "America/New_York", "2026-11-01T03:30:00Z", [
        "2026-11-01T04:00:00Z",
        "2026-11-01T05:00:00Z",
        "2026-11-01T07:00:00Z",
        "2026-11-01T08:00:00Z",
    ]),
    # Europe/Berlin springs forward 2026-03-29 02:00 CET (01:00Z) to 03:00 CEST.
    ("0 30 2 * * *", "Europe/Berlin", "2026-03-27T12:00:00Z", [
        "2026-03-28T01:30:00Z",
        "2026-03-30T00:30:00Z",
    ]),
    # Australia/Lord_Howe moves by half an hour: falls back 2026-04-05 02:00 (+11) to 01:30 (+10:30).
    ("45 1 * * *", "Australia/Lord_Howe", "2026-04-03T12:00:00Z", [
        "2026-04-03T14:45:00Z",  # 01:45 +11 on 04-04
        "2026-04-04T14:45:00Z",  # 01:45 +11 on 04-05, the first of two
        "2026-04-05T15:15:00Z",  # 01:45 +10:30
    ]),
]  # fmt: skip


@pytest.mark.parametrize(("expr", "tz", "start", "expected"), DST_TABLE)
def test_dst_slots_match_the_table(expr: str, tz: str, start: str, expected: list[str]) -> None:
    assert slots(expr, tz, start, len(expected)) == expected


def test_from_inside_the_repeated_hour_the_next_slot_is_after_it() -> None:
    # 06:30Z is 01:30 EST, the second 01:30: every-second slots resume at 02:00 EST.
    assert slots("* * * * * *", "America/New_York", "2026-11-01T06:30:00Z", 2) == [
        "2026-11-01T07:00:00Z",
        "2026-11-01T07:00:01Z",
    ]
    # Inside the spring gap's wall hour nothing fires; 03:00 EDT is the next second.
    assert slots("* * * * * *", "America/New_York", "2026-03-08T06:59:59Z", 2) == [
        "2026-03-08T07:00:00Z",
        "2026-03-08T07:00:01Z",
    ]


def test_latest_missed_slot() -> None:
    cron, utc = parse("*/5 * * * * *"), zone("UTC")
    after, now = us("2026-01-01T00:00:00Z"), us("2026-01-03T07:08:09Z")
    assert iso(latest_at_or_before(cron, utc, after, now) or 0) == "2026-01-03T07:08:05Z"
    assert latest_at_or_before(cron, utc, now - 2_000_000, now) is None
    daily = parse("0 3 * * *")
    assert iso(latest_at_or_before(daily, utc, after, now) or 0) == "2026-01-03T03:00:00Z"
    assert iso(latest_at_or_before(daily, utc, after, us("2026-01-03T03:00:00Z")) or 0) == "2026-01-03T03:00:00Z"
