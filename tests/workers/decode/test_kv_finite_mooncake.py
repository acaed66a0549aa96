"""A NaN or infinity written by Mooncake (TCP, in a private network namespace) is refused by the
decode side's finite check wherever it is; a clean transfer is taken bit-exact
(netns_kv_finite_mooncake.py)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_a_non_finite_value_over_mooncake_is_refused_and_a_clean_transfer_is_exact():
    out = run_in_netns(Path(__file__).with_name("netns_kv_finite_mooncake.py"), str(random.randrange(1 << 30)))
    assert out.count("clean ok") == 1 and out.count("refused ok") == 3, out
