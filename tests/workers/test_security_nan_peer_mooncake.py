"""The NaN-sending prefill of pdtest/nan_peer_attack.py over real Mooncake TCP writes (one-sided,
straight into the decode pool), in a private network namespace: only its own request fails."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_a_prefill_sending_nan_kv_harms_only_its_own_request_over_mooncake():
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_nan_peer_mooncake.py"), str(seed))
    print("seed", seed, out)
    assert "attack ok" in out and "harmed 0 of" in out, out
