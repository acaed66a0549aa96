"""Fixtures for the operator tests: one emulated cluster with a running kopf operator per module."""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # kopf_emulator, operator_harness

from operator_harness import OperatorHarness  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    with OperatorHarness(resync_seconds=0.5) as harness:
        yield harness
