"""PD engines over Mooncake (TCP) inside a private network namespace: parity with the offline engine."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]


def test_pd_over_mooncake_equals_offline_and_frees_pages_on_abort():
    out = run_in_netns(Path(__file__).with_name("netns_pd_mooncake.py"), str(random.randrange(1 << 30)))
    assert out.count("parity ok") == 4 and "abort ok" in out and "early abort ok" in out, out
