"""The CLI's view of workflows against a real server: `get --tree` (what a task spawned, and
theirs, with the tasks that depend on it; past the 1,000 children GetTask returns too),
`cancel --descendants`, `tasks --parent-id` and the bulk filter's --parent-id, and
`submit --run-when`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
from _helpers import Api, cli, eventually
from test_sharding import TOKENS, TwoShards, bearer

from cronoq.v1 import task_pb2, worker_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

EXIT_FAILED_PRECONDITION = 7


def spawned(key: str = "", depends_on: tuple[str | int, ...] = ()) -> tpb.SubmitTaskRequest:
    refs = [task_pb2.TaskRef(key=d) if isinstance(d, str) else task_pb2.TaskRef(id=d) for d in depends_on]
    return tpb.SubmitTaskRequest(pool="default", key=key, depends_on=refs)


def run_spawning(api: Api, worker: str, task_id: int, *children: tpb.SubmitTaskRequest) -> None:
    """Leases the task (it must be the only one due) and succeeds it with these spawned tasks."""
    (leased,) = api.lease(worker, n=1)
    assert leased.id == task_id, (leased.id, task_id)
    result = api.finish(worker, leased, success=wpb.TaskSuccess(result=b"ok", spawn=list(children)))
    assert result.accepted, result


def task_id_of(api: Api, key: str) -> int:
    return api.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(key=key))).task.id


def workflow(api: Api) -> dict[str, int]:
    """root spawned c1 and c2 (c2 depends on c1); c1 spawned g1; `after` (a pool no worker
    serves here) depends on root."""
    root = api.submit(key="root").id
    after = api.submit("other", key="after", depends_on=[root]).id
    worker = api.register()
    run_spawning(api, worker, root, spawned("c1"), spawned("c2", ("c1",)))
    c1 = task_id_of(api, "c1")
    run_spawning(api, worker, c1, spawned("g1"))
    ids = {name: task_id_of(api, name) for name in ("c2", "g1")}
    return {"root": root, "after": after, "c1": c1, **ids}


def test_get_tree_prints_what_a_task_spawned_recursively_and_its_dependents(server: Any) -> None:
    api = Api(server.grpc_target)
    ids = workflow(api)
    lines = cli(server, "get", "--tree", "root").stdout.splitlines()
    names = ("root", "c1", "g1", "c2")
    shape = [(line.split(str(ids[name]))[0], name) for line, name in zip(lines[:4], names, strict=True)]
    assert shape == [("", "root"), ("|-- ", "c1"), ("|   `-- ", "g1"), ("`-- ", "c2")], lines
    assert lines[0].split() == [str(ids["root"]), "default", "succeeded", lines[0].split()[3], "key=root"]
    assert lines[3].split()[2:] == ["default", "pending", "-", "key=c2"]  # never started: no duration
    assert lines[4:] == ["depended on by:", f"  {ids['after']}  other  pending  -  key=after"]

    tree = json.loads(cli(server, "get", "--tree", str(ids["root"]), "--json").stdout)
    assert (tree["id"], tree["state"], tree["key"]) == (str(ids["root"]), "TASK_STATE_SUCCEEDED", "root")
    assert isinstance(tree["duration_ms"], int) and tree["duration_ms"] >= 0
    assert [c["key"] for c in tree["children"]] == ["c1", "c2"]
    c1, c2 = tree["children"]
    assert c1["parent_id"] == str(ids["root"]) and [g["key"] for g in c1["children"]] == ["g1"]
    assert c2["children"] == [] and c2["duration_ms"] is None
    assert [(d["id"], d["state"]) for d in tree["dependents"]] == [(str(ids["after"]), "TASK_STATE_PENDING")]

    leaf = json.loads(cli(server, "get", "--tree", "g1", "--json").stdout)
    assert leaf["children"] == [] and leaf["dependents"] == [] and leaf["parent_id"] == str(ids["c1"])
    both = cli(server, "get", "--tree", "--attempts", "root", check=False)
    assert both.returncode == 2 and "--tree or --attempts" in both.stderr


def test_get_tree_pages_past_the_children_get_returns(start_server: Any) -> None:
    server = start_server({"pools": [{"name": "default"}], "limits": {"max_batch_size": 1100}})
    api = Api(server.grpc_target)
    root = api.submit(key="wide").id
    run_spawning(api, api.register(), root, *(spawned() for _ in range(1001)))
    tree = json.loads(cli(server, "get", "--tree", "wide", "--json").stdout)
    children = [int(c["id"]) for c in tree["children"]]
    assert len(children) == 1001 and len(set(children)) == 1001 and children == sorted(children)
    assert {c["parent_id"] for c in tree["children"]} == {str(root)}
    lines = cli(server, "get", "--tree", "wide").stdout.splitlines()
    assert len(lines) == 1 + 1001 and lines[-1].startswith(f"`-- {children[-1]}  default  pending")


def test_tasks_and_bulk_filters_take_parent_id(server: Any) -> None:
    api = Api(server.grpc_target)
    ids = workflow(api)
    listed = [
        json.loads(line) for line in cli(server, "tasks", "--parent-id", str(ids["root"]), "--json").stdout.splitlines()
    ]
    assert [(t["key"], t["parent_id"]) for t in listed] == [("c1", str(ids["root"])), ("c2", str(ids["root"]))]
    bulk = ("cancel", "--all-matching", "--pool", "default", "--parent-id", str(ids["c1"]), "--dry-run", "--json")
    assert json.loads(cli(server, *bulk).stdout)["matched"] == "1"  # g1 (an int64: a string in proto JSON)
    bad = cli(server, "tasks", "--parent-id", "c1", check=False)
    assert bad.returncode == 2 and "'c1' is not a task id" in bad.stderr


def test_cancel_descendants_cancels_what_a_succeeded_task_spawned_and_their_dependents(server: Any) -> None:
    api = Api(server.grpc_target)
    ids = workflow(api)
    outside = api.submit(key="outside", depends_on=["c2"]).id  # a dependent of a descendant
    out = cli(server, "cancel", "--descendants", "root", "--json")
    answer = json.loads(out.stdout)
    assert answer["state"] == "TASK_STATE_SUCCEEDED" and int(answer["descendants_cancelled"]) >= 2
    assert "already SUCCEEDED" in out.stderr and "descendant(s) cancelled" in out.stderr
    for name in ("c2", "g1"):
        assert api.get(ids[name]).state == task_pb2.TASK_STATE_CANCELLED, name
    assert api.get(outside).state == task_pb2.TASK_STATE_CANCELLED
    assert api.get(ids["c1"]).state == task_pb2.TASK_STATE_SUCCEEDED  # ended: left as it is

    again = cli(server, "cancel", "--descendants", "root", check=False)
    assert again.returncode == EXIT_FAILED_PRECONDITION and "0 descendant(s) cancelled" in again.stderr
    assert "descendants_cancelled 0" in again.stdout


def test_submit_run_when_ended_makes_a_finalizer(server: Any) -> None:
    api = Api(server.grpc_target)
    first = api.submit(key="first").id
    out = cli(server, "submit", "--depends-on", str(first), "--run-when", "ended", "--json").stdout
    assert json.loads(out)["run_when"] == "RUN_WHEN_DEPENDENCIES_ENDED"
    plain = cli(server, "submit", "--depends-on", "first", "--json").stdout
    assert json.loads(plain)["run_when"] in ("RUN_WHEN_UNSPECIFIED", "RUN_WHEN_DEPENDENCIES_SUCCEEDED")
    refused = cli(server, "submit", "--run-when", "ended", check=False)
    assert refused.returncode == 2 and "only with --depends-on" in refused.stderr


def test_a_workflow_read_and_cancelled_by_key_through_another_shard(tmp_path: Path, start_server: Any) -> None:
    shards = TwoShards(tmp_path, start_server)
    token = ("--token", TOKENS["full"])
    cli(shards.cpu, "submit", "--pool", "llm", "--key", "gpu-root", *token)  # forwarded to gpu
    workers = worker_service_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(shards.gpu.grpc_target))
    register = wpb.RegisterWorkerRequest(pools=["llm"], name="w", concurrency=1)
    worker = workers.RegisterWorker(register, metadata=bearer("full")).worker_id
    lease = wpb.LeaseTasksRequest(worker_id=worker, max_tasks=1)
    (root,) = eventually(lambda: workers.LeaseTasks(lease, metadata=bearer("full")).tasks, what="the root leased")
    spawn = [tpb.SubmitTaskRequest(pool="llm", key=f"gpu-child-{i}") for i in range(2)]
    done = wpb.TaskOutcome(task_id=root.id, attempt=root.attempt, success=wpb.TaskSuccess(spawn=spawn))
    finished = workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=[done]), metadata=bearer("full"))
    assert finished.results[0].accepted

    tree = json.loads(cli(shards.cpu, "get", "--tree", "gpu-root", *token, "--json").stdout)
    assert tree["id"] == str(root.id) and [c["key"] for c in tree["children"]] == ["gpu-child-0", "gpu-child-1"]
    out = json.loads(cli(shards.cpu, "cancel", "--descendants", "gpu-root", *token, "--json").stdout)
    assert out["descendants_cancelled"] == "2"
    listed = cli(shards.cpu, "tasks", "--parent-id", str(root.id), "--state", "cancelled", *token, "--json")
    assert [json.loads(line)["key"] for line in listed.stdout.splitlines()] == ["gpu-child-0", "gpu-child-1"]
