"""Mooncake transport (TCP) in a private network namespace: exact copies, dead peer."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_mooncake_copies_scattered_pages_and_fails_fast_on_a_dead_peer():
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_transfer.py"), str(random.randrange(1 << 30)))
    copies = [line.split()[3] for line in out.splitlines() if line.startswith("copy ok")]
    assert copies == ["pull", "pull", "write"], out
    assert "dead peer ok" in out and "dead source ok" in out, out


def test_engine_ports_lie_where_the_project_keeps_them_and_listen_on_every_address():
    """netns_mooncake_ports.py, against the real engine: its ports lie in env.mooncake_rpc_ports()
    under the MC_MIN/MAX_RPC_PORT setting drawn (both ends included; a range Mooncake refuses means
    its default), and it listens on the wildcard whatever it is given (docs/operations.md §8)."""
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_ports.py"), str(random.randrange(1 << 30)))
    assert out.count("ports ok (") == 2 and out.count("wildcard as documented") == 2 and "engine ports ok" in out, out
