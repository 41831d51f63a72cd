"""Resumable Watch on real servers: events in each task's order, cursors over gRPC and SSE
(`id:` and `Last-Event-ID`), refusals of cursors that cannot resume, and resuming on a new
leader after the old one is SIGKILLed (SQLite and PostgreSQL) with nothing missed or repeated."""

from __future__ import annotations

import collections
import http.client
import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import Api, eventually
from test_failover import is_leader, pg_config, start_replicas, under_load

from cronoq.v1 import task_pb2, task_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb

PENDING, RUNNING, SUCCEEDED = (task_pb2.TaskState.Value(f"TASK_STATE_{s}") for s in ("PENDING", "RUNNING", "SUCCEEDED"))


def watch(api: Api, cursor: str = "", **kw: Any) -> Any:
    return api.tasks.Watch(tpb.WatchRequest(cursor=cursor, **kw), timeout=30)


def take(stream: Any, n: int) -> list[task_pb2.TaskEvent]:
    out = []
    for response in stream:
        out.append(response.event)
        if len(out) == n:
            break
    return out


def history(events: list[task_pb2.TaskEvent]) -> list[tuple[int, int, int]]:
    return [(e.task.id, e.task.state, e.task.attempt) for e in events]


def test_grpc_watch_events_in_order_and_a_cursor_resumes(server: Any) -> None:
    api = Api(server.grpc_target)
    stream = watch(api)
    time.sleep(0.2)
    task = api.submit()
    worker = api.register()
    (leased,) = api.lease(worker)
    assert api.fail(worker, leased).accepted  # retried after the backoff
    (leased,) = eventually(lambda: api.lease(worker), what="the retry leased")
    got = take(stream, 4)
    stream.cancel()
    assert history(got) == [(task.id, PENDING, 0), (task.id, RUNNING, 1), (task.id, PENDING, 1), (task.id, RUNNING, 2)]
    assert [e.seq for e in got] == list(range(got[0].seq, got[0].seq + 4))
    assert all(e.cursor == f"0:{e.seq}" for e in got)
    # Missed while nobody watched: replayed from the last cursor, then live.
    assert api.succeed(worker, leased).accepted
    other = api.submit()
    resumed = watch(api, got[-1].cursor)
    first = take(resumed, 2)
    assert history(first) == [(task.id, SUCCEEDED, 2), (other.id, PENDING, 0)]
    assert first[0].seq == got[-1].seq + 1
    live = api.submit()
    (event,) = take(resumed, 1)
    assert (event.task.id, event.seq) == (live.id, first[-1].seq + 1)
    resumed.cancel()


