"""What a stranger on the Mooncake ports can read over TCP (netns_mooncake_inflight_read.py, in a
private network namespace): decode's staging is not registered at all (pulled transfers, the
default), the prefill side's send-staging slots of a transfer in flight hold only ChaCha20
ciphertext of its KV (workers/transport/kv_cipher.py), and nothing once decode read them. Before the
KV was encrypted in the staging, the same read returned the KV itself (issue 20); before pulled
transfers, decode's staging slots were readable in flight."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_a_stranger_reads_no_kv_of_a_transfer_in_flight_and_nothing_after_it_landed():
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_inflight_read.py"), str(seed))
    print("seed", seed, out)
    assert "cannot: read the KV of a transfer in flight" in out and "cannot: read the slot" in out, out
    assert "cannot: read decode's staging" in out, out
    assert "read probes ok" in out, out
