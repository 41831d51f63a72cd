"""Caps on what callers send: sizes of names, labels and texts, and characters allowed in them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..errors import invalid

MAX_KEY_LENGTH = 256
MAX_GROUP_KEY_BYTES = 256  # UTF-8
MAX_CONTENT_TYPE = 256
MAX_REQUEST_ID = 128
# What a worker states about itself.
MAX_WORKER_NAME = 256
MAX_LABELS = 64
MAX_LABEL_KEY = 128
MAX_LABEL_VALUE = 1024
# An error text longer than this is cut, with a marker saying how much was dropped.
MAX_ERROR_BYTES = 16 << 10
# A handler's report (TaskReport): its progress message, and its checkpoint.
MAX_PROGRESS_MESSAGE_BYTES = 1024
MAX_CHECKPOINT_BYTES = 256 << 10
# A task's W3C tracestate (the W3C spec's own bound is 32 members; 512 bytes is what SDKs send).
MAX_TRACESTATE_BYTES = 512
# A pool's max_snoozes when its config does not set one.
DEFAULT_MAX_SNOOZES = 100
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


# Line separators and bidirectional controls: refused as C0, DEL and C1 are (they break a line
# where a reader sees none, or show a text in another order than it is stored).
LINE_AND_BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)


def is_control(c: str) -> bool:
    """A character no caller-chosen text may hold: C0, DEL, C1, a line separator or a bidi control."""
    return ord(c) < 32 or 127 <= ord(c) < 160 or c in LINE_AND_BIDI_CONTROLS


def check_text(field: str, value: str, limit: int, in_bytes: bool = False, where: str = "") -> None:
    """A caller-chosen name or label: bounded (in characters, or in UTF-8 bytes), and free of
    control characters (is_control: they forge log lines). A refusal names `where` + field
    (built only then: submissions check several fields of every task)."""
    size, unit = (len(value.encode()), "bytes") if in_bytes else (len(value), "characters")
    if size > limit:
        shown = f"{value[:64]!r}{'…' if len(value) > 64 else ''}"
        raise invalid(f"{where}{field}: {size} {unit}, more than {limit}: {shown}")
    bad = next((c for c in value if is_control(c)), None)
    if bad is not None:
        raise invalid(f"{where}{field}: control character {bad!r} in {value[:64]!r}")


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


# -- numeric fields of tasks and schedules ---------------------------------------
# Each numeric field a caller sets on a task or a schedule's template has a finite range,
# checked here in one place: stored values stay far from int64's edges, so no arithmetic on
# them overflows (a timeout_ms near 2^63 once failed every lease of its pool on PostgreSQL).
# Other requests' numbers are clamped where they are read (page_size, wait and lease sizes).
MAX_TIMEOUT_MS = 7 * 86_400_000  # 7 days; a pool's `timeout` has the same bound
MAX_ATTEMPTS = 1000


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric field may take, and what its bounds mean (said in a refusal)."""

    low: int
    high: int
    meaning: str


# A keyed submission's debounce (debounce_ms, max_debounce_ms) and its key's hold after it ended.
MAX_DEBOUNCE_MS = 7 * 86_400_000
MAX_KEY_TTL_MS = 366 * 86_400_000
KEY_RANGES = {
    "debounce_ms": Range(0, MAX_DEBOUNCE_MS, "at most 7 days"),
    "max_debounce_ms": Range(0, MAX_DEBOUNCE_MS, "at most 7 days; 0: no bound"),
    "key_ttl_ms": Range(0, MAX_KEY_TTL_MS, "at most 366 days; 0: the key is held until the task is deleted"),
}

TASK_RANGES = {
    "priority": Range(-(2**31), 2**31 - 1, "any int32; higher runs first"),
    "max_attempts": Range(0, MAX_ATTEMPTS, "0 takes the pool's default"),
    "timeout_ms": Range(0, MAX_TIMEOUT_MS, "at most 7 days; 0 takes the pool's timeout"),
}

# How many more attempts a retried task that used all of its attempts gets.
RETRY_EXTRA_ATTEMPTS = Range(0, MAX_ATTEMPTS, "0 gives one more")

# A worker's concurrency (shown in listings): no more than its credits may reach.
WORKER_CONCURRENCY = Range(0, MAX_WORK_CREDITS, "what the worker runs at once")


def check_range(field: str, value: int, allowed: Range, where: str = "") -> None:
    """Refuses a value outside its range, naming `where` + field, the value and the range."""
    if not allowed.low <= value <= allowed.high:
        raise invalid(f"{where}{field}: {value} is not between {allowed.low} and {allowed.high} ({allowed.meaning})")


