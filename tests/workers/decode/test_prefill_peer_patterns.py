"""`*` in a --prefill-peers host stands for one group index: digits only, matched as text."""
from __future__ import annotations

import asyncio
import random
import socket

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.workers.decode.prefill_peers import PrefillPeers, parse_peer
from deepseek_pd.workers.engine.request_failure import TransferError


def _allowed(peers: PrefillPeers, host: str, port: int) -> bool:
    try:
        asyncio.run(peers.check(host, port))
        return True
    except TransferError:
        return False


def test_star_matches_any_group_index_and_nothing_else(monkeypatch):
    def no_dns(*args, **kwargs):
        raise AssertionError("a pattern entry must not be resolved")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    port = random.randint(1024, 65000)
    peers = PrefillPeers((f"d-prefill-*-0.d-prefill-*.ns.svc:{port}",))
    for _ in range(50):
        index = random.randint(0, 10**6)
        assert _allowed(peers, f"d-prefill-{index}-0.d-prefill-{index}.ns.svc", port)
        assert _allowed(peers, f"D-PREFILL-{index}-0.d-prefill-{index}.NS.svc", port)  # DNS is case-blind
        assert not _allowed(peers, f"d-prefill-{index}-0.d-prefill-{index}.ns.svc", port + 1)
    for host in ("d-prefill--0.d-prefill-1.ns.svc", "d-prefill-a-0.d-prefill-1.ns.svc",
                 "d-prefill-1.x-0.d-prefill-1.ns.svc", "d-prefill-1-0.d-prefill-1.ns.svc.attacker.io",
                 "xd-prefill-1-0.d-prefill-1.ns.svc", "d-prefill-1-1.d-prefill-1.ns.svc", "127.0.0.1"):
        assert not _allowed(peers, host, port), host


def test_a_pattern_still_needs_a_port():
    with pytest.raises(UserError):
        parse_peer("d-prefill-*-0.d-prefill-*.ns.svc")
