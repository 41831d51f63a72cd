"""docs/configuration.md documents every key of the config file: each field of each section's
model (cronoq_server.config) is named under that section's heading, in a table's `key` (or
`section.key`) or as `key = ...` in its example (or its comments)."""

from __future__ import annotations

import re
from pathlib import Path

from md_pages import sections
from pydantic import BaseModel

from cronoq_server import config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def models() -> dict[str, type[BaseModel]]:
    """Each section of the file (a [table] or [[array]] of Config) with its model."""
    found: dict[str, type[BaseModel]] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            kind = field.annotation
            inner = [a for a in getattr(kind, "__args__", (kind,)) if isinstance(a, type)]
            for sub in inner:
                if issubclass(sub, BaseModel):
                    found[f"{prefix}{name}"] = sub
                    walk(sub, f"{prefix}{name}.")

    walk(config.Config, "")
    return found


def test_every_key_of_every_section_has_its_row() -> None:
    pages = sections(PAGE.read_text())
    missing = []
    for section, model in models().items():
        heading = next((h for h in pages if re.search(rf"`\[+{re.escape(section)}\]+`", h)), None)
        if heading is None:
            missing.append(f"[{section}]: no heading")
            continue
        for name, field in model.model_fields.items():
            key = field.alias or name
            if not re.search(rf"`(?:[\w.]+\.)?{key}`|\b{key} = ", pages[heading]):
                missing.append(f"[{section}] {key}")
    assert len(models()) >= 8
    assert missing == []
