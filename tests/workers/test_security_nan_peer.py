"""A compromised prefill that holds the secret spoils only its own requests (pdtest/nan_peer_attack.py):
its all-NaN KV, held unchecked in the decode pool's first pages while unrelated requests of
different lengths decode, changes none of their tokens, and its own request fails clearly.

Over the gRPC byte stream, and with same-host direct writes (the prefill copies into the decode
pool itself, one process here). Before the fix (padding with page 0, masks that multiply) the
shorter honest requests decoded runs of token 0. The Mooncake run is
test_security_nan_peer_mooncake.py (network namespace).
"""
from __future__ import annotations

import asyncio
import functools
import random

import pytest

from pdtest.nan_peer_attack import attack
from pdtest.pd_engine_harness import worker_config

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("direct", ["off", "on"])
def test_a_prefill_sending_nan_kv_harms_only_its_own_request_over_grpc(direct):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    asyncio.run(attack(random.Random(seed), "grpc", functools.partial(worker_config, same_host_direct=direct)))
