"""A compromised prefill that holds the secret harms only its own requests over Mooncake
(netns_mooncake_bad_peer.py, in a private network namespace): writes it started into its own
request's destination, their bodies sent once that request is over and another user's request is
decoding, change none of that request's tokens. Before the staging the destination was decode
pages that the next request got: its output changed, unnoticed. That part runs against a decode
worker in the write direction, as does the last probe, where the bad peer's writes into another
request's slots in flight fail that request by its MAC (a denial of another user's request).
With pulled transfers (the default) the same peer finds nothing writable on decode, and both that
request and the one decoding beside it equal the oracle; before pulled transfers this part failed
(the decode engine listed its staging and took the writes)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_a_bad_peers_late_writes_into_its_own_destination_reach_no_other_request():
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_bad_peer.py"), str(seed))
    print("seed", seed, out)
    assert "B served" in out and "bodies landed while D decoded" in out and "failed that request by its MAC" in out \
        and "bad-peer probe ok" in out, out
    assert "pulled: decode lists no registered buffer and refused writes" in out, out
    assert "pulled: A (in flight) and E (decoding) both equal the oracle" in out, out
