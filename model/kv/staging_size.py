"""How much memory a KV staging area takes: the one rule for its size. Torch-free.

A staging area (workers/transport/staging.py) is pages of every KV layer, in buffers of their own
beside the pool: Mooncake's writers reach only it on decode, and over RDMA the prefill side's NIC
reads only it. Its pages are the same shape as the pool's, so it takes

    staging_pages(tokens, page_size) x page_size tokens of latent KV (model/config.py latent_kv_bytes)

The worker keeps that much of its memory budget out of the KV pool (`RunnerConfig.mem_reserve_bytes`,
set by `serve` from workers/serve/kv_staging.py, which says which roles allocate one), and the
operator's memory plan (operator/memory_plan.py) counts it, both through `staging_bytes`.

Worked example, V2-Lite in bf16 (27 layers x 576 x 2 B per token) with the default 16,384 tokens:
1,024 pages of 16 tokens = 486 MiB; V3 with its MTP layer (62 layers, KV in bf16) 1.09 GiB.
"""
from __future__ import annotations

from deepseek_pd.model.config import latent_kv_bytes

# The default staging size, in tokens of KV (`--engine-opt mooncake_staging_tokens`).
DEFAULT_STAGING_TOKENS = 16384


def staging_pages(tokens: int, page_size: int) -> int:
    """Whole pages that hold `tokens` tokens."""
    if tokens < 1 or page_size < 1:
        raise ValueError(f"a staging area holds >= 1 token in pages of >= 1, got {tokens}, {page_size}")
    return -(-tokens // page_size)


def staging_bytes(tokens: int, page_size: int, num_layers: int, kv_dim: int, itemsize: int) -> int:
    """Bytes of a staging area of `tokens` tokens (whole pages) of `num_layers` layers of `kv_dim`
    values of `itemsize` bytes."""
    return latent_kv_bytes(num_layers, kv_dim, itemsize, tokens=staging_pages(tokens, page_size) * page_size)
