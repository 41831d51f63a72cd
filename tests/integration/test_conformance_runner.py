"""The conformance runner catches what it is there to catch: its comparisons fail on a wrong
observation, and a driver that breaks a connection rule fails the case (the scripted server
sees the token arrive, a connection made, the wrong outcome)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "conformance"))

import runner  # type: ignore[import-not-found]  # noqa: E402
from netns import NetNs, open_for_test  # type: ignore[import-not-found]  # noqa: E402
from tls_pki import Pki  # type: ignore[import-not-found]  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# A driver that breaks the rules on purpose: it runs the Python driver with the case's input
# changed as the SDK must never change it by itself.
LEAKY = """
import json, subprocess, sys
case = json.load(sys.stdin)
case["insecure_redirect_http"] = True
sys.exit(subprocess.run([sys.executable, {driver!r}], input=json.dumps(case).encode()).returncode)
"""


def case(name: str) -> dict[str, Any]:
    return next(c for c in runner.load_cases() if c["name"] == name)


def test_match_checks_only_the_keys_named_counts_and_phrases() -> None:
    observed = {"op": "worker", "handled": [1, 2], "error": {"code": "UNAVAILABLE", "message": "TLS handshake failed"}}
    assert runner.match({"op": "worker", "handled_count": 2}, observed, "s") == []
    assert runner.match({"error": {"message_has": ["tls handshake"]}}, observed, "s") == []
    assert runner.match({"handled_count": 3}, observed, "s") == ["s.handled: 2 entries, expected 3"]
    assert runner.match({"error": {"message_has": ["certificate"]}}, observed, "s")
    assert runner.match({"error": None}, observed, "s")
    assert runner.match([{"op": "worker"}], [observed, observed], "steps") == [
        f"steps: expected {[{'op': 'worker'}]!r}, got {[observed, observed]!r}"
    ]


def test_match_checks_phrases_in_any_text_and_lists_of_objects_item_by_item() -> None:
    observed = {"task_error": "pool llm is served by shard gpu", "children": [{"id": "7", "state": "A"}, {"id": "8"}]}
    assert runner.match({"task_error_has": ["LLM", "gpu"], "children": [{"id": "7"}, {}]}, observed, "s") == []
    assert runner.match({"task_error_has": ["cpu"]}, observed, "s") == [
        "s.task_error: 'pool llm is served by shard gpu' lacks 'cpu'"
    ]
    assert runner.match({"children": [{"id": "8"}, {}]}, observed, "s") == ["s.children[0].id: expected '8', got '7'"]
    assert runner.match({"children": [{}]}, observed, "s")  # one item for two
    assert runner.match({"missing_has": ["x"]}, observed, "s") == ["s.missing: None lacks 'x'"]


def test_expect_may_name_what_the_driver_answered_for_an_earlier_step() -> None:
    observed = {"steps": [{"op": "submit", "id": "72057594037927937", "error": None}, {"op": "get", "n": 3}]}
    values = runner.step_values(observed)
    assert values == {"steps.0.op": "submit", "steps.0.id": "72057594037927937", "steps.1.op": "get"}
    expect = runner.substitute({"children": [{"parent_id": "{steps.0.id}"}]}, values)
    assert expect == {"children": [{"parent_id": "72057594037927937"}]}
    assert runner.step_values({"steps": None}) == {}


def test_check_servers_fails_on_a_leaked_token_a_connection_or_a_wrong_outcome() -> None:
    def call(role: str, method: str, auth: str = "Bearer tok", **request: Any) -> dict[str, Any]:
        return {
            "role": role,
            "event": "call",
            "method": method,
            "authorization": auth,
            "client_cert": "",
            "request": request,
        }

    log = [
        {"role": "a", "event": "connect"},
        call("a", "RegisterWorker"),
        {"role": "r", "event": "connect"},
        call("r", "RegisterWorker"),
        call("r", "Work", outcomes=[{"task_id": "1"}]),
        {"role": "r", "event": "outcome", "task_id": "1", "kind": "failure"},
    ]
    expect = {
        "calls": [{"methods": ["RegisterWorker"], "roles": ["a"]}],
        "no_connection": ["r"],
        "token_not_at": ["r"],
        "client_cert_at": ["a"],
        "outcomes": {"1": "success"},
        "outcomes_batched": True,
    }
    problems = runner.check_servers(expect, log, "tok", "python")
    assert len(problems) == 6, problems
    assert runner.check_servers({"token_at": ["a", "r"], "connected": ["a"]}, log, "tok", "python") == []


def test_check_servers_wants_the_sdk_and_its_version_first_in_every_user_agent() -> None:
    def call(role: str, agent: str) -> dict[str, Any]:
        return {"role": role, "event": "call", "method": "Work", "user_agent": agent, "request": {}}

    ours = f"cronoq-go/{runner.VERSION}"
    log = [
        call("a", f"{ours} grpc-go/1.79.0"),
        call("a", ours),
        call("b", f"{ours} grpc-go/1.79.0"),
        call("b", "grpc-go/1.79.0"),
    ]
    assert runner.check_servers({"user_agent_at": ["a"]}, log, None, "go") == []
    assert len(runner.check_servers({"user_agent_at": ["a"]}, log, None, "ts")) == 1  # another SDK's name
    assert len(runner.check_servers({"user_agent_at": ["b", "c"]}, log, None, "go")) == 2  # one call without; no call
    log = [call("a", f"cronoq-go/{runner.VERSION}9 grpc-go/1.79.0")]  # another version
    assert len(runner.check_servers({"user_agent_at": ["a"]}, log, None, "go")) == 1


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[runner.Pkis, NetNs]]:
    ns = open_for_test()
    tmp = tmp_path_factory.mktemp("pki")
    pkis = runner.Pkis(Pki(tmp, "ca"), Pki(tmp, "unknown-ca"), ("127.0.0.1", "localhost", ns.peer_ip))
    pkis.client = pkis.trusted.client(runner.CLIENT_SUBJECT, "worker")
    try:
        yield pkis, ns
    finally:
        ns.close()


def test_the_python_driver_passes_and_a_leaky_driver_fails(setting: tuple[runner.Pkis, NetNs], tmp_path: Path) -> None:
    pkis, ns = setting
    leaky = tmp_path / "leaky.py"
    leaky.write_text(LEAKY.format(driver=runner.DRIVERS["python"][1]))
    refused = case("redirect-plain-http-remote-refused")
    assert runner.run_case(refused, "python", pkis, ns, None, verbose=False).passed
    runner.DRIVERS["leaky"] = [sys.executable, str(leaky)]
    try:
        outcome = runner.run_case(refused, "leaky", pkis, ns, None, verbose=False)
    finally:
        del runner.DRIVERS["leaky"]
    assert not outcome.passed
    text = json.dumps(outcome.problems)
    assert "r: the token arrived there" in text and "connection(s), expected none" in text, text
