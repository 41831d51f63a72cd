"""`buf breaking` against the last release's protos (proto/releases, newest) catches a change
that breaks the wire contract or the generated code, and lets additions through."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from preconditions import missing  # type: ignore[import-not-found]

REPO = Path(__file__).resolve().parents[2]
BUF = REPO / "node_modules" / ".bin" / "buf"
sys.path.insert(0, str(REPO / "release"))

import versions  # type: ignore[import-not-found]  # noqa: E402


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A copy of buf.yaml and proto/cronoq, to change."""
    if not BUF.exists():
        missing("buf (node_modules/.bin/buf: `npm ci` at the root, as ./dev tests runs)")
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(REPO / "proto" / "cronoq", tmp_path / "proto" / "cronoq")
    return tmp_path


def _breaking(workspace: Path) -> subprocess.CompletedProcess[str]:
    against = versions.contract_baseline()
    return subprocess.run(
        [str(BUF), "breaking", "--against", str(against)], cwd=workspace, capture_output=True, text=True, timeout=120
    )


def _edit(workspace: Path, name: str, old: str, new: str) -> None:
    path = workspace / "proto" / "cronoq" / "v1" / name
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_the_protos_as_they_are_pass(workspace: Path) -> None:
    out = _breaking(workspace)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_new_field_passes(workspace: Path) -> None:
    _edit(
        workspace,
        "admin_service.proto",
        "message GetServerInfoRequest {}",
        "message GetServerInfoRequest {\n  string x = 1;\n}",
    )
    out = _breaking(workspace)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("name", "old", "new", "said"),
    [
        ("task.proto", "  string pool = 2;\n  string key = 3;", "  string pool_name = 2;\n  string key = 3;", "pool"),
        ("task.proto", "  string pool = 2;\n  string key = 3;", "  string pool = 2;\n  int64 key = 3;", "key"),
        ("admin_service.proto", "  string version = 1;\n", "", "version"),
        ("admin_service.proto", "  ROLE_STANDBY = 2;\n", "", 'enum value "2" on enum "Role"'),
    ],
    ids=["renamed-field", "changed-type", "removed-field", "removed-enum-value"],
)
def test_a_break_fails_naming_it(workspace: Path, name: str, old: str, new: str, said: str) -> None:
    _edit(workspace, name, old, new)
    out = _breaking(workspace)
    assert out.returncode != 0 and said in out.stdout, out.stdout + out.stderr
