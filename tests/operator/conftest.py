"""Fixtures for the operator tests: one emulated cluster with a running kopf operator per module."""
from __future__ import annotations

import pytest

# pytest puts this (package-less) folder on sys.path when it imports this conftest, so the
# operator tests' own helpers (operator_harness, kopf_emulator, leader_urls) import by name.
from operator_harness import OperatorHarness


@pytest.fixture(scope="module")
def cluster():
    with OperatorHarness(resync_seconds=0.5) as harness:
        yield harness
