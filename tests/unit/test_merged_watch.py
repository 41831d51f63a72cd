"""The merged Watch of a sharded deployment: composite cursors, and the merge of the shards'
streams (bounded, ended by any one of them, cancelling the others)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import grpc
import pytest

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as pb
from cronoq_server.config import ShardConfig
from cronoq_server.errors import ApiError
from cronoq_server.sharding.watch import MERGE_BUFFER, MergedWatch, Source, format_positions, parse_positions

CPU = ShardConfig(name="cpu", number=1, pools=["default"], endpoint="http://127.0.0.1:1")
GPU = ShardConfig(name="gpu", number=2, pools=["llm"], endpoint="http://127.0.0.1:2")


# -- composite cursors ----------------------------------------------------------------------


def test_a_composite_cursor_names_one_position_per_shard_in_shard_order() -> None:
    assert format_positions({2: 45, 1: 120}) == "1:120,2:45"
    assert format_positions({1: 7}) == "1:7"
    assert format_positions({}) == ""
    assert parse_positions("1:120,2:45", [1, 2]) == {1: 120, 2: 45}
    assert parse_positions("2:45,1:120", [1, 2]) == {1: 120, 2: 45}  # any order is read
    assert parse_positions("1:120", [1, 2]) == {1: 120}  # a single shard's cursor: the others live
    assert parse_positions("2:0", [1, 2]) == {2: 0}
    positions = {n: n * 1000 + 7 for n in range(1, 256)}
    assert parse_positions(format_positions(positions), range(1, 256)) == positions


@pytest.mark.parametrize(
    ("cursor", "words"),
    [
        ("", "is not a cursor"),
        ("nope", "is not a cursor"),
        ("1:5,", "is not a cursor"),
        (",1:5", "is not a cursor"),
        ("1:5,,2:3", "is not a cursor"),
        ("1:5;2:3", "is not a cursor"),
        ("1:5, 2:3", "is not a cursor"),
        ("1:-5", "is not a cursor"),
        ("1:5:6", "is not a cursor"),
        ("١:5", "is not a cursor"),  # an Arabic-Indic digit is a digit to str.isdigit, not here
        ("1:12345678901234567890", "is not a cursor"),  # 20 digits: longer than any seq
        ("1:5,1:6", "names shard number 1 twice"),
        ("3:5", "names shard number 3, which no shard has (shard numbers: 1, 2)"),
        ("1:5,0:9", "names shard number 0, which no shard has"),
    ],
)
def test_a_bad_composite_cursor_is_invalid_argument_naming_cursor(cursor: str, words: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_positions(cursor, [1, 2])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith("cursor: ") and words in err.value.message, err.value.message


def test_a_long_cursor_is_shown_cut() -> None:
    with pytest.raises(ApiError) as err:
        parse_positions("1:1," * 1000, [1, 2])
    assert len(err.value.message) < 300 and "…" in err.value.message


# -- the merge --------------------------------------------------------------------------------


def response(shard: ShardConfig, seq: int) -> pb.WatchResponse:
    task = task_pb2.Task(id=(shard.number << 56) | seq)
    return pb.WatchResponse(
        event=task_pb2.TaskEvent(task=task, shard=shard.name, seq=seq, cursor=f"{shard.number}:{seq}")
    )


class Feed:
    """One shard's stream: `count` events (None: no end), then an end (or `error`); or, with
    `hold`, that many events and then nothing, still open. It counts what the merge took from
    it and whether it was closed; `more` cleared stops it until set."""

    def __init__(
        self, shard: ShardConfig, start: int, count: int | None = None, error: ApiError | None = None, hold: int = -1
    ):
        self.shard, self.start, self.count, self.error, self.hold = shard, start, count, error, hold
        self.taken = 0
        self.closed = False
        self.more = asyncio.Event()
        self.more.set()

    async def events(self) -> AsyncGenerator[pb.WatchResponse, None]:
        try:
            seq = self.start
            while self.count is None or self.taken < self.count:
                await self.more.wait()
                if self.taken == self.hold:  # holds here, open, until closed
                    await asyncio.Event().wait()
                seq += 1
                self.taken += 1
                yield response(self.shard, seq)
            if self.error is not None:
                raise self.error
        finally:
            self.closed = True

    def source(self) -> Source:
        return Source(self.shard, self.start, self.events())


async def test_each_event_carries_every_shards_position() -> None:
    cpu, gpu = Feed(CPU, 100, hold=2), Feed(GPU, 40, hold=1)
    gpu.more.clear()
    merged = MergedWatch([cpu.source(), gpu.source()], {1: 100, 2: 40, 3: 9}, {})
    first = await anext(merged)
    assert (first.event.seq, first.event.cursor) == (101, "1:101,2:40,3:9")  # 3: kept as resumed from
    assert (await anext(merged)).event.cursor == "1:102,2:40,3:9"
    gpu.more.set()
    later = await anext(merged)
    assert (later.event.seq, later.event.cursor) == (41, "1:102,2:41,3:9")
    await merged.aclose()


async def test_the_merge_holds_a_bounded_number_of_events_for_a_slow_reader() -> None:
    cpu, gpu = Feed(CPU, 0), Feed(GPU, 0)
    merged = MergedWatch([cpu.source(), gpu.source()], {1: 0, 2: 0}, {})
    for _ in range(20):
        await asyncio.sleep(0.01)
    taken = cpu.taken + gpu.taken
    assert MERGE_BUFFER <= taken <= MERGE_BUFFER + 2, taken  # the buffer, and one in each feed's hand
    for _ in range(10):
        await anext(merged)
    await asyncio.sleep(0.05)
    assert cpu.taken + gpu.taken <= taken + 10  # taken again only as the reader makes room
    await merged.aclose()
    assert cpu.closed and gpu.closed


async def test_the_merge_ends_with_the_first_shard_stream_that_ends_and_closes_the_others() -> None:
    aborted = ApiError(grpc.StatusCode.ABORTED, "watch fell behind", reason="WATCH_FELL_BEHIND")
    cpu, gpu = Feed(CPU, 0), Feed(GPU, 0, count=2, error=aborted)
    cpu.more.clear()
    merged = MergedWatch([cpu.source(), gpu.source()], {}, {})
    got = [await anext(merged), await anext(merged)]
    assert [r.event.cursor for r in got] == ["1:0,2:1", "1:0,2:2"]
    with pytest.raises(ApiError) as err:
        await anext(merged)
    assert err.value is aborted
    assert cpu.closed and gpu.closed
    with pytest.raises(StopAsyncIteration):
        await anext(merged)

    cpu, gpu = Feed(CPU, 0, count=1), Feed(GPU, 0)  # a clean end (a draining server) ends it cleanly
    gpu.more.clear()
    merged = MergedWatch([cpu.source(), gpu.source()], {}, {})
    assert (await anext(merged)).event.cursor == "1:1,2:0"
    with pytest.raises(StopAsyncIteration):
        await anext(merged)
    assert gpu.closed


async def test_closing_before_reading_closes_every_shard_stream() -> None:
    cpu, gpu = Feed(CPU, 0), Feed(GPU, 0)
    merged = MergedWatch([cpu.source(), gpu.source()], {}, {})
    await asyncio.sleep(0.01)
    await merged.aclose()
    await merged.aclose()  # twice: nothing more
    assert cpu.closed and gpu.closed


async def test_a_shard_that_joins_later_starts_from_its_stated_position() -> None:
    cpu = Feed(CPU, 10)
    cpu.more.clear()
    gpu = Feed(GPU, 70, count=1)
    joined = asyncio.Event()

    async def join() -> Source:
        await joined.wait()
        return gpu.source()

    merged = MergedWatch([cpu.source()], {1: 10}, {}, joins=[(GPU, join)])
    nxt = asyncio.ensure_future(anext(merged))
    await asyncio.sleep(0.02)
    assert not nxt.done()
    joined.set()
    assert (await nxt).event.cursor == "1:10,2:71"
    await merged.aclose()
    assert cpu.closed
