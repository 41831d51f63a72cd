"""Caps on what callers send: sizes of names, labels and texts, and characters allowed in them."""

from __future__ import annotations

from ..errors import invalid

MAX_KEY_LENGTH = 256
MAX_CONTENT_TYPE = 256
MAX_REQUEST_ID = 128
# What a worker states about itself.
MAX_WORKER_NAME = 256
MAX_LABELS = 64
MAX_LABEL_KEY = 128
MAX_LABEL_VALUE = 1024
# An error text longer than this is cut, with a marker saying how much was dropped.
MAX_ERROR_BYTES = 16 << 10
# What one worker call carries (FinishTasks, Heartbeat, LeaseTasks, RegisterWorker, a message of
# a Work stream): a list longer than its cap is refused whole, before any of it is worked on.
# The SDKs send at most 1,000 outcomes a message.
MAX_OUTCOMES = 10_000
MAX_DONE = 10_000
# Credits a Work stream may hold unused (a worker's free slots); a heartbeat names every attempt
# a worker holds, so it may name as many.
MAX_WORK_CREDITS = 100_000
MAX_HEARTBEAT_TASKS = MAX_WORK_CREDITS
MAX_WORKER_POOLS = 1_000
# Outcomes and heartbeat entries reach the store this many at a time, each part a transaction
# of its own: a long list does not hold other callers' writes for long.
STORE_CHUNK = 1_000

TRUNCATED = "… [truncated {n} bytes]"


def check_text(field: str, value: str, limit: int) -> None:
    """A caller-chosen name or label: bounded, and free of control characters (they forge log lines)."""
    if len(value) > limit:
        raise invalid(f"{field}: {len(value)} characters, more than {limit}")
    bad = next((c for c in value if ord(c) < 32 or 127 <= ord(c) < 160), None)
    if bad is not None:
        raise invalid(f"{field}: control character {bad!r} in {value[:64]!r}")


def check_count(field: str, count: int, limit: int, what: str) -> None:
    """A list of a worker call: at most limit entries."""
    if count > limit:
        raise invalid(f"{field}: {count} {what}, more than {limit} in one message")


def cap_error(text: str) -> str:
    """An error text cut to MAX_ERROR_BYTES (UTF-8), with a marker naming what was dropped."""
    data = text.encode()
    if len(data) <= MAX_ERROR_BYTES:
        return text
    kept = data[: MAX_ERROR_BYTES - 64].decode(errors="ignore")
    return kept + TRUNCATED.format(n=len(data) - len(kept.encode()))


# Keys of schedules' tasks start with this; a submission may not use it (it could take a
# future slot's key and so suppress that fire).
SCHEDULE_KEY_PREFIX = "schedule:"
