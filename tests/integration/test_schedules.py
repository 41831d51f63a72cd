"""Cron schedules against real cronoq-server processes, on SQLite and on PostgreSQL: on-time
fires, a leader SIGKILLed at a slot, pause / resume / delete, validation, HTTP and permissions.
(The DST table is in tests/unit/test_cron.py: it needs slots at fixed dates, not now.)"""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from typing import Any

import grpc
import pytest
from _helpers import eventually, store_table
from test_failover import is_leader

from cronoq.v1 import schedule_service_pb2 as spb
from cronoq.v1 import schedule_service_pb2_grpc, task_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb
from cronoq_server.core.cron import next_after, parse, zone

SEC = 1_000_000
ON_TIME_US = 300_000  # a slot's task is created within this of the slot


def store_config(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, Any]:
    pools = [{"name": "default", "lease_ttl": "30s"}, {"name": "other", "lease_ttl": "30s"}]
    return {"store": store_table(kind, request, tmp_path / "shared.db"), "pools": pools}


@pytest.fixture(params=["sqlite", "postgres"])
def config(request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, Any]:
    return store_config(request.param, request, tmp_path)


class Client:
    def __init__(self, srv: Any):
        self.channel = grpc.insecure_channel(srv.grpc_target)
        self.schedules = schedule_service_pb2_grpc.ScheduleServiceStub(self.channel)
        self.tasks = task_service_pb2_grpc.TaskServiceStub(self.channel)

    def put(self, name: str, cron: str, pool: str = "default", **kw: Any) -> spb.Schedule:
        sched = spb.Schedule(pool=pool, name=name, cron=cron, **kw)
        return self.schedules.PutSchedule(spb.PutScheduleRequest(schedule=sched), timeout=10).schedule

    def list(self, pool: str = "") -> list[spb.Schedule]:
        return list(self.schedules.ListSchedules(spb.ListSchedulesRequest(pool=pool), timeout=10).schedules)

    def fired(self, name: str, pool: str = "default") -> dict[int, list[Any]]:
        """The tasks of the schedule, by slot (Unix seconds in the key)."""
        prefix = f"schedule:{pool}:{name}:"
        out: dict[int, list[Any]] = {}
        token = ""
        while True:
            resp = self.tasks.ListTasks(tpb.ListTasksRequest(pool=pool, page_size=1000, page_token=token), timeout=10)
            for t in resp.tasks:
                if t.key.startswith(prefix):
                    out.setdefault(int(t.key[len(prefix) :]), []).append(t)
            token = resp.next_page_token
            if not token:
                return out


def wait_until(unix_s: float) -> None:
    time.sleep(max(unix_s - time.time(), 0))


