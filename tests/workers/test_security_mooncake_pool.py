"""A stranger on the Mooncake ports (no secret) against PD workers over Mooncake TCP, in a private
network namespace (netns_mooncake_pool_attack.py): it can no longer read or write the prefill pool,
the idle decode pool or a decoding request's pages, nor (pulled transfers, the default) anything of
decode's while a transfer runs; it can still write the prefill side's send-staging slots of a
transfer in flight (Mooncake authenticates no peer; docs/operations.md §8), but that changes no
output token: the KV MAC (kv_transfer/kv_mac.py) refuses the request it hit, a denial of that
transfer only.

Before the per-transfer registration every probe succeeded: the whole of both pools was registered
for the workers' lifetime. Before the KV MAC, finite garbage written into a transfer in flight was
decoded from, unnoticed."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_a_stranger_reaches_only_the_pages_of_a_transfer_in_flight():
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_pool_attack.py"), str(seed))
    print("seed", seed, out)
    assert out.count("cannot:") == 4 and "can (still open)" in out and "attack probes ok" in out, out


def test_a_stranger_writing_into_a_staging_window_fails_only_that_request_by_its_mac():
    """netns_mooncake_window_attack.py: a prompt longer than the staging moves in windows; garbage a
    stranger writes into a window before decode copies it out fails that request by its KV MAC, and a
    request beside it is unharmed."""
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_window_attack.py"), str(seed))
    print("seed", seed, out)
    assert "refused by the KV MAC" in out and "window attack ok" in out, out
