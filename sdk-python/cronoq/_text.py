"""What the server refuses in caller-chosen text, checked before a call (or an outbox insert)."""

from __future__ import annotations

# Besides C0, DEL and C1: line separators and bidi controls (they break a line where a reader
# sees none, or reorder the text).
LINE_AND_BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)


def control_character(text: str) -> str | None:
    """The first character of text the server refuses as a control character, or None."""
    return next((c for c in text if ord(c) < 32 or 127 <= ord(c) < 160 or c in LINE_AND_BIDI_CONTROLS), None)
