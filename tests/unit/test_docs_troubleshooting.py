"""docs/troubleshooting.md names every `reason` the server can refuse a call with (the
ErrorInfo reason a program tests), read from the server's code: a new reason without its row
fails here. A refusal given no reason has its code's name, which the page's first table lists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server" / "cronoq_server"
PAGE = ROOT / "docs" / "troubleshooting.md"


def reasons() -> set[str]:
    """Every reason given to an ApiError: `reason="X"`, `reason=NAME` of a module constant, and
    the reason argument of shard_refusal(shard, why, "X")."""
    trees = [ast.parse(path.read_text()) for path in SERVER.rglob("*.py")]
    constants = {
        target.id: node.value.value
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id.isupper()
    }
    found = set()
    for tree in trees:
        for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
            given = [k.value for k in call.keywords if k.arg == "reason"]
            if isinstance(call.func, ast.Name) and call.func.id == "shard_refusal":
                given.append(call.args[2])
            for value in given:
                if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value.isupper():
                    found.add(value.value)
                elif isinstance(value, ast.Name) and value.id in constants:
                    found.add(constants[value.id])
    return found


def test_every_reason_and_code_the_server_refuses_with_is_on_the_page() -> None:
    assert {"NOT_LEADER", "PENDING_LIMIT", "REQUEST_TOO_LARGE", "WRONG_SHARD"} <= reasons()
    text = PAGE.read_text()
    assert sorted(r for r in reasons() if not re.search(rf"`{r}`", text)) == []
    codes = {code.name for code in grpc.StatusCode} - {"OK", "CANCELLED", "UNKNOWN", "DATA_LOSS"}
    assert sorted(c for c in codes if f"| `{c}` |" not in text) == []
