"""The Mooncake staging as a window (netns_mooncake_staging_window.py, in a private network
namespace): more concurrent requests than the staging holds all complete with the oracle's tokens."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_more_concurrent_transfers_than_the_staging_holds_all_complete():
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_staging_window.py"), str(seed))
    print("seed", seed, out)
    assert "all equal the oracle's" in out and "staging window ok" in out, out


@pytest.mark.parametrize("shape", ["one", "burst", "queue"])
def test_prompts_longer_than_the_staging_are_served_in_windows(shape):
    """netns_mooncake_long_prompt.py: a prompt longer than the whole staging (before: refused with
    RESOURCE_EXHAUSTED), a burst of long and short ones, and (queue) a long prompt that waits for its
    window longer than `send_timeout_s` (before: RESOURCE_EXHAUSTED after it) all equal the oracle's."""
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_long_prompt.py"), str(seed), shape)
    print("seed", seed, out)
    assert "all equal the oracle's" in out and "long prompts ok" in out, out
