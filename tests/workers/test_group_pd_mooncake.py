"""PD between a prefill group (dp 2, ep 2) and a decode group (dp 2, ep 2) over Mooncake (TCP).

Mooncake binds 0.0.0.0, so both groups run inside a private network namespace
(netns_group_pd_mooncake.py says what it checks): tokens equal the offline engine, each room's KV
goes from its prefill DP rank's engine to its decode DP rank's engine, every pool ends empty.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(330)]


def test_pd_between_dp_groups_over_mooncake_goes_rank_to_rank(tmp_path):
    out = run_in_netns(Path(__file__).with_name("netns_group_pd_mooncake.py"), str(random.randrange(1 << 30)),
                       str(tmp_path), timeout_s=300)
    for line in ("parity ok", "bytes per rank ok", "rank to rank ok", "group mooncake ok"):
        assert line in out, out
