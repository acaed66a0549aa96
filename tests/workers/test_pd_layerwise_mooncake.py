"""Layer-wise KV streaming over Mooncake (TCP, inside a private network namespace): decode's tokens
equal the offline engine's, with layer-wise sends on and off (netns_pd_mooncake_layerwise.py)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]


def test_layerwise_pd_over_mooncake_equals_offline():
    out = run_in_netns(Path(__file__).with_name("netns_pd_mooncake_layerwise.py"), str(random.randrange(1 << 30)))
    assert "layerwise=True parity ok" in out and "layerwise=False parity ok" in out, out
