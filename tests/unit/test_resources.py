"""The leader's resource accounting (core/resources.py), on a fake clock."""

from __future__ import annotations

import pytest

from cronoq_server.config import ResourceConfig
from cronoq_server.core.resources import ResourceGate
from cronoq_server.store.base import Held


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock | None = None) -> ResourceGate:
    return ResourceGate(
        [ResourceConfig(name="gpu", concurrency=2), ResourceConfig(name="api", rate=5.0, burst=1)], clock or Clock()
    )


def test_concurrency_slots_are_held_until_the_attempt_ends() -> None:
    g = gate()
    assert g.available() == {"gpu": 2, "api": 1}
    g.take("w", [Held(1, 1, {"gpu": 1}), Held(2, 1, {"gpu": 1})])
    assert "gpu" not in g.available()
    assert not g.release([(1, 2)])  # another attempt of task 1: not the one holding the slot
    assert g.release([(1, 1)])
    assert g.available()["gpu"] == 1
    assert [(u.name, u.in_use, u.capacity) for u in g.usage() if u.capacity] == [("gpu", 1, 2)]


def test_rate_is_a_token_bucket() -> None:
    clock = Clock()
    g = gate(clock)
    g.take("w", [Held(1, 1, {"api": 1})])  # the burst
    assert "api" not in g.available()
    assert abs((g.next_token_in() or 0) - 0.2) < 1e-9
    clock.now += 0.2
    assert g.available()["api"] == 1
    g.take("w", [Held(2, 1, {"api": 1})])
    clock.now += 10  # idle time refills up to the burst (and a quarter token) only
    assert g.available()["api"] == 1
    assert not g.release([(2, 1)])  # tokens are spent, not held


@pytest.mark.parametrize("entry", ["api", "api:k"])
def test_a_late_start_does_not_lower_the_rate(entry: str) -> None:
    clock = Clock()
    per_key = entry != "api"  # a key's bucket banks a late start as the plain one does
    g = ResourceGate([ResourceConfig(name="api", rate=5.0, burst=1, per_key=per_key)], clock)
    starts = []
    t = clock.now
    for _ in range(30):  # every start comes 30 ms after its token is due
        wait = g.next_token_in() or 0.0
        clock.now += wait + 0.030
        assert g.available().get(entry, g.available().get("api:", 0)) == 1
        g.take("w", [Held(len(starts), 1, {entry: 1})])
        starts.append(clock.now - t)
    assert starts[-1] < 6.0  # 30 starts within 6 s at 5/s, despite the lateness
    for i, s in enumerate(starts):  # and never more than rate + burst in any second
        assert sum(1 for x in starts[i:] if x < s + 1.0) <= 6


def test_rebuild_counts_running_tasks_of_the_previous_leader() -> None:
    g = gate()
    g.rebuild([("w", Held(7, 3, {"gpu": 2})), ("w", Held(8, 1, {"api": 1}))])
    assert "gpu" not in g.available()
    assert g.release([(7, 3)])
    assert g.available()["gpu"] == 2


def test_a_re_leased_task_frees_its_earlier_attempts_slots() -> None:
    g = gate()
    g.take("w", [Held(1, 1, {"gpu": 1})])
    g.take("w", [Held(1, 2, {"gpu": 1})])  # attempt 1 ended without its end being seen yet
    assert g.available()["gpu"] == 1
    assert not g.release([(1, 1)])  # the late news of attempt 1 frees nothing more
    assert g.release([(1, 2)])
    assert g.available()["gpu"] == 2


def test_a_worker_frees_only_its_own_returned_attempts() -> None:
    g = gate()
    g.take("w1", [Held(1, 1, {"gpu": 1})])
    g.take("w2", [Held(2, 1, {"gpu": 1})])
    assert not g.release([(2, 1)], "w1")  # w1 cannot free w2's slot
    assert g.release([(1, 1)], "w1")
    assert g.available()["gpu"] == 1


def group_gate() -> ResourceGate:
    return ResourceGate([], Clock(), group_caps={"tenants": 2})


def test_a_group_holds_at_most_its_cap_until_its_attempts_end() -> None:
    g = group_gate()
    assert g.enabled and g.group_room(["tenants", "other"]) == {"tenants": (2, {})}
    g.take("w", [Held(1, 1, {}, "tenants", "a"), Held(2, 1, {}, "tenants", "a"), Held(3, 1, {}, "tenants", "b")])
    assert g.group_room(["tenants"]) == {"tenants": (2, {"a": 2, "b": 1})}
    assert not g.release([(1, 1)], worker_id="someone else")
    assert g.release([(1, 1)])
    assert g.release([(3, 1)])  # a group with nothing running is forgotten
    assert g.group_room(["tenants"]) == {"tenants": (2, {"a": 1})}
    assert [(u.pool, u.group_key, u.running) for u in g.group_usage("tenants")] == [("tenants", "a", 1)]


def test_a_pool_without_a_cap_holds_no_group_place() -> None:
    g = group_gate()
    g.take("w", [Held(1, 1, {}, "other", "a")])
    assert g.group_room(["other"]) == {} and not g.release([(1, 1)])


