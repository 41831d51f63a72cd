"""core.tasks._batch_order: a batch may depend on its own tasks by key."""

from __future__ import annotations

import grpc
import pytest

from cronoq_server.core.tasks import _batch_order
from cronoq_server.errors import ApiError
from cronoq_server.store.base import NewTask


def task(key: str | None = None, *deps: str) -> NewTask:
    return NewTask(
        pool="default",
        key=key,
        payload=b"",
        content_type="",
        priority=0,
        run_at=None,
        max_attempts=3,
        dep_keys=list(deps),
    )


def assert_dependencies_first(tasks: list[NewTask], order: list[int]) -> None:
    assert sorted(order) == list(range(len(tasks)))
    position = {i: pos for pos, i in enumerate(order)}
    key_index = {t.key: i for i, t in enumerate(tasks) if t.key is not None}
    for i, t in enumerate(tasks):
        for k in t.dep_keys:
            if k in key_index:
                assert position[key_index[k]] < position[i], (t.key, k)


def test_independent_tasks_keep_their_order() -> None:
    tasks = [task("a"), task(), task("c"), task("d", "stored-elsewhere")]
    assert _batch_order(tasks) == [0, 1, 2, 3]


def test_dependencies_come_first() -> None:
    tasks = [task("report", "clean", "fetch"), task("clean", "fetch"), task("fetch"), task("mail", "report"), task()]
    order = _batch_order(tasks)
    assert order == [2, 1, 0, 3, 4]
    assert_dependencies_first(tasks, order)


def test_diamond() -> None:
    tasks = [task("d", "b", "c"), task("c", "a"), task("b", "a"), task("a")]
    order = _batch_order(tasks)
    assert_dependencies_first(tasks, order)
    assert order[0] == 3 and order[-1] == 0


def test_duplicate_key_is_refused() -> None:
    with pytest.raises(ApiError) as err:
        _batch_order([task("a"), task("b"), task("a")])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == "tasks[2].key: 'a' already names tasks[0] of this batch"


@pytest.mark.parametrize(
    ("tasks", "cycle"),
    [
        ([task("a", "a")], "'a' -> 'a'"),
        ([task("a", "b"), task("b", "a")], "'a' -> 'b' -> 'a'"),
        ([task("x"), task("a", "b"), task("b", "c"), task("c", "a")], "'a' -> 'b' -> 'c' -> 'a'"),
        ([task("a", "b"), task("b", "c"), task("c", "b")], "'b' -> 'c' -> 'b'"),
    ],
)
def test_cycle_is_refused_naming_its_keys(tasks: list[NewTask], cycle: str) -> None:
    with pytest.raises(ApiError) as err:
        _batch_order(tasks)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == f"depends_on: dependency cycle in batch: {cycle}"


def test_long_chain_without_recursion_error() -> None:
    n = 5000
    # Each task depends on the next one, so the first task's dependencies run 5000 deep.
    tasks = [task(f"k{i}", f"k{i + 1}") if i + 1 < n else task(f"k{i}") for i in range(n)]
    order = _batch_order(tasks)
    assert order == list(range(n - 1, -1, -1))
    assert_dependencies_first(tasks, order)


def test_long_cycle_is_found() -> None:
    n = 5000
    tasks = [task(f"k{i}", f"k{(i + 1) % n}") for i in range(n)]
    with pytest.raises(ApiError, match="dependency cycle"):
        _batch_order(tasks)
