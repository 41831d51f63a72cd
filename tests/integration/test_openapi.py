"""The OpenAPI document against a real server: served at /v1/openapi.json; every route it lists
called once, each exchange checked against it (tests/openapi_check.py, as every HTTP call of
the integration tests is); and a client generated from it by openapi-python-client submits a
task and reads it back."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import openapi_check

from cronoq_server.api.openapi import document


def _get_text(server: Any, path: str) -> None:
    """A GET of a route that does not answer JSON (or streams), checked against the document."""
    with urllib.request.urlopen(server.http_url + path, timeout=10) as r:
        first = r.read(1 << 16) if "watch" not in path else r.readline()
        openapi_check.check("GET", path, None, r.status, first, r.headers.get("Content-Type", ""))


def test_every_route_answers_as_the_document_says(server: Any) -> None:
    called: list[tuple[str, str]] = []

    def http(method: str, path: str, body: Any = None) -> Any:
        called.append((method, path))
        status, answer = server.http(method, path, body)
        assert 200 <= status < 300, (method, path, status, answer)
        return answer

    status, served = server.http("GET", "/v1/openapi.json")
    called.append(("GET", "/v1/openapi.json"))
    assert status == 200 and served == json.loads(json.dumps(document()))

    submitted = http("POST", "/v1/tasks", {"pool": "default", "key": "a", "payload_json": {"n": 1}, "priority": 2})
    task_id = submitted["task"]["id"]
    batch = http("POST", "/v1/batches", {"tasks": [{"pool": "other", "key": f"b{i}"} for i in range(3)]})
    assert len(batch["tasks"]) == 3
    http("GET", f"/v1/tasks/{task_id}?include_attempts=true")
    http("GET", "/v1/keys/a")
    http("GET", f"/v1/tasks/{task_id}/wait?timeout_ms=1")
    http("GET", "/v1/keys/a/wait?timeout_ms=1")
    http("GET", "/v1/tasks?pool=default&state=pending&page_size=10")
    http("GET", "/v1/workers")
    http("POST", f"/v1/tasks/{task_id}/cancel")
    http("POST", f"/v1/tasks/{task_id}/retry", {"extra_attempts": 1})
    http("POST", "/v1/keys/a/cancel")
    http("POST", "/v1/keys/a/retry")
    http("POST", "/v1/tasks/bulk-cancel", {"filter": {"pool": "other"}, "dry_run": True})
    http("POST", "/v1/tasks/bulk-retry", {"filter": {"pool": "other"}, "dry_run": True})
    http("POST", "/v1/tasks/bulk-delete", {"filter": {"key_prefix": "b"}})
    http("POST", f"/v1/tasks/{task_id}/cancel")
    http("DELETE", f"/v1/tasks/{task_id}")
    http("POST", "/v1/tasks", {"pool": "default", "key": "c"})
    http("POST", "/v1/keys/c/cancel")
    http("DELETE", "/v1/keys/c")
    put = http("PUT", "/v1/pools/default/schedules/nightly", {"cron": "0 2 * * *", "payload_json": {"x": 1}})
    assert put["schedule"]["next_fire_at"]
    http("GET", "/v1/schedules?pool=default")
    http("DELETE", "/v1/pools/default/schedules/nightly")
    http("POST", "/v1/pools/other/pause")
    http("POST", "/v1/pools/other/resume")
    http("GET", "/v1/snapshot")
    http("GET", "/v1/info")
    http("GET", "/healthz")
    http("GET", "/readyz")
    for path in ("/metrics", "/v1/watch?pool=default"):
        _get_text(server, path)
        called.append(("GET", path))

    routes = {f"{m.upper()} {p}" for p, ops in document()["paths"].items() for m in ops}
    assert {openapi_check.route_of(m, p) for m, p in called} == routes


def test_a_client_generated_from_it_submits_and_reads_a_task(server: Any, tmp_path: Path) -> None:
    spec = tmp_path / "openapi.json"
    with urllib.request.urlopen(server.http_url + "/v1/openapi.json", timeout=10) as r:
        spec.write_bytes(r.read())
    config = tmp_path / "config.yaml"
    config.write_text("project_name_override: generated\npackage_name_override: cronoq_http\npost_hooks: []\n")
    generator = Path(sys.executable).with_name("openapi-python-client")
    subprocess.run(
        [str(generator), "generate", "--path", str(spec), "--meta", "none", "--config", str(config),
         "--output-path", str(tmp_path / "cronoq_http")],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    sys.path.insert(0, str(tmp_path))
    try:
        client_mod = importlib.import_module("cronoq_http.client")
        submit = importlib.import_module("cronoq_http.api.task_service.submit_task")
        get = importlib.import_module("cronoq_http.api.task_service.get_task")
        models = importlib.import_module("cronoq_http.models")
        client = client_mod.Client(base_url=server.http_url)
        body = models.SubmitTaskRequest.from_dict({"pool": "default", "key": "gen", "payload_json": {"n": 7}})
        submitted = submit.sync(client=client, body=body)
        assert isinstance(submitted, models.SubmitTaskResponse), submitted
        task_id = submitted.task.id
        got = get.sync(client=client, task_id=task_id)
        assert isinstance(got, models.GetTaskResponse), got
        assert got.task.key == "gen" and got.task.state == models.TaskState.TASK_STATE_PENDING
        assert got.task.additional_properties.get("payload_json", got.task.to_dict().get("payload_json")) == {"n": 7}
        refused = get.sync_detailed(client=client, task_id="0")
        assert refused.status_code == 400 and isinstance(refused.parsed, models.Error)
        assert refused.parsed.code == models.ErrorCode.INVALID_ARGUMENT
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == "cronoq_http" or n.startswith("cronoq_http.")]:
            del sys.modules[name]