def test_groups_are_rebuilt_from_the_running_tasks_on_takeover() -> None:
    g = ResourceGate([ResourceConfig(name="gpu", concurrency=2)], Clock(), group_caps={"tenants": 3})
    g.take("w", [Held(9, 1, {"gpu": 1}, "tenants", "old")])
    g.rebuild(
        [
            ("w", Held(1, 2, {"gpu": 1}, "tenants", "a")),
            ("w", Held(2, 1, {}, "tenants", "a")),
            ("w", Held(3, 1, {}, "x")),
        ]
    )
    assert g.group_room(["tenants"]) == {"tenants": (3, {"a": 2})}
    assert g.available() == {"gpu": 1}
    assert g.release([(1, 2)]) and g.group_room(["tenants"]) == {"tenants": (3, {"a": 1})}


def test_a_new_attempt_of_a_task_frees_what_its_earlier_one_held() -> None:
    g = group_gate()
    g.take("w", [Held(1, 1, {}, "tenants", "a")])
    g.take("v", [Held(1, 2, {}, "tenants", "a")])  # attempt 1 ended unannounced (its lease expired)
    assert g.group_room(["tenants"]) == {"tenants": (2, {"a": 1})}


def keyed(clock: Clock) -> ResourceGate:
    resources = [
        ResourceConfig(name="conn", concurrency=2, per_key=True),
        ResourceConfig(name="quota", rate=2.0, burst=2, per_key=True),
    ]
    return ResourceGate(iter(resources), clock)  # as the node gives them: read once


def test_each_key_has_its_own_slots_dropped_when_none_are_held() -> None:
    g = keyed(Clock())
    assert g.available() == {"conn:": 2, "quota:": 2}  # a key with no state: the full size
    g.take("w", [Held(1, 1, {"conn:a": 1}), Held(2, 1, {"conn:a": 1}), Held(3, 1, {"conn:b": 1})])
    free = g.available()
    assert free["conn:a"] == 0 and free["conn:b"] == 1 and free["conn:"] == 2
    [u] = [u for u in g.usage() if u.name == "conn"]
    assert (u.per_key, u.in_use, u.keys, u.keys_at_limit) == (True, 3, 2, ("a",))
    assert g.release([(1, 1), (3, 1)])
    assert "conn:b" not in g.available()  # idle: dropped
    assert g.available()["conn:a"] == 1
    assert g.release([(2, 1)])
    assert g.available() == {"conn:": 2, "quota:": 2}


def test_each_key_has_its_own_bucket_dropped_when_full_again() -> None:
    clock = Clock()
    g = keyed(clock)
    g.take("w", [Held(1, 1, {"quota:a": 1}), Held(2, 1, {"quota:a": 1}), Held(3, 1, {"quota:b": 1})])
    free = g.available()
    assert free["quota:a"] == 0 and free["quota:b"] == 1 and free["quota:"] == 2
    assert abs((g.next_token_in() or 0) - 0.5) < 1e-9
    [u] = [u for u in g.usage() if u.name == "quota"]
    assert (u.per_key, u.keys, u.keys_at_limit) == (True, 2, ("a",))
    clock.now += 0.5
    assert g.available()["quota:a"] == 1 and g.available()["quota:b"] == 2
    clock.now += 0.25  # b is full again, to its ceiling (burst and half a token): dropped
    assert g.available()["quota:a"] == 1 and "quota:b" not in g.available()
    clock.now += 10
    assert g.available() == {"conn:": 2, "quota:": 2}


def test_a_key_never_starts_more_than_rate_plus_burst_in_a_second() -> None:
    clock = Clock()
    g = keyed(clock)
    starts: list[float] = []
    for seq in range(40):  # two keys, each started as soon as it has a token, 30 ms late
        clock.now += (g.next_token_in() or 0.0) + 0.030
        free = g.available()
        for key in ("a", "b"):
            if free.get(f"quota:{key}", free["quota:"]) >= 1:
                g.take("w", [Held(seq * 2 + (key == "b"), 1, {f"quota:{key}": 1})])
                if key == "a":
                    starts.append(clock.now)
    for t in starts:
        assert sum(1 for s in starts if t <= s < t + 1) <= 2 + 2


def test_keyed_slots_are_rebuilt_from_the_running_tasks() -> None:
    g = keyed(Clock())
    g.take("w", [Held(9, 1, {"quota:a": 2})])
    g.rebuild([("w", Held(1, 1, {"conn:a": 2})), ("w", Held(2, 1, {"conn:b": 1}))])
    assert g.available() == {"conn:": 2, "conn:a": 0, "conn:b": 1, "quota:": 2}  # buckets start full
    assert g.release([(1, 1)])
    assert g.available() == {"conn:": 2, "conn:b": 1, "quota:": 2}


def test_room_after_counts_what_the_attempts_reported_free() -> None:
    g = ResourceGate([ResourceConfig(name="gpu", concurrency=2)], Clock(), group_caps={"tenants": 1})
    g.take("w", [Held(1, 1, {"gpu": 1}, "tenants", "a"), Held(2, 1, {"gpu": 1}, "tenants", "b")])
    assert g.room_after([], "w", ["tenants"]) == ({}, {"tenants": (1, {"a": 1, "b": 1})})
    # Only this worker's current attempts count: attempt 2 of task 2, or another worker's, free nothing.
    assert g.room_after([(1, 1), (2, 2)], "w", ["tenants"]) == ({"gpu": 1}, {"tenants": (1, {"b": 1})})
    assert g.room_after([(1, 1)], "v", ["tenants"]) == ({}, {"tenants": (1, {"a": 1, "b": 1})})
    assert g.group_room(["tenants"]) == {"tenants": (1, {"a": 1, "b": 1})}  # nothing released by asking
