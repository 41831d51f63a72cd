"""The names a release publishes (release/names.py), judged against what each registry lists:
free or ours passes, another project's fails naming the manifest to change, an unreachable
registry only warns. The registries' answers are given here: no network."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "release"))

import names  # type: ignore[import-not-found]  # noqa: E402

OURS = "https://github.com/cronoq/cronoq"
# What PyPI listed for `cronoq` when the SDK was first to be published under that name.
OTHERS = names.Listing(
    ["https://github.com/synaptiai/cronoq", "https://synaptiai.github.io/cronoq/"],
    "Elastic, priority-aware task scheduler for asyncio",
)


def _unreachable(name: str) -> names.Listing | None:
    raise names.Unreachable("no network")


def test_every_manifest_publishes_under_its_name_and_declares_our_repository() -> None:
    published = {(p.registry, p.name): p for p in names.published()}
    assert set(published) == {
        ("PyPI", "cronoq-api"),
        ("PyPI", "cronoq-sdk"),
        ("PyPI", "cronoq-server"),
        ("npm", "cronoq"),
        ("crates.io", "cronoq-sdk"),
        ("Go", "github.com/cronoq/cronoq/sdk-go"),
    }
    assert {names.repository_key(p.repository) for p in published.values()} == {"github.com/cronoq/cronoq"}


@pytest.mark.parametrize(
    "url",
    [
        "git+https://github.com/cronoq/cronoq.git",
        "https://github.com/cronoq/cronoq/tree/main/sdk-python#readme",
        "https://GitHub.com/cronoq/cronoq/",
        "git@github.com:cronoq/cronoq.git",
    ],
)
def test_repository_key_reads_every_spelling_of_one_repository(url: str) -> None:
    assert names.repository_key(url) == names.repository_key(OURS)


def test_a_name_another_project_holds_fails_naming_its_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    pub = names.Published("PyPI", "cronoq", "sdk-python/pyproject.toml", OURS)
    (line,) = names.check([pub], {"PyPI": lambda name: OTHERS})
    assert "PyPI 'cronoq' (sdk-python/pyproject.toml) is another project's" in line
    assert "github.com/synaptiai/cronoq" in line and "rename it in sdk-python/pyproject.toml" in line


def test_free_and_own_names_pass(capsys: pytest.CaptureFixture[str]) -> None:
    free = names.Published("PyPI", "cronoq-sdk", "sdk-python/pyproject.toml", OURS)
    ours = names.Published("npm", "cronoq", "sdk-ts/package.json", "git+https://github.com/cronoq/cronoq.git")
    listings = {"PyPI": lambda name: None, "npm": lambda name: names.Listing([OURS + ".git"], "")}
    assert names.check([free, ours], listings) == []
    printed = capsys.readouterr().out
    assert "PyPI 'cronoq-sdk' (sdk-python/pyproject.toml): free" in printed
    assert "npm 'cronoq' (sdk-ts/package.json): ours" in printed


def test_an_unreachable_registry_warns_and_does_not_fail(capsys: pytest.CaptureFixture[str]) -> None:
    pub = names.Published("crates.io", "cronoq-sdk", "sdk-rust/Cargo.toml", OURS)
    assert names.check([pub], {"crates.io": _unreachable}) == []
    assert "WARNING: crates.io 'cronoq-sdk' (sdk-rust/Cargo.toml): cannot ask crates.io (no network)" in (
        capsys.readouterr().out
    )


def test_a_listing_without_any_url_is_not_ours() -> None:
    pub = names.Published("crates.io", "cronoq", "sdk-rust/Cargo.toml", OURS)
    (line,) = names.check([pub], {"crates.io": lambda name: names.Listing([], "a scheduler")})
    assert "no repository given" in line
