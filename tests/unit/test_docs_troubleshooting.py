"""docs/troubleshooting.md has a row for every `reason` the server can refuse a call with (the
ErrorInfo reason a program tests), read from the server's code, naming each gRPC code the code
gives it with: a new reason without its row, or a row with the wrong code, fails here. A refusal
given no reason has its code's name, which the page's first table lists."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server" / "cronoq_server"
PAGE = ROOT / "docs" / "troubleshooting.md"
# shard_refusal(shard, why, reason) refuses with this code.
SHARD_REFUSAL_CODE = "FAILED_PRECONDITION"


def reasons() -> dict[str, set[str]]:
    """Every reason given to an ApiError (`reason="X"`, `reason=NAME` of a module constant, the
    reason argument of shard_refusal(shard, why, "X")), with the codes it is given with where the
    code is written out (`grpc.StatusCode.X`; a code held in a variable is not known here)."""
    trees = [ast.parse(path.read_text()) for path in SERVER.rglob("*.py")]
    constants = {
        target.id: node.value.value
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id.isupper()
    }
    found: dict[str, set[str]] = defaultdict(set)
    for tree in trees:
        for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
            given = [k.value for k in call.keywords if k.arg == "reason"]
            code = call.args[0] if call.args else None
            codes = {code.attr} if isinstance(code, ast.Attribute) and code.attr.isupper() else set()
            if isinstance(call.func, ast.Name) and call.func.id == "shard_refusal":
                given.append(call.args[2])
                codes = {SHARD_REFUSAL_CODE}
            for value in given:
                if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value.isupper():
                    found[value.value] |= codes
                elif isinstance(value, ast.Name) and value.id in constants:
                    found[constants[value.id]] |= codes
    return found


def test_every_reason_has_a_row_naming_its_codes() -> None:
    found = reasons()
    assert {"NOT_LEADER", "PENDING_LIMIT", "REQUEST_TOO_LARGE", "WRONG_SHARD"} <= found.keys()
    assert found["REQUEST_TOO_LARGE"] == {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| ([^|]*) \|", PAGE.read_text(), flags=re.M))
    assert sorted(r for r in found if r not in rows) == [], "reasons with no row"
    wrong = {r: sorted(c for c in codes if f"`{c}`" not in rows[r]) for r, codes in found.items()}
    assert {r: codes for r, codes in wrong.items() if codes} == {}, "codes a reason's row does not name"


def test_every_code_a_caller_meets_has_a_row() -> None:
    text = PAGE.read_text()
    codes = {code.name for code in grpc.StatusCode} - {"OK", "CANCELLED", "UNKNOWN", "DATA_LOSS"}
    assert sorted(c for c in codes if f"| `{c}` |" not in text) == []
