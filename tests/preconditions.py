"""A test whose precondition is missing: a skip on a developer's machine, a failure in CI
(CI=true), where every precondition is installed and a skip would hide a test."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (required in CI)")
    pytest.skip(reason)
