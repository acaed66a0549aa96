"""Polling with a deadline, for tests that wait on a real server or process."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

import pytest

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, why: Callable[[], str] = lambda: "") -> T:
    """`predicate()`'s first truthy value, polled every 0.25 s; fails the test naming `what` (and
    `why()`, e.g. the last state seen) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"{what} within {timeout_s:.0f}s {why()}".rstrip())
