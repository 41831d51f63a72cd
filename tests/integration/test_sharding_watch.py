"""The Watch of a sharded deployment: merged from every shard, with a composite cursor.

The deployment of test_sharding: shard `cpu` (number 1) owns pool `default`, shard `gpu`
(number 2) owns pool `llm`, one server each on SQLite. A Watch on either server streams the
events of both shards; every event's cursor names one position per shard ("1:120,2:45"), so a
client that reconnects with the last cursor it saw (to either server) resumes every shard
where it left off. The stream's initial metadata (HTTP: response headers) says where it starts
(`cronoq-watch-cursor`) and which shards it could not open (`cronoq-unavailable-shards`).
"""

from __future__ import annotations

import asyncio
import http.client
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import eventually
from conftest import ServerProcess, free_port  # type: ignore[import-not-found]
from test_sharding import TIMEOUT, TOKENS, Stubs, TwoShards, bearer, metric, sharded_config, submit, trailers
from test_watch import open_sse, sse, take
from tls_pki import Pki

import cronoq
from cronoq.status import decode_details
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import task_service_pb2_grpc

pytestmark = pytest.mark.timeout(120)

AUTH = {"Authorization": f"Bearer {TOKENS['full']}"}


@pytest.fixture
def shards(tmp_path: Path, start_server: Any) -> TwoShards:
    return TwoShards(tmp_path, start_server)


def watch(stubs: Stubs, cursor: str = "", token: str = "full", forwarded: bool = False, **kw: Any) -> Any:
    md = bearer(token) + ([("cronoq-forwarded", "1")] if forwarded else [])
    return stubs.tasks.Watch(tpb.WatchRequest(cursor=cursor, **kw), metadata=md, timeout=60)


def opened(stream: Any) -> dict[str, str]:
    """The stream's initial metadata: once it has come, every shard the stream watches is open."""
    return dict(stream.initial_metadata())


def positions(cursor: str) -> dict[int, int]:
    return {int(n): int(s) for n, s in (part.split(":") for part in cursor.split(","))}


def cursor_of(pos: dict[int, int]) -> str:
    return ",".join(f"{n}:{s}" for n, s in sorted(pos.items()))


def shard_bits(task_id: int) -> int:
    return task_id >> 56


def interleaved(stubs: Stubs, skipped: str, wanted: str) -> list[int]:
    """Submits a task of pool `skipped`, one of `wanted`, and again; the ids of the wanted two."""
    ids = []
    for _ in range(2):
        submit(stubs, skipped)
        ids.append(submit(stubs, wanted).task.id)
    return ids


