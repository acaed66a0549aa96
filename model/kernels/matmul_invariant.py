"""Batch-invariant GEMM in Triton: `[B, M, K] x [B, K, N] -> [B, M, N]` with one tile for every M.

cuBLAS (and a tile table keyed on M) choose tile, MMA shape and split-K by the number of rows, so an
output element's K products are summed in an order that depends on how many rows came with it.
Here the tile (`INVARIANT_TILE`) is a constant and K is walked in BLOCK_K steps from 0 to K by the
one program that owns the output tile: element (b, i, j) is reduced in the same order whatever M is
and wherever row i sits in its tile (rows never share an accumulator). fp32 inputs use exact fp32
products (no tf32). Accumulation is fp32; the output has the inputs' dtype.

The oracle is `torch.bmm` (values); the invariance itself is what tests/model/test_batch_invariant.py
checks, bit for bit, under TRITON_INTERPRET=1 on CPU and on the GPU (bench/batch_invariant_gpu.py
measures its cost against cuBLAS).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepseek_pd import env

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class InvariantTile:
    """The one tile; changing it changes every deterministic output (not their invariance)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


INVARIANT_TILE = InvariantTile()


@triton.jit(do_not_specialize=["M"])  # per-batch ints: kernels/__init__.py
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                   stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                   stride_cb, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    a_base = a_ptr + batch * stride_ab + rows.to(tl.int64)[:, None] * stride_am
    b_base = b_ptr + batch * stride_bb + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        # Masked lanes load 0: a padded row or column adds exact zeros to nobody else's sum.
        a = tl.load(a_base + ks[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + ks[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    c = c_ptr + batch * stride_cb + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def matmul_invariant(a: torch.Tensor, b: torch.Tensor, tile: InvariantTile = INVARIANT_TILE) -> torch.Tensor:
    """a `[B, M, K]`, b `[B, K, N]` (any strides; same dtype and device) -> `[B, M, N]` in a's dtype."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"matmul_invariant: shapes do not fit: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.dtype not in _FLOAT_DTYPES or b.dtype != a.dtype:
        raise ValueError(f"matmul_invariant: dtypes {a.dtype}, {b.dtype} (both one of {_FLOAT_DTYPES})")
    if b.device != a.device:
        raise ValueError(f"matmul_invariant: b on {b.device}, a on {a.device}")
    if a.device.type != "cuda" and not env.triton_interpret():
        raise ValueError(f"matmul_invariant: Triton needs CUDA tensors (or TRITON_INTERPRET=1), got {a.device}")
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty(batch, m, n, dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n), batch)
    _matmul_kernel[grid](
        a, b, c, m, n, k,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, IEEE=a.dtype == torch.float32,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return c
