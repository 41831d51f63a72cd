"""Reading the repository's Markdown pages in tests: their code blocks and their sections."""

from __future__ import annotations

import re

# A fenced code block, from its opening ``` line to its closing one.
FENCE = re.compile(r"^```.*?^```$", flags=re.M | re.S)


def without_code(text: str) -> str:
    """The page with its code blocks left out (a `#` line in a shell block is no heading)."""
    return FENCE.sub("", text)


def sections(text: str) -> dict[str, str]:
    """The page's text under each `##` heading, by the heading; a `## ` line inside a code block
    is no heading, and the code blocks stay in the text."""
    masked = FENCE.sub(lambda block: re.sub(r"^## ", "   ", block.group(0), flags=re.M), text)
    parts = re.split(r"^## (.+)$", masked, flags=re.M)
    return {heading.strip(): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}
