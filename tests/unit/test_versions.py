"""One version per release: VERSION at the root, and every package's manifest, lock file and
version constant saying the same (release/versions.py lists the places)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "release"))

import versions  # type: ignore[import-not-found]  # noqa: E402


def test_every_package_declares_the_release_version() -> None:
    assert versions.mismatches() == []


def test_installed_python_distributions_report_the_release_version() -> None:
    import cronoq
    import cronoq_server

    want = versions.release_version()
    for dist in ("cronoq-api", "cronoq-sdk", "cronoq-server"):
        assert importlib.metadata.version(dist) == want, dist
    assert cronoq.__version__ == want
    assert cronoq_server.__version__ == want


def _copy_places(tmp: Path) -> Path:
    for rel in {p.path for p in versions.PLACES} | {versions.VERSION_FILE, "sdk-rust/Cargo.toml"}:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp / rel)
    return tmp


def test_set_version_writes_every_place(tmp_path: Path) -> None:
    root = _copy_places(tmp_path)
    versions.set_version("12.34.56", root)
    assert versions.mismatches(root) == []
    assert versions.release_version(root) == "12.34.56"
    # What each ecosystem's own parser reads.
    for rel in ("proto/python/pyproject.toml", "sdk-python/pyproject.toml", "server/pyproject.toml"):
        project = tomllib.loads((root / rel).read_text())["project"]
        assert project["version"] == "12.34.56", rel
        pins = [d for d in project.get("dependencies", []) if d.startswith("cronoq-api")]
        assert all(d.startswith("cronoq-api==12.34.56") for d in pins), pins
    assert json.loads((root / "sdk-ts/package.json").read_text())["version"] == "12.34.56"
    lock = json.loads((root / "sdk-ts/package-lock.json").read_text())
    assert lock["version"] == lock["packages"][""]["version"] == "12.34.56"
    assert tomllib.loads((root / "sdk-rust/Cargo.toml").read_text())["package"]["version"] == "12.34.56"
    crate = versions.rust_crate_name(root)
    locked = [p for p in tomllib.loads((root / "sdk-rust/Cargo.lock").read_text())["package"] if p["name"] == crate]
    assert [p["version"] for p in locked] == ["12.34.56"]
    # The READMEs' install lines, as a user copies them: none still names the old version.
    rust_readme = (root / "sdk-rust/README.md").read_text()
    assert '\ncronoq-sdk = "12.34.56"\n' in rust_readme
    assert 'cronoq-sdk = { version = "12.34.56", features = ["otel"] }' in rust_readme
    assert "sdk-go@v12.34.56" in (root / "sdk-go/README.md").read_text()
    assert "cronoq-12.34.56.tgz" in (root / "sdk-ts/README.md").read_text()
    old = versions.release_version()
    for readme in ("sdk-rust/README.md", "sdk-go/README.md", "sdk-ts/README.md"):
        assert old not in (root / readme).read_text(), readme
    # Nothing else changed: the dependencies' versions in the lock files are untouched.
    before = json.loads((REPO / "sdk-ts/package-lock.json").read_text())["packages"]
    after = lock["packages"]
    assert {k: v for k, v in before.items() if k} == {k: v for k, v in after.items() if k}


def test_a_mismatch_names_the_file(tmp_path: Path) -> None:
    root = _copy_places(tmp_path)
    (root / "sdk-go/version.go").write_text((root / "sdk-go/version.go").read_text().replace('"', '"9', 1))
    problems = versions.mismatches(root)
    assert len(problems) == 1 and problems[0].startswith("sdk-go/version.go: found '9"), problems


def test_a_readme_install_line_that_names_another_version_is_a_mismatch(tmp_path: Path) -> None:
    root = _copy_places(tmp_path)
    readme = root / "sdk-rust/README.md"
    readme.write_text(readme.read_text().replace(f'cronoq-sdk = "{versions.release_version()}"', 'cronoq-sdk = "0.1"'))
    problems = versions.mismatches(root)
    assert len(problems) == 1 and problems[0].startswith("sdk-rust/README.md: found '0.1'"), problems


@pytest.mark.parametrize("bad", ["1.2", "v1.2.3", "1.2.3-rc.1", "1.2.3\n4"])
def test_set_version_refuses_what_is_not_x_y_z(bad: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"is not X\.Y\.Z"):
        versions.set_version(bad, _copy_places(tmp_path))
