"""Task ids: shard number in the top 8 bits, per-shard sequence below."""

from __future__ import annotations

import pytest

from cronoq_server.ids import MAX_ID, make_task_id, parse_task_id, seq_of, shard_of

SEQ_LIMIT = 2**56


@pytest.mark.parametrize(
    ("shard", "seq", "task_id"),
    [
        (0, 1, 1),
        (0, SEQ_LIMIT - 1, SEQ_LIMIT - 1),
        (1, 1, 2**56 + 1),
        (128, 5, 2**63 + 5),  # top bit set
        (255, 1, 255 * 2**56 + 1),
        (255, SEQ_LIMIT - 1, 2**64 - 1),
    ],
)
def test_round_trip(shard: int, seq: int, task_id: int) -> None:
    assert make_task_id(shard, seq) == task_id
    assert (shard_of(task_id), seq_of(task_id)) == (shard, seq)
    assert parse_task_id(str(task_id)) == task_id


def test_unsharded_ids_are_the_sequence() -> None:
    assert [make_task_id(0, s) for s in (1, 2, 3)] == [1, 2, 3]


def test_top_bit_and_largest_id_parse() -> None:
    assert parse_task_id(str(2**63 + 5)) == 9223372036854775813
    assert shard_of(2**63 + 5) == 128 and seq_of(2**63 + 5) == 5
    assert parse_task_id(str(MAX_ID)) == 2**64 - 1 and shard_of(MAX_ID) == 255


@pytest.mark.parametrize(
    "text",
    ["", "abc", "-1", "0", "00", str(2**64), str(2**70), "+5", " 5", "5 ", "1.0", "0x10", "1e3", "１２", "²"],
)
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="is not a positive unsigned 64-bit decimal integer") as err:
        parse_task_id(text)
    assert repr(text) in str(err.value)
