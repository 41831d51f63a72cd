"""The leader's resource accounting (core/resources.py), on a fake clock."""

from __future__ import annotations

from cronoq_server.config import ResourceConfig
from cronoq_server.core.resources import ResourceGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock | None = None) -> ResourceGate:
    return ResourceGate(
        [
            ResourceConfig(name="gpu", concurrency=2),
            ResourceConfig(name="api", rate=5.0, burst=1),
        ],
        clock or Clock(),
    )


def test_concurrency_slots_are_held_until_the_attempt_ends() -> None:
    g = gate()
    r = g.reservation()
    assert r.admit(1, {"gpu": 1}) and r.admit(2, {"gpu": 1})
    assert not r.admit(3, {"gpu": 1})
    r.keep([(1, 1), (2, 1)])
    assert g.exhausted() == ["gpu"]
    assert not g.release([(1, 2)])  # another attempt of task 1: not the one holding the slot
    assert g.release([(1, 1)])
    assert g.exhausted() == []
    assert [(u.name, u.in_use, u.capacity) for u in g.usage() if u.capacity] == [("gpu", 1, 2)]


def test_a_failed_lease_gives_everything_back() -> None:
    g = gate()
    r = g.reservation()
    assert r.admit(1, {"gpu": 2, "api": 1})
    r.cancel()
    assert g.exhausted() == []
    r = g.reservation()
    assert r.admit(1, {"gpu": 2})


def test_taken_but_not_leased_is_given_back() -> None:
    g = gate()
    r = g.reservation()
    assert r.admit(1, {"gpu": 1}) and r.admit(2, {"gpu": 1})
    r.keep([(1, 1)])  # task 2 was not leased after all
    assert [u.in_use for u in g.usage() if u.name == "gpu"] == [1]


def test_all_or_nothing_per_task() -> None:
    g = gate()
    r = g.reservation()
    assert r.admit(1, {"gpu": 1})
    assert not r.admit(2, {"gpu": 2})  # only one slot left: nothing of it is taken
    assert r.admit(3, {"gpu": 1})


def test_rate_is_a_token_bucket() -> None:
    clock = Clock()
    g = gate(clock)
    r = g.reservation()
    assert r.admit(1, {"api": 1})  # the burst
    assert not r.admit(2, {"api": 1})
    assert g.exhausted() == ["api"]
    assert abs((g.next_token_in() or 0) - 0.2) < 1e-9
    clock.now += 0.2
    assert r.admit(2, {"api": 1})
    clock.now += 10  # idle time refills up to the burst only
    assert r.admit(3, {"api": 1})
    assert not r.admit(4, {"api": 1})


def test_rebuild_counts_running_tasks_of_the_previous_leader() -> None:
    g = gate()
    g.rebuild([(7, 3, {"gpu": 2}), (8, 1, {"api": 1})])
    assert g.exhausted() == ["gpu"]
    assert not g.reservation().admit(9, {"gpu": 1})
    assert g.release([(7, 3)])
    assert g.reservation().admit(9, {"gpu": 1})


def test_a_re_leased_task_frees_its_earlier_attempts_slots() -> None:
    g = gate()
    r = g.reservation()
    assert r.admit(1, {"gpu": 1})
    r.keep([(1, 1)])
    r = g.reservation()
    assert r.admit(1, {"gpu": 1})
    r.keep([(1, 2)])  # attempt 1 ended without its end being seen yet
    assert [u.in_use for u in g.usage() if u.name == "gpu"] == [1]
    assert not g.release([(1, 1)])  # the late news of attempt 1 frees nothing more
    assert g.release([(1, 2)])
