"""A stranger's slow-body Mooncake write after the transfer's checks (netns_mooncake_slow_body.py, in
a private network namespace): Mooncake checks a write's range when its header arrives, so the body
can land after the KV MAC and the finite check passed. It must not change one output token: the
decode side receives into staging slots and copies them into the request's private pages before
the checks (workers/transport/staging.py). Before the staging the NaN body landed in the request's
own pages and the output changed. Against a decode worker in the write direction
(`mooncake_kv_direction=write`): with pulled transfers, the default, decode registers nothing a
body could land in (test_security_mooncake_bad_peer.py)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_a_write_body_that_lands_after_the_checks_changes_no_output_token():
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_slow_body.py"), str(seed))
    print("seed", seed, out)
    assert "header accepted" in out and "landed after the checks" in out and "slow-body probe ok" in out, out
