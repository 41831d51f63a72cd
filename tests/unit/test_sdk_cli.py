"""The CLI's ID|KEY arguments: ASCII decimal digits name an id, anything else a key."""

from __future__ import annotations

import pytest

from cronoq.cli import _ref


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("42", 42),
        ("042", 42),
        ("18446744073709551615", 2**64 - 1),
        ("invoice-42", "invoice-42"),
        ("", ""),
        ("-1", "-1"),
        ("²", "²"),  # str.isdigit() is True for it, but int() refuses it
        ("4²", "4²"),
        ("١٢", "١٢"),  # Arabic-Indic digits: int() accepts them, but they are a key here
        ("１２", "１２"),  # fullwidth digits
    ],
)
def test_ref_is_an_id_only_for_ascii_digits(text: str, ref: int | str) -> None:
    assert _ref(text, False) == ref and type(_ref(text, False)) is type(ref)


@pytest.mark.parametrize("text", ["42", "²", "x"])
def test_key_flag_always_names_a_key(text: str) -> None:
    assert _ref(text, True) == text


def test_an_id_past_64_bits_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="too large for a task id"):
        _ref("18446744073709551616", False)
