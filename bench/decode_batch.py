"""A decode batch over a one-layer KV pool with random contents, for the attention benches
(kernels_gpu.py, mla_decode_gpu.py, norm_route_parts.py): each sequence's pages are scattered over
the pool in a random order, as a served pool's are after requests come and go, so a kernel is timed
on gathered pages rather than one contiguous run."""
from __future__ import annotations

import torch


def random_decode_batch(lengths: list[int], page_size: int, kv_dim: int, *, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cuda"):
    """(ForwardBatch of one decode token per sequence of `lengths` tokens, the pool's one layer of KV
    `[pages, page_size, kv_dim]` filled from a standard normal); torch's global generator draws both."""
    from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
    from deepseek_pd.model.kv.pool import KVPool

    need = [-(-n // page_size) for n in lengths]
    pool = KVPool(1, sum(need) + 8, page_size, kv_dim, dtype=dtype, device=device)
    order = torch.randperm(pool.num_pages).tolist()
    pages, start = [], 0
    for n in need:
        pages.append(order[start:start + n])
        start += n
    pool.buffers[0].normal_()
    batch = ForwardBatch.build(ForwardMode.DECODE, [[0]] * len(lengths), [n - 1 for n in lengths], pages, pool,
                               vocab_size=1, device=device)
    return batch, pool.buffers[0]
