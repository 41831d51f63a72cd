"""Every RPC has a method in each of the four SDKs, as docs/sdks.md's table names it.

The RPCs come from the protos (the server's registry); each SDK's public API is read from its
code: Python by import, Go's exported methods of *Client, TypeScript's methods of the exported
class Client, Rust's `pub fn`s of `impl Client`. The worker's RPCs name the SDK's Worker type.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import cronoq
from cronoq_server.registry import registry

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "sdks.md"
SDKS = ("python", "go", "ts", "rust")
ROW = re.compile(r"^\| `(\w+)\.(\w+)` \|" + r" `(\w+)` \|" * len(SDKS) + r"$", re.M)


def table() -> dict[str, dict[str, str]]:
    """RPC name ('TaskService.SubmitTask') -> SDK -> the method the table names."""
    return {f"{svc}.{rpc}": dict(zip(SDKS, names, strict=True)) for svc, rpc, *names in ROW.findall(TABLE.read_text())}


def block(text: str, opening: str) -> str:
    """The lines of the block that opens with `opening` (at the start of a line) up to its
    closing brace at the start of a line."""
    start = text.index(opening)
    return text[start : text.index("\n}", start)]


def go_api() -> set[str]:
    code = "\n".join(p.read_text() for p in (ROOT / "sdk-go").glob("*.go") if not p.name.endswith("_test.go"))
    methods = set(re.findall(r"^func \(\w+ \*Client\) ([A-Z]\w*)\(", code, re.M))
    types = set(re.findall(r"^type ([A-Z]\w*) ", code, re.M))
    return methods | types


def ts_api() -> set[str]:
    src = ROOT / "sdk-ts" / "src"
    methods = set(
        re.findall(
            r"^  (?:async\s*\*?\s*)?([a-z]\w*)\(", block((src / "client.ts").read_text(), "export class Client"), re.M
        )
    )
    exported = set(re.findall(r"^export class (\w+)", "\n".join(p.read_text() for p in src.glob("*.ts")), re.M))
    return methods | exported


def rust_api() -> set[str]:
    src = ROOT / "sdk-rust" / "src"
    methods = set(
        re.findall(r"^    pub (?:async )?fn (\w+)", block((src / "client.rs").read_text(), "impl Client {"), re.M)
    )
    types = set(re.findall(r"^pub struct (\w+)", "\n".join(p.read_text() for p in src.glob("*.rs")), re.M))
    return methods | types


def python_api() -> set[str]:
    return {n for n in dir(cronoq.Client) if not n.startswith("_")} | {"Worker"}


def test_every_rpc_has_a_row_and_only_those() -> None:
    rpcs = {f"{rpc.service.rsplit('.', 1)[1]}.{rpc.name}" for rpc in registry().values()}
    rows = table()
    assert sorted(rpcs - rows.keys()) == [], "RPCs with no row in docs/sdks.md"
    assert sorted(rows.keys() - rpcs) == [], "rows of docs/sdks.md that name no RPC"


def test_the_worker_rpcs_are_the_worker_types() -> None:
    work = {f"{r.service.rsplit('.', 1)[1]}.{r.name}" for r in registry().values() if r.permission == "work"}
    assert work, "no worker RPC found"
    for name, methods in table().items():
        assert (set(methods.values()) == {"Worker"}) == (name in work), name


@pytest.mark.parametrize("sdk", SDKS)
def test_each_method_is_in_the_sdks_public_api(sdk: str) -> None:
    api = {"python": python_api, "go": go_api, "ts": ts_api, "rust": rust_api}[sdk]()
    missing = sorted(f"{rpc}: {methods[sdk]}" for rpc, methods in table().items() if methods[sdk] not in api)
    assert missing == [], f"{sdk}: no such method (the table of docs/sdks.md)"