def test_every_second_schedule_fires_on_time(start_server: Any, config: dict[str, Any]) -> None:
    srv = start_server(config)
    api = Client(srv)
    put = api.put("tick", "* * * * * *", payload=b"x")
    first = put.next_fire_at.ToMicroseconds()
    assert first - time.time() * SEC <= SEC
    wait_until(first / SEC + 5.4)
    api.put("tick", "* * * * * *", paused=True)
    fired = api.fired("tick")
    slots = sorted(fired)
    assert slots[:6] == list(range(first // SEC, first // SEC + 6)), slots  # every second, none missed
    late = []
    for slot in slots[:6]:
        (task,) = fired[slot]
        assert task.run_at.ToMicroseconds() == slot * SEC and task.payload == b"x"
        delay = task.created_at.ToMicroseconds() - slot * SEC
        if not 0 <= delay <= ON_TIME_US:
            late.append((slot, delay / 1000))
    assert not late, f"tasks created off their slot (slot, ms): {late}"
    (listed,) = api.list()
    assert listed.last_fire_at.ToMicroseconds() == slots[-1] * SEC and listed.paused
    assert not listed.HasField("next_fire_at")


def test_sigkill_of_the_leader_at_a_slot_fires_it_once(start_server: Any, config: dict[str, Any]) -> None:
    leader = start_server(config, name="replica0")
    standby = start_server(config, name="replica1", wait_ready=False)
    standby.wait_ready(leader=False)
    api = Client(leader)
    put = api.put("every3", "*/3 * * * * *")
    # Kill at the second slot after the first: the leader is warm, the slot is due right now.
    target = put.next_fire_at.ToMicroseconds() // SEC + 3
    wait_until(target - 0.002)
    leader.kill()
    eventually(lambda: is_leader(standby), timeout=10, interval=0.02, what="standby leads")
    api = Client(standby)
    eventually(lambda: max(api.fired("every3"), default=0) >= target + 6, timeout=15, what="two slots after")
    fired = api.fired("every3")
    counts = {slot: len(tasks) for slot, tasks in fired.items()}
    assert counts.get(target) == 1, f"slot {target} fired {counts.get(target, 0)} times: {counts}"
    slots = sorted(fired)
    assert slots == list(range(slots[0], slots[-1] + 1, 3)) and all(n == 1 for n in counts.values()), counts
    assert slots[0] < target  # the old leader fired before the kill


def test_pause_resume_delete(start_server: Any, config: dict[str, Any]) -> None:
    srv = start_server(config)
    api = Client(srv)
    api.put("p", "* * * * * *")
    eventually(lambda: len(api.fired("p")) >= 1, timeout=5, what="first fire")
    paused = api.put("p", "* * * * * *", paused=True)
    assert paused.paused and not paused.HasField("next_fire_at")
    count = len(api.fired("p"))
    time.sleep(2.2)
    assert len(api.fired("p")) == count, "a paused schedule fired"
    resumed = api.put("p", "* * * * * *")
    assert resumed.next_fire_at.ToMicroseconds() - time.time() * SEC <= SEC
    eventually(lambda: len(api.fired("p")) >= count + 2, timeout=5, what="fires after resume")
    api.schedules.DeleteSchedule(spb.DeleteScheduleRequest(pool="default", name="p"), timeout=10)
    assert api.list() == []
    count = len(api.fired("p"))
    time.sleep(2.2)
    assert len(api.fired("p")) == count, "a deleted schedule fired"
    with pytest.raises(grpc.RpcError) as err:
        api.schedules.DeleteSchedule(spb.DeleteScheduleRequest(pool="default", name="p"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'p'" in (err.value.details() or "")


def test_validation_names_the_field(server: Any) -> None:
    api = Client(server)
    cases = [
        (dict(cron="61 * * * *"), "schedule.cron: minute field '61'"),
        (dict(cron="* * *"), "schedule.cron: '* * *' has 3 fields"),
        (dict(cron="0 0 30 2 *"), "schedule.cron: '0 0 30 2 *' has no slot"),
        (dict(cron="* * * * *", timezone="Moon/Base"), "schedule.timezone: unknown IANA zone 'Moon/Base'"),
        (dict(cron="* * * * *", max_attempts=5000), "schedule.max_attempts: 5000"),
        (dict(cron="* * * * *", timeout_ms=-1), "schedule.timeout_ms: -1"),
        (dict(cron="* * * * *", resources={"gpu": 1}), "schedule.resources: unknown resource 'gpu'"),
        (dict(cron="* * * * *", payload=b"x" * 5000), "schedule.payload: 5000 bytes exceeds"),
        (dict(cron="* * * * *", name="a b"), "schedule.name: 'a b' is not a schedule name"),
        (dict(cron="* * * * *", name="a:b"), "schedule.name: 'a:b'"),
        (dict(cron="* * * * *", pool="nope"), "schedule.pool: unknown pool 'nope'"),
    ]
    for fields, message in cases:
        sched = {"pool": "default", "name": "n", **fields}
        with pytest.raises(grpc.RpcError) as err:
            api.schedules.PutSchedule(spb.PutScheduleRequest(schedule=spb.Schedule(**sched)), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert message in (err.value.details() or ""), (fields, err.value.details())
    status, body = server.http("PUT", "/v1/pools/default/schedules/n", {"cron": "* * * * *", "timezone": "Nowhere"})
    assert status == 400 and body["code"] == "INVALID_ARGUMENT" and "timezone" in body["message"], body
    status, body = server.http("PUT", "/v1/pools/default/schedules/n", {"cron": "*/0 * * * *"})
    assert status == 400 and "schedule.cron: minute field '*/0'" in body["message"], body
    assert api.list() == []


def test_http_put_with_payload_json_list_and_delete(server: Any) -> None:
    body = {"cron": "*/2 * * * * *", "timezone": "America/New_York", "payload_json": {"n": 1}, "priority": 4}
    status, put = server.http("PUT", "/v1/pools/default/schedules/two", body)
    assert status == 200, put
    sched = put["schedule"]
    assert sched["pool"] == "default" and sched["name"] == "two" and sched["payload_json"] == {"n": 1}
    assert sched["content_type"] == "application/json" and "payload" not in sched
    next_fire = dt.datetime.fromisoformat(sched["next_fire_at"].replace("Z", "+00:00"))
    expected = next_after(parse("*/2 * * * * *"), zone("America/New_York"), int((next_fire.timestamp() - 1) * SEC))
    assert expected == int(next_fire.timestamp() * SEC)
    status, listed = server.http("GET", "/v1/schedules?pool=default")
    assert status == 200 and [s["name"] for s in listed["schedules"]] == ["two"]
    task = eventually(
        lambda: next(
            (t for t in server.http("GET", "/v1/tasks?pool=default")[1]["tasks"] if t["key"].startswith("schedule:")),
            None,
        ),
        timeout=5,
        what="a fired task",
    )
    assert task["payload_json"] == {"n": 1} and task["priority"] == 4
    status, listed = server.http("GET", "/v1/schedules")
    assert "last_fire_at" in listed["schedules"][0]
    assert server.http("DELETE", "/v1/pools/default/schedules/two") == (200, {})
    status, body = server.http("DELETE", "/v1/pools/default/schedules/two")
    assert status == 404 and body["code"] == "NOT_FOUND"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_permissions(start_server: Any) -> None:
    srv = start_server(
        {
            "pools": [{"name": "default"}, {"name": "other"}],
            "tokens": [
                {"name": "sched", "sha256": _sha("t-sched"), "pools": ["default"], "permissions": ["schedule"]},
                {"name": "reader", "sha256": _sha("t-read"), "pools": ["default"], "permissions": ["read", "submit"]},
                {"name": "both", "sha256": _sha("t-both"), "pools": ["*"], "permissions": ["read", "schedule"]},
            ],
        }
    )
    api = Client(srv)

    def md(token: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {token}")]

    def put(token: str, pool: str) -> grpc.StatusCode:
        req = spb.PutScheduleRequest(schedule=spb.Schedule(pool=pool, name="n", cron="0 0 * * *"))
        try:
            api.schedules.PutSchedule(req, metadata=md(token), timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            return err.code()

    assert put("t-read", "default") == grpc.StatusCode.PERMISSION_DENIED
    assert put("t-sched", "other") == grpc.StatusCode.PERMISSION_DENIED
    assert put("t-sched", "default") == grpc.StatusCode.OK
    assert put("t-both", "other") == grpc.StatusCode.OK
    with pytest.raises(grpc.RpcError) as err:
        api.schedules.DeleteSchedule(spb.DeleteScheduleRequest(pool="default", name="n"), metadata=md("t-read"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Listings show only the pools the caller may read; without read on any pool: refused.
    listed = api.schedules.ListSchedules(spb.ListSchedulesRequest(), metadata=md("t-read")).schedules
    assert [(s.pool, s.name) for s in listed] == [("default", "n")]
    listed = api.schedules.ListSchedules(spb.ListSchedulesRequest(), metadata=md("t-both")).schedules
    assert [(s.pool, s.name) for s in listed] == [("default", "n"), ("other", "n")]
    with pytest.raises(grpc.RpcError) as err:
        api.schedules.ListSchedules(spb.ListSchedulesRequest(), metadata=md("t-sched"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
