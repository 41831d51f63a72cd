"""Request bodies of the HTTP API: JSON decoded without recursion limits to trip over, and
bytes fields checked as strict base64."""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from ..errors import invalid

MAX_JSON_DEPTH = 64  # arrays and objects nested deeper than this anywhere in a body are refused


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = [0] * 256
for _open, _close in (b"[]", b"{}"):
    _BRACKET_STEP[_open], _BRACKET_STEP[_close] = 1, -1


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in a UTF-8 JSON text, found without recursion or
    decoding (strings are skipped, so brackets inside them do not count)."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of the range of a double")
    return value


def decode_json(raw: bytes) -> Any:
    """The body's JSON; bodies nested too deeply, with NaN or Infinity, or not UTF-8 are INVALID_ARGUMENT."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise invalid(f"body: not valid UTF-8 JSON ({err})") from None
    # Fewer opening brackets than the limit cannot nest past it: most bodies skip the scan.
    depth = json_depth(raw) if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH else 0
    if depth > MAX_JSON_DEPTH:
        raise invalid(f"body: JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} levels are accepted")
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise invalid(f"body: JSON nested too deeply; at most {MAX_JSON_DEPTH} levels are accepted") from None
    except ValueError as err:
        raise invalid(f"body: not valid JSON ({err})") from None


_BASE64 = re.compile(r"[A-Za-z0-9+/_-]*={0,2}")


def check_base64(value: Any, field: str) -> None:
    """proto3 JSON bytes: standard or URL-safe base64, padded or not; anything else is refused
    (protobuf's own parser would drop the stray characters and store something else)."""
    if not isinstance(value, str):
        return  # ParseDict names the wrong type
    data = value.rstrip("=")
    if not _BASE64.fullmatch(value) or len(data) % 4 == 1 or (len(data) != len(value) and len(value) % 4):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise invalid(f"{field}: {shown!r} is not valid base64 (send bytes base64-encoded, or JSON as payload_json)")
