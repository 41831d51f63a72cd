"""Every gRPC channel or server option the code sets is one gRPC knows.

gRPC ignores an option name it does not know, without a word: a misspelt keepalive option
leaves gRPC's default in force (a server that answered the SDKs' keepalive pings with GOAWAY
"too_many_pings" did so for months). The names gRPC core knows are C string literals in the
installed grpcio's compiled library (GRPC_ARG_* in grpc's channel_arg_names.h), so they are read
from there: the list is exactly the one of the grpc the server runs with, with nothing to keep
up to date by hand. The TypeScript SDK's options are checked against @grpc/grpc-js's sources.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grpc
import pytest
from preconditions import missing  # type: ignore[import-not-found]

REPO = Path(__file__).resolve().parents[2]
# Every Python tree of the repository that may open a gRPC channel or server.
PYTHON_TREES = ["server/cronoq_server", "sdk-python/cronoq", "conformance", "tests", "bench", "examples"]
OPTION = re.compile(r"grpc\.[a-z0-9_]+(\.[a-z0-9_]+)*")


def known_core_options() -> set[str]:
    """The "grpc.*" string literals of the installed grpcio's compiled libraries."""
    names: set[str] = set()
    for lib in Path(grpc.__file__).parent.rglob("*.so"):
        for m in re.finditer(rb"grpc\.[a-z0-9_]+(?:\.[a-z0-9_]+)*(?=\x00)", lib.read_bytes()):
            names.add(m.group().decode())
    return names


def python_options() -> dict[str, list[str]]:
    """name -> where: the first element of every ("grpc.x", value) pair in the Python sources,
    how grpc's Python API takes options (a tuple, or a list of two)."""
    found: dict[str, list[str]] = {}
    for tree in PYTHON_TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or path == Path(__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) == 2:
                    first = node.elts[0]
                    if isinstance(first, ast.Constant) and isinstance(first.value, str):
                        if OPTION.fullmatch(first.value):
                            where = f"{path.relative_to(REPO)}:{node.lineno}"
                            found.setdefault(first.value, []).append(where)
    return found


def test_the_scan_of_grpc_finds_its_option_names() -> None:
    known = known_core_options()
    # Without these the scan is broken (a grpcio built differently), not the code checked.
    assert {"grpc.keepalive_time_ms", "grpc.http2.min_ping_interval_without_data_ms"} <= known, sorted(known)[:20]
    assert "grpc.http2.min_recv_ping_interval_without_data_ms" not in known


def test_every_grpc_option_set_in_python_is_one_grpc_knows() -> None:
    found = python_options()
    # The scan sees the places that set options: the server, its peer channels, the SDK.
    wheres = [w for ws in found.values() for w in ws]
    for source in ("api/grpc.py", "cronoq_server/sharding/peers.py", "cronoq/_transport.py", "conformance/scripted.py"):
        assert any(source in w for w in wheres), f"no grpc option found in {source}: the scan is broken"
    known = known_core_options()
    unknown = {name: where for name, where in found.items() if name not in known}
    assert not unknown, f"option names grpc {grpc.__version__} does not know (it ignores them): {unknown}"


def test_every_grpc_option_of_the_typescript_sdk_is_one_grpc_js_knows() -> None:
    grpc_js = REPO / "sdk-ts/node_modules/@grpc/grpc-js/build/src"
    if not grpc_js.is_dir():
        missing("sdk-ts/node_modules is not installed (npm --prefix sdk-ts ci)")
    sources = "".join(p.read_text() for p in grpc_js.glob("*.js"))
    known = {m.group(1) for m in re.finditer(r"""['"](grpc(?:-node)?\.[a-z0-9_.]+)['"]""", sources)}
    assert "grpc.keepalive_time_ms" in known
    names = set(re.findall(r'"(grpc\.[a-z0-9_.]+)"\s*:', (REPO / "sdk-ts/src/transport.ts").read_text()))
    assert "grpc.keepalive_time_ms" in names, "no grpc option found in sdk-ts/src/transport.ts: the scan is broken"
    assert names <= known, f"option names @grpc/grpc-js does not know: {sorted(names - known)}"


@pytest.mark.parametrize("typo", ["grpc.http2.min_recv_ping_interval_without_data_ms", "grpc.keepalive_time"])
def test_a_misspelt_option_is_not_taken_for_a_known_one(typo: str) -> None:
    assert typo not in known_core_options()