def test_grpc_refuses_a_malformed_cursor_and_one_past_the_last_event(server: Any) -> None:
    api = Api(server.grpc_target)
    api.submit()
    for cursor, code, words in (
        ("nope", grpc.StatusCode.INVALID_ARGUMENT, "cursor: 'nope'"),
        ("5:1", grpc.StatusCode.INVALID_ARGUMENT, "shard number 5"),
        ("0:999999", grpc.StatusCode.OUT_OF_RANGE, "last event"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            take(watch(api, cursor), 1)
        assert err.value.code() == code and words in err.value.details(), (cursor, err.value.details())


def test_a_cursor_older_than_the_watch_window_is_out_of_range(start_server: Any) -> None:
    srv = start_server({"server": {"watch_window": "1s"}, "pools": [{"name": "default"}]})
    api = Api(srv.grpc_target)
    stream = watch(api)
    time.sleep(0.2)
    api.submit()
    (old,) = take(stream, 1)
    stream.cancel()
    time.sleep(1.2)
    api.submit()  # the window moves on; the old event is purged within a quarter of it

    def refused() -> grpc.RpcError | None:
        try:
            take(watch(api, old.cursor), 1)
        except grpc.RpcError as err:
            return err
        return None

    err = eventually(refused, timeout=10, what="the old cursor refused")
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE, err.details()
    assert repr(old.cursor) in err.details() and "watch_window is 1s" in err.details()
    status, body = srv.http("GET", f"/v1/watch?cursor={old.cursor}")
    assert status == 400 and body["code"] == "OUT_OF_RANGE" and body["reason"] == "CURSOR_EXPIRED", body


def test_an_idle_grpc_watch_outlives_client_keepalive_pings_every_10s(server: Any) -> None:
    """Pings with no data in between, as a quiet Watch's client sends them (the SDKs every 20 s,
    here every 10 s: the most often the server allows). Under gRPC's default policy (one such
    ping in 5 minutes) the server answered the fifth ping with GOAWAY "too_many_pings", after
    50 s (the SDKs' streams: after 100 s); six pings go by here."""
    pinging = grpc.insecure_channel(
        server.grpc_target,
        options=[
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )
    received: queue.Queue[Any] = queue.Queue()

    def read(stream: Any) -> None:
        try:
            for response in stream:
                received.put(response.event)
            received.put("ended")
        except grpc.RpcError as err:
            received.put(err)

    try:
        stream = task_service_pb2_grpc.TaskServiceStub(pinging).Watch(tpb.WatchRequest(), timeout=100)
        threading.Thread(target=read, args=(stream,), daemon=True).start()
        time.sleep(65)
        assert received.empty(), f"the idle Watch ended: {received.get()!r}"
        task = Api(server.grpc_target).submit()
        event = received.get(timeout=10)
        assert isinstance(event, task_pb2.TaskEvent) and event.task.id == task.id, event
        stream.cancel()
    finally:
        pinging.close()


def test_an_unsharded_live_watch_states_its_start_and_resuming_there_loses_nothing(server: Any) -> None:
    """A live Watch that breaks before its first event resumes from where it started (the
    cronoq-watch-cursor of its initial metadata), not live again: the events in between come."""
    api = Api(server.grpc_target)
    api.submit()
    stream = watch(api)
    start = dict(stream.initial_metadata()).get("cronoq-watch-cursor")
    assert start is not None, "an unsharded server does not say where a live Watch starts"
    stream.cancel()
    missed = api.submit()  # while no stream was open
    resumed = watch(api, start)
    seen = []
    for response in resumed:  # the first task's event too, if it was still to come at the start
        seen.append((response.event.task.id, response.event.task.state))
        if response.event.task.id == missed.id:
            break
    resumed.cancel()
    assert (missed.id, PENDING) in seen, seen


# -- Server-sent events ------------------------------------------------------------------


def open_sse(srv: Any, query: str = "", headers: dict[str, str] | None = None) -> tuple[Any, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=20)
    conn.request("GET", "/v1/watch" + query, headers=headers or {})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.readline() == b": watching\n"
    return conn, resp


def sse(resp: Any) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(id, event name, data) per server-sent event; comments are skipped."""
    fields: dict[str, str] = {}
    while line := resp.readline():
        text = line.decode().rstrip("\n")
        if text.startswith(":"):
            continue
        if text:
            name, _, value = text.partition(": ")
            fields[name] = value
        elif "data" in fields:
            yield fields.get("id", ""), fields.get("event", "message"), json.loads(fields["data"])
            fields = {}


def test_sse_ids_are_cursors_and_last_event_id_resumes(server: Any) -> None:
    conn, resp = open_sse(server, "?pool=default")
    time.sleep(0.2)
    ids = [server.http("POST", "/v1/tasks", {"pool": "default"})[1]["task"]["id"] for _ in range(2)]
    stream = sse(resp)
    got = [next(stream) for _ in range(2)]
    conn.close()
    assert [data["task"]["id"] for _, _, data in got] == ids
    assert [sse_id for sse_id, _, _ in got] == [data["cursor"] for _, _, data in got]
    assert got[0][2]["seq"] and got[0][0] == f"0:{got[0][2]['seq']}"
    missed = [server.http("POST", "/v1/tasks", {"pool": "default"})[1]["task"]["id"] for _ in range(2)]
    # An EventSource reconnects to the URL it first opened, with the last id it saw: the header wins.
    conn, resp = open_sse(server, f"?pool=default&cursor={got[0][0]}", {"Last-Event-ID": got[-1][0]})
    stream = sse(resp)
    assert [next(stream)[2]["task"]["id"] for _ in range(2)] == missed
    conn.close()
    conn, resp = open_sse(server, f"?cursor={got[0][0]}")  # or the cursor in the query
    stream = sse(resp)
    assert [next(stream)[2]["task"]["id"] for _ in range(3)] == [ids[1], *missed]
    conn.close()
    status, body = server.http("GET", "/v1/watch?cursor=bad")
    assert status == 400 and body["code"] == "INVALID_ARGUMENT" and "cursor" in body["message"], body


# -- failover ------------------------------------------------------------------------------


class Recorder(threading.Thread):
    """Watches from the first event through every endpoint, reconnecting with its last cursor
    whenever a stream ends (a dead leader, a standby answering UNAVAILABLE)."""

    def __init__(self, servers: list[Any]):
        super().__init__(daemon=True)
        self.servers = servers
        self.events: list[task_pb2.TaskEvent] = []
        self.reconnects: list[tuple[str, str]] = []  # (server, code) of every stream that ended
        self.stopping = threading.Event()
        self._call: Any = None

    def run(self) -> None:
        cursor = "0:0"  # from the first event, whenever the first stream starts
        while not self.stopping.is_set():
            for srv in self.servers:
                if self.stopping.is_set():
                    return
                channel = grpc.insecure_channel(srv.grpc_target)
                try:
                    self._call = task_service_pb2_grpc.TaskServiceStub(channel).Watch(tpb.WatchRequest(cursor=cursor))
                    for response in self._call:
                        self.events.append(response.event)
                        cursor = response.event.cursor
                    self.reconnects.append((srv.name, "OK"))
                except grpc.RpcError as err:
                    self.reconnects.append((srv.name, err.code().name))
                finally:
                    channel.close()
                time.sleep(0.02)

    def stop(self) -> None:
        self.stopping.set()
        if self._call is not None:
            self._call.cancel()
        self.join(10)


def check_watch_across_failover(servers: list[Any], tmp_path: Path, total: int) -> None:
    recorder = Recorder(servers)
    recorder.start()
    try:
        with under_load(servers, tmp_path, total) as (submitter, _):
            before_kill = len(recorder.events)
            servers[0].kill()
            new_leader = eventually(
                lambda: next((s for s in servers[1:] if is_leader(s)), None),
                timeout=10,
                interval=0.02,
                what="a new leader",
            )
            submitter.join(90)
            assert not submitter.is_alive() and not submitter.errors, submitter.errors
            ids = set(submitter.acknowledged.values())
            assert len(ids) == total

            def all_ended() -> bool:
                return {e.task.id for e in recorder.events if e.task.state == SUCCEEDED} >= ids

            eventually(all_ended, timeout=30, what="every task's SUCCEEDED event watched")
    finally:
        recorder.stop()
    watched = recorder.events
    assert before_kill > 0 and any(name == servers[0].name for name, _ in recorder.reconnects), recorder.reconnects
    # No event twice, none missed: the stream's sequence is dense from the first event.
    seqs = [e.seq for e in watched]
    assert seqs == list(range(1, len(seqs) + 1)), [s for s, n in collections.Counter(seqs).items() if n > 1][:10]
    # The same events as the store holds: read them all again from the new leader.
    api = Api(new_leader.grpc_target)
    stored = take(watch(api, "0:0"), len(watched))
    assert history(stored) == history(watched)
    # Each task's history: submitted, run (an attempt at a time), and ended as the task is now.
    per_task: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for e in watched:
        per_task[e.task.id].append((e.task.state, e.task.attempt))
    assert set(per_task) == ids
    for task_id, states in per_task.items():
        final = api.get(task_id)
        assert states[0] == (PENDING, 0) and states[-1] == (SUCCEEDED, final.attempt), (task_id, states)
        assert states[1:] == [s for n in range(1, final.attempt + 1) for s in _attempt(n, final.attempt)], states
    print(f"\n{len(watched)} events of {total} tasks; streams ended: {recorder.reconnects}")


def _attempt(n: int, last: int) -> list[tuple[int, int]]:
    """The events of attempt n: leased, then retried (a lease that expired with the old leader) or ended."""
    return [(RUNNING, n), (SUCCEEDED if n == last else PENDING, n)]


def test_sqlite_watch_resumes_on_the_new_leader_after_sigkill(start_server: Any, tmp_path: Path) -> None:
    config = {"store": {"path": str(tmp_path / "shared.db")}, "pools": [{"name": "default", "lease_ttl": "30s"}]}
    check_watch_across_failover(start_replicas(start_server, config, n=2), tmp_path, total=300)


def test_postgres_watch_resumes_on_the_new_leader_after_sigkill(
    start_server: Any, postgres: Any, tmp_path: Path
) -> None:
    check_watch_across_failover(start_replicas(start_server, pg_config(postgres), n=2), tmp_path, total=300)
