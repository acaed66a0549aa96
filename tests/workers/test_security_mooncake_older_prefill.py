"""A prefill worker older than the KV cipher with a new decode worker over real Mooncake
(netns_mooncake_older_prefill.py, in a private network namespace): its KV is accepted in the clear,
with one warning for all its requests, and the tokens equal the oracle's (a rolling upgrade keeps
serving: workers/transport/kv_cipher.py `agreed`), with the decode worker in the write direction the
upgrade sets; a decode worker left at pulled transfers is refused at the handshake with a reason
that names that setting, and every pool ends empty."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_an_older_prefill_is_accepted_in_the_clear_with_one_warning():
    seed = random.randrange(1 << 30)
    out = run_in_netns(Path(__file__).with_name("netns_mooncake_older_prefill.py"), str(seed))
    print("seed", seed, out)
    assert "sent in the clear" in out and "accepted: 3 requests" in out and "warned once" in out, out
    assert "older prefill ok" in out and "refused by the older prefill, clearly" in out, out
