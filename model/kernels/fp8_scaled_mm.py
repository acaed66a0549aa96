"""Block-scaled FP8 GEMM through torch's cuBLAS `scaled_mm` (1x128 activations, 128x128 weights).

The same product as `fp8_gemm.block_fp8_matmul` (`out [M, N] = x [M, K] · W [N, K]^T`, DeepSeek-V3's
checkpoint blocks), where this torch and GPU have cuBLAS's blockwise scaling (Hopper, CUDA 12.9+):
on the H200 it ran the V3 linear shapes at M = 4096-8192 at 1.34-1.74x bf16 `F.linear`, against
0.86-1.06x for the best Triton tile (docs/performance.md, `bench/fp8_gemm_tiles_gpu.py`); at M <= 128
Triton was as fast or faster (cuBLAS 0.2-1.4x bf16), so callers pick by M (`fp8_linear.py`).

cuBLAS's layout rules, checked or met here: the activation scales M-major (a transposed copy),
the weight passed as `W.t()` (column-major K x N), M padded to a multiple of 4 and the weight
scales' K blocks to a multiple of 4; K whole 128 blocks (N may end in a partial one).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepseek_pd.model.quant.fp8_ops import FP8_DTYPE

BLOCK = 128  # the only block size cuBLAS's blockwise recipes have


@functools.cache
def blockwise_scaled_mm_available(device_index: int = 0) -> bool:
    """Whether this torch has `F.scaled_mm` with blockwise recipes and the GPU is Hopper or newer."""
    if not torch.cuda.is_available() or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    if not hasattr(F.ScalingType, "BlockWise128x128"):
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def fits_blockwise(n: int, k: int, block_n: int, block_k: int) -> bool:
    """Whether a weight `[n, k]` in `(block_n, block_k)` blocks is one cuBLAS's 128x128 recipe takes
    (a partial last block of rows is fine, as V3's fused q_a + kv_a with 2112 rows; the output's
    rows must stay 16-byte aligned for cuBLAS)."""
    return block_n == BLOCK and block_k == BLOCK and k % BLOCK == 0 and n % 16 == 0


def scaled_mm_block_fp8(x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """x_fp8 `[M, K]` with x_scale `[M, K/128]` (fp32), w `[N, K]` with w_scale `[ceil(N/128), K/128]` → `[M, N]`."""
    m, k = x_fp8.shape
    n = w.shape[0]
    if x_fp8.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise ValueError(f"operands must be {FP8_DTYPE}, got {x_fp8.dtype} and {w.dtype}")
    if not fits_blockwise(n, k, BLOCK, BLOCK) or tuple(w_scale.shape) != (-(-n // BLOCK), k // BLOCK) \
            or tuple(x_scale.shape) != (m, k // BLOCK) or w.shape[1] != k:
        raise ValueError(f"x {tuple(x_fp8.shape)}, x_scale {tuple(x_scale.shape)}, w {tuple(w.shape)}, "
                         f"w_scale {tuple(w_scale.shape)} are not whole 128x128 blocks of one product")
    pad_m = -m % 4
    if pad_m:
        x_fp8 = torch.cat([x_fp8, x_fp8.new_zeros(pad_m, k)])
        x_scale = torch.cat([x_scale, x_scale.new_ones(pad_m, x_scale.shape[1])])
    kb = w_scale.shape[1]
    if kb % 4:
        w_scale = F.pad(w_scale, (0, -kb % 4))
    out = F.scaled_mm(x_fp8, w.t(), x_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                      w_scale.t(), F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return out[:m] if pad_m else out
