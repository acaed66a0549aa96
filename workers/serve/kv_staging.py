"""Which workers allocate a Mooncake staging area, and the memory it keeps out of their KV pool:
the one rule `serve` (resolution.py -> `RunnerConfig.mem_reserve_bytes`) and the operator's memory
plan (operator/memory_plan.py) both apply. Torch-free.

Where one is allocated (workers/transport/mooncake.py):
- a decode worker over Mooncake, any protocol: writers reach only its staging (`MooncakeReceiver`);
- a prefill worker over Mooncake, any protocol: each send is gathered into a send staging of the
  same size and encrypted there (`MooncakeSender`, transport/kv_cipher.py); over RDMA it is also
  what the NIC reads (registered), over TCP it is never registered;
- nowhere over gRPC.
Its size is model/kv/staging_size.py's rule, for `--engine-opt mooncake_staging_tokens`.
"""
from __future__ import annotations

from deepseek_pd.model.kv.staging_size import staging_bytes


def allocates_staging(kv_transport: str) -> bool:
    """Whether a worker with this KV transport allocates a staging area: every role, every Mooncake
    protocol (above)."""
    return kv_transport == "mooncake"


def staging_reserve_bytes(kv_transport: str, staging_tokens: int, page_size: int, num_layers: int, kv_dim: int,
                          itemsize: int) -> int:
    """The bytes a worker keeps out of its KV pool for its staging area (0 where it has none)."""
    if not allocates_staging(kv_transport):
        return 0
    return staging_bytes(staging_tokens, page_size, num_layers, kv_dim, itemsize)
