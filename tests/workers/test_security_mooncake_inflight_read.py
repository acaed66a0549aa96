"""What a stranger on the Mooncake ports can read over TCP (netns_mooncake_inflight_read.py, in a
private network namespace): the KV of a transfer in flight, from decode's registered staging slots,
and nothing once the transfer landed. Not a fix: it pins what docs/operations.md §8 and the engine's
exposure warning say is open (they said only RDMA could read in flight)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_a_stranger_reads_the_kv_of_a_transfer_in_flight_and_nothing_after_it_landed():
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_inflight_read.py"), str(seed))
    print("seed", seed, out)
    assert "can (still open): read the KV of a transfer in flight" in out and "cannot: read the slot" in out, out
    assert "read probes ok" in out, out
