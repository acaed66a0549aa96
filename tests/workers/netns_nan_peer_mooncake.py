"""pdtest/nan_peer_attack.py over Mooncake TCP, run by test_security_nan_peer_mooncake.py inside a
private network namespace. Exits non-zero with the assertion on failure."""
from __future__ import annotations

import asyncio
import random
import sys

from pdtest.nan_peer_attack import attack
from pdtest.pd_engine_harness import worker_config

if __name__ == "__main__":
    asyncio.run(attack(random.Random(int(sys.argv[1])), "mooncake", worker_config))
    print("attack ok")
