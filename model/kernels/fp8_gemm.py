"""Block-scaled FP8 GEMM in Triton: `out [M, N] = x [M, K] · W [N, K]^T`, both operands e4m3.

`x` is quantised per token group of `block_k` (`fp8_quant.per_token_group_quant`), `W` per
`(block_n, block_k)` block (DeepSeek-V3's checkpoint format, kept in FP8 on the GPU). The K loop
steps one scale group at a time, so each step is one fp8 tensor-core product rescaled in fp32:
    acc += dot(x_fp8[:, kb], W_fp8[:, kb]^T) * x_scale[:, kb, None] * w_scale[n // block_n, kb]
Rows of the M/N edge tiles wrap around (`% M`, `% N`) instead of being masked in the loop and are
dropped at the store; K's last group may be partial (masked to zero).

Tiles: a measured table first (`tile_table.py`, `tiles/fp8_gemm.json`: per GPU, shape and M), else
`default_tile`: decode-sized M streams the weight (16-row tiles, many N programs); larger M uses
the tiles measured fastest on the H200. Prefill-sized M goes to cuBLAS where it can
(`fp8_linear.TritonFp8Gemm`, `fp8_scaled_mm.py`).
The oracle is `model.fp8_ops.block_fp8_matmul_ref`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepseek_pd.model.quant.fp8_ops import FP8_DTYPE, num_groups
from deepseek_pd.model.kernels import tile_table
from deepseek_pd.model.kernels.checks import check_tensor

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Fp8GemmTile:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # programs along M that share a column of W tiles (L2 reuse)


def default_tile(m: int) -> Fp8GemmTile:
    """The fastest tile per M of `bench/fp8_gemm_tiles_gpu.py` on the H200 at V3's shapes: 64x64
    up to 256 rows (64x128 was 2x slower on q_a+kv_a at M = 128), 64x128 with 4 warps beyond
    (128x128 with 8 warps was 10-30% slower at M = 4096-8192 on every shape)."""
    if m <= 16:
        return Fp8GemmTile(16, 64, num_warps=4, num_stages=4)
    if m <= 256:
        return Fp8GemmTile(64, 64, num_warps=4, num_stages=4)
    return Fp8GemmTile(64, 128, num_warps=4, num_stages=4)


def measured_tile(device: torch.device, m: int, n: int, k: int) -> Fp8GemmTile | None:
    """The tile measured fastest for this GPU, shape and M (`tiles/fp8_gemm.json`), if any."""
    fields = tile_table.lookup("fp8_gemm", device, f"{n}x{k}", m)
    return None if fields is None else Fp8GemmTile(**fields)


@triton.jit(do_not_specialize=["M"])  # per-batch ints: kernels/__init__.py
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, group_n,
                     stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (offs_n // group_n).to(tl.int64) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb)
        b_s = tl.load(bs_ptrs + kb)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def check_block_scaled_weight(w: torch.Tensor, w_scale: torch.Tensor, block_n: int, block_k: int) -> None:
    """`w [..., N, K]` e4m3 with a unit last stride, `w_scale [..., ceil(N/block_n), ceil(K/block_k)]` fp32."""
    if w.dtype != FP8_DTYPE:
        raise ValueError(f"weight: dtype {w.dtype}, expected {FP8_DTYPE}")
    if w_scale.dtype != torch.float32 or w_scale.device != w.device:
        raise ValueError(f"weight scale: {w_scale.dtype} on {w_scale.device}, expected float32 on {w.device}")
    n, k = w.shape[-2:]
    want = tuple(w.shape[:-2]) + (num_groups(n, block_n), num_groups(k, block_k))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"weight scale shape {tuple(w_scale.shape)}, expected {want} for weight "
                         f"{tuple(w.shape)} in {block_n}x{block_k} blocks")
    if w.stride(-1) != 1 or w_scale.stride(-1) != 1:
        raise ValueError("weight and scale need a unit stride on their last axis")


def block_fp8_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     block_n: int, block_k: int, out_dtype: torch.dtype,
                     tile: Fp8GemmTile | None = None) -> torch.Tensor:
    """x_fp8 `[M, K]` with x_scale `[M, ceil(K/block_k)]` (fp32), w `[N, K]` with w_scale → `[M, N]`."""
    device = x_fp8.device
    check_tensor("x_fp8", x_fp8, 2, (FP8_DTYPE,), device)
    check_tensor("x_scale", x_scale, 2, (torch.float32,), device)
    check_tensor("w", w, 2, (FP8_DTYPE,), device)
    check_block_scaled_weight(w, w_scale, block_n, block_k)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} not in {_OUT_DTYPES}")
    m, k = x_fp8.shape
    n = w.shape[0]
    if w.shape[1] != k or tuple(x_scale.shape) != (m, num_groups(k, block_k)):
        raise ValueError(f"x {tuple(x_fp8.shape)} / x_scale {tuple(x_scale.shape)} do not fit w {tuple(w.shape)} "
                         f"with K groups of {block_k}")
    if block_k < 16 or block_k & (block_k - 1):
        # >= 32 on Hopper (its 8-bit MMA is 32 deep); the tiny test checkpoints' 16 only runs interpreted.
        raise ValueError(f"block_k must be a power of two >= 16 (one tensor-core K step), got {block_k}")
    out = torch.empty(m, n, dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    tile = tile or measured_tile(device, m, n, k) or default_tile(m)
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n),)
    _fp8_gemm_kernel[grid](x_fp8, w, out, x_scale, w_scale, m, n, k, block_n,
                           x_fp8.stride(0), w.stride(0), out.stride(0), x_scale.stride(0), w_scale.stride(0),
                           BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, GROUP_M=tile.group_m,
                           num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out