# -- what one gRPC request message may hold ---------------------------------------
# Checked on the message's bytes before it is parsed: parsing a message of many small entries
# takes several times its size in memory, so a limit checked only after parsing protects nothing.
# The SDKs' channels send at most this much in one message, and pack outcomes and reports up to it.
MESSAGE_CEILING = 64 << 20
# A request of names, ids, filters and cursors.
SMALL_REQUEST_BYTES = 64 << 10
# RegisterWorker and LeaseTasks: up to MAX_WORKER_POOLS pool names, MAX_LABELS labels and
# MAX_DONE attempts.
WORKER_REQUEST_BYTES = 1 << 20
# Everything of a submission besides its payload: key, dependencies, resources, trace context.
TASK_FIELDS_BYTES = 256 << 10
# Everything of an outcome besides its result: the error kept (longer is cut), and its report.
OUTCOME_FIELDS_BYTES = MAX_ERROR_BYTES + MAX_CHECKPOINT_BYTES + (4 << 10)


class SizedLimits(Protocol):
    """The [limits] a request's size derives from (config.LimitsConfig)."""

    max_payload_bytes: int
    max_result_bytes: int
    max_batch_size: int


@dataclass(frozen=True, slots=True)
class ListCap:
    """A list of a request counted on the wire before the message is parsed."""

    field: str  # its path: "outcomes", "heartbeat.tasks"
    limit: int
    what: str  # what its entries are, as check_count says it


@dataclass(frozen=True, slots=True)
class RequestLimit:
    """What one request message of an RPC may hold: bytes (and what they derive from), and lists."""

    max_bytes: int
    basis: str
    lists: tuple[ListCap, ...] = ()


_OUTCOMES = ListCap("outcomes", MAX_OUTCOMES, "outcomes")
_POOLS = ListCap("pools", MAX_WORKER_POOLS, "pools")
_HEARTBEAT = (ListCap("tasks", MAX_HEARTBEAT_TASKS, "attempts"), ListCap("reports", MAX_HEARTBEAT_TASKS, "reports"))
# A report of a running handler: its checkpoint and progress.
REPORT_BYTES = MAX_CHECKPOINT_BYTES + MAX_PROGRESS_MESSAGE_BYTES + 64


def request_limits(limits: SizedLimits) -> dict[str, RequestLimit]:
    """The limit of each RPC's request message by RPC name, from [limits]; an RPC not named
    takes small_request_limit()."""
    task = limits.max_payload_bytes + TASK_FIELDS_BYTES
    outcome = limits.max_result_bytes + OUTCOME_FIELDS_BYTES
    task_basis = "limits.max_payload_bytes + 256 KiB for a task's other fields"
    sdk = "up to the 64 MiB an SDK sends"

    def packed(one: int, many: int) -> int:
        """A list of entries of up to `one` byte each: as many as fit under the SDKs' ceiling."""
        return max(one, min(many, MESSAGE_CEILING))

    worker = RequestLimit(WORKER_REQUEST_BYTES, "1 MiB for a worker's pools, labels and attempts")
    outcomes_basis = f"outcomes of up to limits.max_result_bytes + {OUTCOME_FIELDS_BYTES >> 10} KiB each, {sdk}"
    return {
        "SubmitTask": RequestLimit(task, task_basis),
        "PutSchedule": RequestLimit(task, task_basis),
        "SubmitBatch": RequestLimit(
            packed(task, limits.max_batch_size * task),
            f"limits.max_batch_size tasks of {task_basis}, {sdk}",
            (ListCap("tasks", limits.max_batch_size, "tasks"),),
        ),
        "RegisterWorker": worker,
        "LeaseTasks": worker,
        "FinishTasks": RequestLimit(packed(outcome, MAX_OUTCOMES * outcome), outcomes_basis, (_OUTCOMES,)),
        "Heartbeat": RequestLimit(
            packed(REPORT_BYTES, MAX_HEARTBEAT_TASKS * REPORT_BYTES),
            f"reports of up to {REPORT_BYTES >> 10} KiB each, {sdk}",
            _HEARTBEAT,
        ),
        "Work": RequestLimit(
            packed(outcome + REPORT_BYTES, MAX_OUTCOMES * outcome + MAX_HEARTBEAT_TASKS * REPORT_BYTES),
            f"{outcomes_basis}, and a heartbeat",
            (_OUTCOMES, _POOLS, *(ListCap(f"heartbeat.{c.field}", c.limit, c.what) for c in _HEARTBEAT)),
        ),
    }


def small_request_limit() -> RequestLimit:
    return RequestLimit(SMALL_REQUEST_BYTES, "64 KiB for a request of names, ids and filters")


def largest_request(limits: SizedLimits) -> int:
    """The most bytes any request may hold: the receive limit of the server and of its peer channels."""
    return max(SMALL_REQUEST_BYTES, *(r.max_bytes for r in request_limits(limits).values()))
