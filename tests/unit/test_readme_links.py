"""The READMEs' links lead somewhere: each relative link of a README (the front door and those
of the SDKs, the server, releases, benchmarks, conformance) names a file of the repository, and
its #anchor a heading of that file, as GitHub makes them. The docs site's own links are checked
by `./dev docs` (strict)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from md_pages import without_code

ROOT = Path(__file__).resolve().parents[2]
# The repository's READMEs at the top and one folder down (git's files: no tool's cache or build output).
READMES = [
    ROOT / name
    for name in subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "README.md", "*/README.md"], capture_output=True, text=True, check=True
    ).stdout.split()
    if name.count("/") <= 1
]
# ](target) of a link or an image, outside code blocks.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = without_code(page.read_text())
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def links(readme: Path) -> list[str]:
    return [t for t in LINK.findall(without_code(readme.read_text())) if not re.match(r"[a-z]+:", t)]


def test_the_anchor_of_a_heading_is_githubs() -> None:
    assert github_anchor("Upgrades and rollbacks") == "upgrades-and-rollbacks"
    assert github_anchor("Keys: replace, debounce; `start_by`") == "keys-replace-debounce-start_by"


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_and_a_heading_that_exist(readme: Path) -> None:
    broken = []
    for target in links(readme):
        path, _, anchor = target.partition("#")
        page = (readme.parent / path).resolve() if path else readme
        if not page.exists():
            broken.append(f"{target}: no such file")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            broken.append(f"{target}: no heading #{anchor} in {page.relative_to(ROOT)}")
    assert broken == [], f"{readme.relative_to(ROOT)}: {broken}"
