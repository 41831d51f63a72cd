"""docs/cli.md shows every command of the `cronoq` CLI (read from its parser), so a new command
cannot ship without a line there (test_sdk_readme checks that each line parses)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from cronoq.cli import build_parser

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def commands(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [prefix + name, *commands(sub, f"{prefix}{name} ")]
    return found


def test_every_command_has_a_line_on_the_page() -> None:
    text = PAGE.read_text()
    assert len(commands(build_parser())) > 15
    assert [c for c in commands(build_parser()) if not re.search(rf"^cronoq {c}(\s|$)", text, flags=re.M)] == []
