"""Fair share inside a pool (store/fair.py): ranks give round robin across groups, and a
lease's choice keeps each group under its cap."""

from __future__ import annotations

from cronoq_server.store.fair import FAIR_WINDOW_MAX, Candidate, GroupRanks, choose, fair_window


def test_a_group_that_comes_late_is_served_in_turn_with_one_that_has_many() -> None:
    ranks = GroupRanks(["p"])
    a = [ranks.rank("p", "a") for _ in range(1000)]
    b = [ranks.rank("p", "b") for _ in range(3)]
    order = sorted([(r, "a") for r in a] + [(r, "b") for r in b])
    assert [g for _, g in order[:6]] == ["a", "b", "a", "b", "a", "b"]


def test_a_group_does_not_save_up_turns_while_it_has_nothing_due() -> None:
    ranks = GroupRanks(["p"])
    for _ in range(10):
        ranks.served("p", ranks.rank("p", "a"))  # a ran ten tasks alone
    late = ranks.rank("p", "b")
    assert late == 11  # just past the round, not 1: b does not jump ahead of a's next ten
    assert ranks.rank("p", "a") == 11


def test_ranks_are_rebuilt_from_the_store_and_groups_behind_the_round_forgotten() -> None:
    ranks = GroupRanks(["p"])
    ranks.rebuild("p", 100, {"a": 150, "b": 90})
    assert ranks.rank("p", "a") == 151 and ranks.rank("p", "b") == 101
    for i in range(3000):
        ranks.rank("p", f"g{i}")
    ranks.served("p", 200)
    assert ranks.rank("p", "g0") == 201  # forgotten (behind the round): starts past it


def candidates(*spec: tuple[int, str]) -> list[Candidate]:
    return [Candidate(seq, "p", group, 10, None) for seq, group in spec]


def test_a_lease_takes_a_group_only_up_to_its_cap() -> None:
    room = {"p": (2, {"a": 1})}
    got = choose(candidates((1, "a"), (2, "a"), (3, "b"), (4, "b"), (5, "b"), (6, "c")), room, limit=10)
    assert got == [1, 3, 4, 6]


def test_a_pool_without_a_cap_takes_in_order_up_to_the_limit() -> None:
    got = choose(candidates((1, "a"), (2, "a"), (3, "a")), {}, limit=2)
    assert got == [1, 2]


def test_resources_and_bytes_bound_a_fair_lease_too() -> None:
    tasks = [
        Candidate(1, "p", "a", 10, {"gpu": 1}),
        Candidate(2, "p", "b", 10, {"gpu": 1}),
        Candidate(3, "p", "c", 10, None),
    ]
    assert choose(tasks, {}, limit=10, free={"gpu": 1}) == [1, 3]
    assert choose(candidates((1, "a"), (2, "b"), (3, "c")), {}, limit=10, max_bytes=25) == [1, 2]
    assert choose(candidates((1, "a")), {}, limit=10, max_bytes=5) == [1]  # the first always


def test_the_window_grows_with_the_groups_at_their_cap() -> None:
    assert fair_window(64, {}) == 80
    assert fair_window(64, {"p": (1, {"a": 1, "b": 1, "c": 0})}) == 240
    assert fair_window(1000, {"p": (1, {str(i): 1 for i in range(100)})}) == FAIR_WINDOW_MAX
