"""Each SDK's README has the sections a user of it looks for (by heading, case-insensitive, a
heading counting when it starts with the words: "A worker in ten lines"), and its API reference
section names the tool that builds the reference and where `./dev docs` puts it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from md_pages import sections

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("install", "a worker", "a client", "errors", "options", "api reference")
# SDK directory -> (the tool named in its API reference section, its directory under site/api/)
REFERENCES = {
    "sdk-python": ("pdoc", "python"),
    "sdk-go": ("go doc", "go"),
    "sdk-ts": ("TypeDoc", "typescript"),
    "sdk-rust": ("cargo doc", "rust"),
}


def readme_sections(readme: Path) -> dict[str, str]:
    """The README's text under each `##` heading, by the heading lower-cased."""
    return {heading.lower(): body for heading, body in sections(readme.read_text()).items()}


def find(found: dict[str, str], wanted: str) -> str | None:
    """The heading that starts with the words `wanted`, if any."""
    return next((h for h in found if re.match(rf"{re.escape(wanted)}\b", h)), None)


@pytest.mark.parametrize("sdk", sorted(REFERENCES))
def test_readme_has_every_section(sdk: str) -> None:
    found = readme_sections(ROOT / sdk / "README.md")
    assert [s for s in SECTIONS if find(found, s) is None] == [], f"{sdk}/README.md lacks these sections"


@pytest.mark.parametrize("sdk", sorted(REFERENCES))
def test_api_reference_names_its_tool_and_page(sdk: str) -> None:
    found = readme_sections(ROOT / sdk / "README.md")
    heading = find(found, "api reference")
    assert heading is not None, f"{sdk}/README.md has no API reference section"
    tool, site = REFERENCES[sdk]
    body = found[heading]
    assert tool.lower() in body.lower(), f"{sdk}/README.md: its API reference section does not name {tool}"
    assert f"site/api/{site}/index.html" in body, (
        f"{sdk}/README.md: its API reference section does not say where ./dev docs puts it"
    )