def refused(stream: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        take(stream, 1)
    return err.value


def sse_open(srv: ServerProcess, query: str = "", **headers: str) -> tuple[Any, Any]:
    return open_sse(srv, query, {**AUTH, **{k.replace("_", "-"): v for k, v in headers.items()}})


def sse_get(srv: ServerProcess, query: str) -> tuple[int, dict[str, str], bytes]:
    """A GET /v1/watch that is refused: its status, headers and body."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=TIMEOUT)
    conn.request("GET", "/v1/watch" + query, headers=AUTH)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body


def test_a_watch_streams_every_shard_and_a_cursor_resumes_each_where_it_left_off(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    stream = watch(cpu)
    md = opened(stream)
    start = positions(md["cronoq-watch-cursor"])
    assert set(start) == {1, 2} and "cronoq-unavailable-shards" not in md, md
    ids = [submit(s, pool).task.id for s in (cpu, gpu) for pool in ("default", "llm")]
    got = take(stream, 4)
    stream.cancel()
    assert sorted(e.task.id for e in got) == sorted(ids)
    assert {shard_bits(e.task.id) for e in got} == {1, 2}
    # Each event's cursor: its own shard's seq, and the last seen (or starting) one of the other.
    seen = dict(start)
    for event in got:
        number = shard_bits(event.task.id)
        assert event.shard == {1: "cpu", 2: "gpu"}[number] and event.seq == seen[number] + 1
        seen[number] = event.seq
        assert event.cursor == cursor_of(seen), (event.cursor, seen)

    # Missed while disconnected, in both shards: replayed (through the other server), none twice.
    missed = [submit(s, pool).task.id for s in (gpu, cpu) for pool in ("llm", "default")]
    resumed = watch(gpu, got[-1].cursor)
    again = take(resumed, 4)
    assert sorted(e.task.id for e in again) == sorted(missed)
    for number in (1, 2):
        seqs = [e.seq for e in again if shard_bits(e.task.id) == number]
        assert seqs == [seen[number] + 1, seen[number] + 2], (number, seqs)
    live = submit(cpu, "llm").task.id
    (event,) = take(resumed, 1)
    assert event.task.id == live  # the next event is the new one: nothing was repeated
    resumed.cancel()


def test_a_shard_with_no_event_yet_resumes_from_where_the_stream_started(shards: TwoShards) -> None:
    """A shard quiet while the client watched is in the cursor from the start: what it did
    after the client left is replayed, not lost."""
    cpu = shards.stubs["cpu"]
    stream = watch(cpu)
    opened(stream)
    submit(cpu, "default")
    (first,) = take(stream, 1)
    stream.cancel()
    assert set(positions(first.cursor)) == {1, 2}
    llm = submit(cpu, "llm").task.id  # gpu's first event since the stream started: nobody watches
    resumed = watch(cpu, first.cursor)
    (event,) = take(resumed, 1)
    resumed.cancel()
    assert event.task.id == llm


def test_sse_ids_are_composite_cursors_and_last_event_id_resumes_both_shards(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    conn, resp = sse_open(shards.cpu)
    assert set(positions(resp.getheader("cronoq-watch-cursor"))) == {1, 2}
    assert resp.getheader("cronoq-unavailable-shards") is None
    ids = {submit(cpu, "default").task.id, submit(cpu, "llm").task.id}
    stream = sse(resp)
    got = [next(stream) for _ in range(2)]
    conn.close()
    assert {int(data["task"]["id"]) for _, _, data in got} == ids
    assert all(sse_id == data["cursor"] and set(positions(sse_id)) == {1, 2} for sse_id, _, data in got), got
    missed = [submit(gpu, "llm").task.id, submit(gpu, "default").task.id]
    # An EventSource reconnects (to the other server here) with the last id it saw: the header wins.
    conn, resp = sse_open(shards.gpu, f"?cursor={got[0][0]}", Last_Event_ID=got[-1][0])
    stream = sse(resp)
    assert sorted(int(next(stream)[2]["task"]["id"]) for _ in range(2)) == sorted(missed)
    conn.close()


def test_a_merged_watch_ends_when_a_shard_server_is_killed(shards: TwoShards) -> None:
    cpu = shards.stubs["cpu"]
    stream = watch(cpu)
    start = opened(stream)["cronoq-watch-cursor"]
    conn, resp = sse_open(shards.cpu)
    submit(cpu, "llm")
    take(stream, 1)
    events = sse(resp)
    next(events)
    shards.gpu.kill()
    started = time.monotonic()
    err = refused(stream)
    assert time.monotonic() - started < 5.0
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err  # type: ignore[attr-defined]
    assert "'gpu'" in err.details() and trailers(err)["cronoq-unavailable-shards"] == "gpu"  # type: ignore[attr-defined]
    assert trailers(err)["cronoq-watch-cursor"] == start  # repeated: a client may not have read the initial metadata
    _, name, data = next(events)
    assert name == "error" and data["code"] == "UNAVAILABLE" and "'gpu'" in data["message"], data
    conn.close()


def test_with_a_shard_down_a_watch_streams_the_others_and_names_it(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    stream = watch(cpu)
    opened(stream)
    submit(gpu, "llm")
    (before,) = take(stream, 1)
    stream.cancel()
    shards.gpu.kill()

    fresh = watch(cpu)
    md = opened(fresh)
    assert md["cronoq-unavailable-shards"] == "gpu" and set(positions(md["cronoq-watch-cursor"])) == {1}, md
    task = submit(cpu, "default").task
    (event,) = take(fresh, 1)
    assert event.task.id == task.id and set(positions(event.cursor)) == {1}  # gpu had no position to keep
    fresh.cancel()
    conn, resp = sse_open(shards.cpu)
    assert resp.getheader("cronoq-unavailable-shards") == "gpu"
    conn.close()

    # Resumed while gpu is down: gpu's position is kept, unchanged, in every cursor.
    resumed = watch(cpu, before.cursor)
    md = opened(resumed)
    assert md["cronoq-unavailable-shards"] == "gpu"
    assert positions(md["cronoq-watch-cursor"])[2] == before.seq
    missed = task.id  # since `before`: replayed
    task = submit(cpu, "default").task
    got = take(resumed, 2)
    assert [e.task.id for e in got] == [missed, task.id]
    event = got[-1]
    assert all(positions(e.cursor)[2] == before.seq for e in got), [e.cursor for e in got]
    # gpu comes back: it joins the open stream from that position, with nothing missed.
    shards.gpu.start()
    llm = submit(gpu, "llm").task
    (joined,) = take(resumed, 1)
    assert joined.task.id == llm.id and joined.seq == before.seq + 1
    assert positions(joined.cursor) == {1: event.seq, 2: joined.seq}
    resumed.cancel()


def test_a_watch_marked_forwarded_streams_the_receiving_shard_only(shards: TwoShards) -> None:
    cpu = shards.stubs["cpu"]
    stream = watch(cpu, forwarded=True)
    md = opened(stream)
    assert set(positions(md["cronoq-watch-cursor"])) == {1}
    ids = interleaved(cpu, "llm", "default")
    got = take(stream, 2)
    assert [e.task.id for e in got] == ids and all(e.cursor == f"1:{e.seq}" for e in got)
    # Not merged: no stream to gpu was opened for it.
    assert metric(shards.cpu, "cronoq_watch_streams", kind="peer") == 0
    assert metric(shards.gpu, "cronoq_watch_streams", kind="shard") == 0
    stream.cancel()
    err = refused(watch(cpu, forwarded=True, pool="llm"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert trailers(err)["cronoq-shard"] == "gpu"
    details = decode_details(err.trailing_metadata())  # type: ignore[attr-defined]
    assert details is not None and details.reason == "WRONG_SHARD"


def test_a_pool_filter_watches_that_pools_shard_only(shards: TwoShards) -> None:
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    stream = watch(cpu, pool="llm")
    md = opened(stream)
    assert set(positions(md["cronoq-watch-cursor"])) == {2}
    llm = interleaved(cpu, "default", "llm")
    got = take(stream, 2)
    stream.cancel()
    assert [e.task.id for e in got] == llm and all(e.cursor == f"2:{e.seq}" for e in got)
    # A caller that may not read the pool learns nothing about where it is served.
    err = refused(watch(cpu, pool="llm", token="default-only"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "gpu" not in err.details()  # type: ignore[attr-defined]
    # Without a filter, a caller watches the shards it may read: default-only sees cpu's events
    # through gpu's server, and none of gpu's. (A live stream may begin with events of the
    # moment before it opened: up to its shard's last delivered event.)
    mine = watch(gpu, token="default-only")
    opened(mine)
    submit(gpu, "llm")
    task = submit(gpu, "default").task
    got: list[Any] = []
    for response in mine:
        got.append(response.event)
        if response.event.task.id == task.id:
            break
    mine.cancel()
    assert got and all(e.task.pool == "default" and e.shard == "cpu" for e in got), got
    assert all(set(positions(e.cursor)) == {1} for e in got)  # nothing of gpu is its to know


def test_with_a_shard_down_a_watch_names_nothing_of_it_to_a_caller_that_may_read_none_of_it(shards: TwoShards) -> None:
    """The read check is the merged Watch's own: with gpu down, its refusal cannot stand in.
    Nor is gpu, down, named to a caller that may read none of its pools."""
    shards.kill("gpu")
    stream = watch(shards.stubs["cpu"], token="default-only")
    md = opened(stream)
    stream.cancel()
    assert "cronoq-unavailable-shards" not in md and set(positions(md["cronoq-watch-cursor"])) == {1}, md
    err = refused(watch(shards.stubs["cpu"], pool="llm", token="default-only"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "gpu" not in err.details(), err  # type: ignore[attr-defined]
    assert not {"cronoq-shard", "cronoq-shard-endpoint", "cronoq-unavailable-shards"} & set(trailers(err))
    conn = http.client.HTTPConnection("127.0.0.1", shards.cpu.http_port, timeout=TIMEOUT)
    conn.request("GET", "/v1/watch?pool=llm", headers={"Authorization": f"Bearer {TOKENS['default-only']}"})
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    assert resp.status == 403 and "gpu" not in body, (resp.status, body)
    assert not {"cronoq-shard", "cronoq-shard-endpoint", "cronoq-unavailable-shards"} & {
        k.lower() for k, _ in resp.getheaders()
    }


def test_bad_composite_cursors_are_invalid_argument_naming_cursor(shards: TwoShards) -> None:
    cpu = shards.stubs["cpu"]
    submit(cpu, "default")
    for cursor in (
        "nope",
        "1:5,",
        "1:5,,2:3",
        "1:5;2:3",
        "1:5,x",
        "1:5,1:6",
        "9:1",
        "1:5,9:1",
        "0:3",
        "1:-1",
        "1:5 ,2:3",
    ):
        err = refused(watch(cpu, cursor))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (cursor, err)  # type: ignore[attr-defined]
        assert err.details().startswith("cursor: "), (cursor, err.details())  # type: ignore[attr-defined]
        status, _, body = sse_get(shards.cpu, f"?cursor={urllib.request.quote(cursor)}")
        assert status == 400 and b"INVALID_ARGUMENT" in body and b"cursor" in body, (cursor, body)
    # One shard's part past its last event: that shard's OUT_OF_RANGE is the Watch's error.
    for cursor, part in (("1:0,2:999999", "2:999999"), ("1:999999,2:0", "1:999999")):
        err = refused(watch(cpu, cursor))
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE and part in err.details(), (cursor, err)  # type: ignore[attr-defined]
    # Single-shard cursors keep working: the other shard starts live.
    resumed = watch(cpu, "1:0")
    (event,) = take(resumed, 1)
    resumed.cancel()
    assert event.seq == 1 and set(positions(event.cursor)) == {1, 2}


def test_streams_to_other_shards_end_with_the_callers(shards: TwoShards) -> None:
    def counts() -> tuple[float, float, float]:
        return (
            metric(shards.cpu, "cronoq_watch_streams", kind="merged"),
            metric(shards.cpu, "cronoq_watch_streams", kind="peer"),
            metric(shards.gpu, "cronoq_watch_streams", kind="shard"),
        )

    stream = watch(shards.stubs["cpu"])
    opened(stream)
    conn, _ = sse_open(shards.cpu)
    assert counts() == (2, 2, 2)
    stream.cancel()
    eventually(lambda: counts() == (1, 1, 1), timeout=10, what="the gRPC watch's streams closed")
    conn.close()
    eventually(lambda: counts() == (0, 0, 0), timeout=10, what="the SSE watch's streams closed")


def test_a_slow_reader_holds_no_more_than_the_shards_buffers(shards: TwoShards) -> None:
    """The merge does not buffer for a client that stops reading: gpu's own stream falls behind
    (ABORTED, past its bounded buffer) and that ends the merged one, after what it holds."""
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    stream = watch(cpu, include_payloads=True)
    opened(stream)
    payload = b"x" * 2000
    batch = tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="llm", payload=payload)] * 1000)
    for _ in range(15):  # 15,000 events of 2 kB: past gpu's limit of 10,000 events or 8 MiB unread
        gpu.tasks.SubmitBatch(batch, metadata=bearer("full"), timeout=TIMEOUT)
    received = 0
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            received += 1
    assert err.value.code() == grpc.StatusCode.ABORTED and "fell behind" in err.value.details()  # type: ignore[attr-defined]
    assert 0 < received < 15_000


async def test_the_sdk_resumes_with_the_composite_cursor(shards: TwoShards) -> None:
    """client.watch reconnects with the last composite cursor as it is: a gpu restart loses nothing."""
    cpu, gpu = shards.stubs["cpu"], shards.stubs["gpu"]
    reconnects: list[str] = []
    retry = cronoq.RetryConfig(initial_backoff=0.05, max_backoff=0.2, max_elapsed=30)
    client = cronoq.Client(shards.cpu.endpoint, token=TOKENS["full"], retry=retry)
    events = client.watch(on_reconnect=lambda err, cursor: reconnects.append(cursor))
    seen: list[Any] = []

    async def until(n: int) -> None:
        while len(seen) < n:
            seen.append(await asyncio.wait_for(anext(events), 30))

    loop = asyncio.get_running_loop()
    waiter = asyncio.ensure_future(until(2))

    def streaming() -> bool:
        return metric(shards.cpu, "cronoq_watch_streams", kind="merged") == 1

    await loop.run_in_executor(None, lambda: eventually(streaming, timeout=10, what="the SDK's stream open"))
    ids = [await loop.run_in_executor(None, lambda p=p: submit(cpu, p).task.id) for p in ("default", "llm")]
    await waiter
    shards.gpu.kill()
    await loop.run_in_executor(None, shards.gpu.start)
    later = [
        await loop.run_in_executor(None, lambda s=s, p=p: submit(s, p).task.id)
        for s, p in ((gpu, "llm"), (cpu, "default"))
    ]
    await until(4)
    await events.aclose()
    await client.close()
    assert sorted(e.task.id for e in seen[:2]) == sorted(ids)
    assert sorted(e.task.id for e in seen[2:]) == sorted(later)
    assert reconnects and reconnects[0] == seen[1].cursor and set(positions(reconnects[0])) == {1, 2}


# -- client certificates ------------------------------------------------------------------


class TlsShards:
    """cpu and gpu on loopback with [server.tls] requiring client certificates, [[clients]]
    CN=reader, and [server.peer_tls] (the servers' own certificate to reach each other)."""

    def __init__(self, tmp_path: Path, start_server: Any):
        self.pki = Pki(tmp_path, "ca")
        server = self.pki.server("127.0.0.1")
        self.reader = self.pki.client("CN=reader", "reader")
        peer = self.pki.client("CN=peer", "peer")
        cpu_listen, gpu_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        tls = {
            "tls": {"cert": server.cert, "key": server.key, "client_ca": self.pki.ca_path},
            "peer_tls": {"ca": self.pki.ca_path, "cert": peer.cert, "key": peer.key},
        }
        config = sharded_config(tmp_path, cpu_listen, f"https://{gpu_listen}", cpu_endpoint=f"https://{cpu_listen}")
        config["clients"] = [{"subject": "CN=reader", "pools": ["*"], "permissions": ["read"]}]
        self.servers = {}
        for name, listen in (("cpu", cpu_listen), ("gpu", gpu_listen)):
            srv = start_server({**config, "server": {**tls, "listen": listen}}, shard=name, name=name, wait_ready=False)
            self.servers[name] = srv
        for srv in self.servers.values():
            self.wait_ready(srv)

    def wait_ready(self, srv: ServerProcess) -> None:
        ctx = ssl.create_default_context(cafile=self.pki.ca_path)
        ctx.load_cert_chain(self.reader.cert, self.reader.key)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{srv.http_port}/readyz", timeout=1, context=ctx):
                    return
            except (OSError, urllib.error.URLError):
                time.sleep(0.05)
        raise TimeoutError(f"{srv.name} not ready:\n{srv.log()}")

    def stub(self, name: str) -> task_service_pb2_grpc.TaskServiceStub:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(self.pki.ca_path).read_bytes(),
            private_key=Path(self.reader.key).read_bytes(),
            certificate_chain=Path(self.reader.cert).read_bytes(),
        )
        return task_service_pb2_grpc.TaskServiceStub(grpc.secure_channel(self.servers[name].grpc_target, creds))


def test_a_certificate_callers_watch_streams_the_receiving_shard_only(tmp_path: Path, start_server: Any) -> None:
    shards = TlsShards(tmp_path, start_server)
    cpu = shards.stub("cpu")

    def submit_tls(pool: str) -> int:
        response = cpu.SubmitTask(tpb.SubmitTaskRequest(pool=pool), metadata=bearer("full"), timeout=TIMEOUT)
        return int(response.task.id)

    by_cert = cpu.Watch(tpb.WatchRequest(), timeout=60)  # no token: the certificate's principal
    md = opened(by_cert)
    assert md["cronoq-unavailable-shards"] == "gpu" and set(positions(md["cronoq-watch-cursor"])) == {1}, md
    by_token = cpu.Watch(tpb.WatchRequest(), metadata=bearer("full"), timeout=60)  # forwarded over https
    md = opened(by_token)
    assert "cronoq-unavailable-shards" not in md and set(positions(md["cronoq-watch-cursor"])) == {1, 2}, md
    llm = submit_tls("llm")
    default = submit_tls("default")
    (event,) = take(by_cert, 1)
    assert event.task.id == default
    assert sorted(e.task.id for e in take(by_token, 2)) == sorted([llm, default])
    by_cert.cancel()
    by_token.cancel()
    # Its Watch of gpu's pool is refused with gpu's endpoint, to call there directly.
    err = refused(cpu.Watch(tpb.WatchRequest(pool="llm"), timeout=60))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert trailers(err)["cronoq-shard"] == "gpu" and "certificate" in err.details()  # type: ignore[attr-defined]
