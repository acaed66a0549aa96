"""Mooncake transport (TCP) in a private network namespace: exact copies, dead peer."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_mooncake_copies_scattered_pages_and_fails_fast_on_a_dead_peer():
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_transfer.py"), str(random.randrange(1 << 30)))
    assert out.count("copy ok") == 3 and "dead peer ok" in out, out
