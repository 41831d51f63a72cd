"""The fast JSON form of a Task and a TaskEvent (Watch over SSE) is json_format's, exactly."""

from __future__ import annotations

import json
import random

from cronoq.jsonform import task_event_to_dict, to_dict
from cronoq.v1 import task_pb2, task_service_pb2

PAYLOAD_FIELDS = ("payload", "payload_json", "result", "result_json", "checkpoint")


def random_event(rng: random.Random) -> task_pb2.TaskEvent:
    task = task_pb2.Task(
        id=rng.choice([0, 1, 2**63 + 5, 2**64 - 1]),
        pool=rng.choice(["", "default", "p\u00e9 <img>"]),
        key=rng.choice(["", "k", "</script>"]),
        content_type=rng.choice(["", "application/json", "text/plain"]),
        priority=rng.choice([0, -5, 7]),
        max_attempts=rng.choice([0, 3]),
        depends_on=rng.sample([1, 2, 2**60], rng.randint(0, 3)),
        resources=rng.choice([{}, {"gpu": 1, "api": 2**40}]),
        state=rng.choice(list(task_pb2.TaskState.values())),
        attempt=rng.randint(0, 4),
        worker_id=rng.choice(["", "w-1"]),
        error=rng.choice(["", "boom\n\u2603"]),
        cancel_requested=rng.random() < 0.5,
        result_content_type=rng.choice(["", "application/json"]),
        timeout_ms=rng.choice([0, 1500, 2**40]),
        group_key=rng.choice(["", "tenant-1", "gr\u00fcppe </b>"]),
        snoozes=rng.choice([0, 3]),
        checkpoint=rng.choice([b"", b"page-3", b"\xff\x00"]),
    )
    if rng.random() < 0.5:
        task.progress.value = rng.choice([0.0, 0.5, 1e300, -2.25, 1 / 3])
        task.progress.message = rng.choice(["", "page 3 of 4 \u2603"])
        if rng.random() < 0.7:
            task.progress.updated_at.FromNanoseconds(1_764_000_000_123_000_000)
    if rng.random() < 0.3:
        task.trace.traceparent = rng.choice(["", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"])
        task.trace.tracestate = rng.choice(["", "k=v"])
        task.trace.link = rng.random() < 0.5
    task.payload = rng.choice([b"", b'{"a": [1, 2]}', b"\xff\x00 not json", b"null"])
    task.result = rng.choice([b"", b'"done"', b"\x00\x01", b"{bad"])
    for name in ("run_at", "created_at", "started_at", "finished_at", "lease_expires_at"):
        if rng.random() < 0.7:
            getattr(task, name).FromNanoseconds(
                rng.choice(
                    [
                        0,
                        10**9,
                        -(10**9) * 86_400 * 400 + 5_000_000,  # before 1970
                        253_402_300_799 * 10**9 + 999_999_999,  # the last valid instant
                        1_764_000_000_123_000_000,
                        1_764_000_000_123_456_000,
                        1_764_000_000_123_456_789,
                    ]
                )
            )
    event = task_pb2.TaskEvent(
        shard=rng.choice(["", "cpu"]),
        seq=rng.choice([0, 7, 2**62]),
        cursor=rng.choice(["", "1:7"]),
        progress=rng.random() < 0.5,
    )
    if rng.random() < 0.9:
        event.task.CopyFrom(task)
    if rng.random() < 0.8:
        event.time.FromNanoseconds(rng.choice([1_764_000_000_000_001_000, 1_764_000_000_010_000_000]))
    return event


def test_task_events_match_json_format_with_and_without_payloads() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        event = random_event(rng)
        want = to_dict(task_service_pb2.WatchResponse(event=event))["event"]
        assert task_event_to_dict(event) == want
        assert json.dumps(task_event_to_dict(event), sort_keys=True) == json.dumps(want, sort_keys=True)
        if "task" in want:
            for name in PAYLOAD_FIELDS:
                want["task"].pop(name, None)
        assert task_event_to_dict(event, include_payloads=False) == want
