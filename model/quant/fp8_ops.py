"""Block-scaled FP8 arithmetic in plain torch: the reference the Triton kernels are tested against.

Weights are DeepSeek-V3's format (`fp8.py`): `W [N, K]` float8_e4m3fn with `scale_inv` per
`(block_n, block_k)` block. Activations are quantised at run time per token and group of
`block_k` consecutive features (1×128 for V3, as DeepSeek/SGLang do): for each group,
`scale = max(|x|) / 448` (never below `EPS / 448`) and `x_fp8 = x / scale` rounded to e4m3.
A block-scaled GEMM then computes, for every K block `b`,
    out[m, n] += (x_fp8[m, b] · W_fp8[n, b]) * x_scale[m, b] * w_scale[n // block_n, b].
Here that is done by dequantising both operands to fp32 and multiplying in fp32, which is the
same sum in another order: kernels agree with it to fp32 rounding (the fp8 products are exact).

Example: x `[3, 300]`, group 128 → x_fp8 `[3, 300]`, x_scale `[3, 3]` (groups of 128, 128, 44).
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
EPS = 1e-10  # amax floor: an all-zero group gets a tiny, finite scale (SGLang uses the same)


def num_groups(size: int, group: int) -> int:
    return -(-size // group)


def expand_blocks(scale: torch.Tensor, block: int, size: int, dim: int) -> torch.Tensor:
    """Repeats each entry of `scale` along `dim` `block` times and crops to `size` (partial last block)."""
    return scale.repeat_interleave(block, dim=dim).narrow(dim, 0, size)


def per_token_group_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` (any float dtype) → (x_fp8 `[M, K]`, x_scale fp32 `[M, ceil(K/group)]`)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    groups = num_groups(k, group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    blocks = padded.view(m, groups, group)
    scale = blocks.abs().amax(dim=-1).clamp_min(EPS) / FP8_MAX
    quantised = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return quantised.to(FP8_DTYPE), scale


def dequant_activation(x_fp8: torch.Tensor, x_scale: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 value of a per-token-group quantised activation."""
    return x_fp8.float() * expand_blocks(x_scale, group, x_fp8.shape[-1], dim=-1)


def dequant_weight(w_fp8: torch.Tensor, w_scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """fp32 value of a block-scaled weight `[..., N, K]` (leading dims: stacked experts)."""
    n, k = w_fp8.shape[-2:]
    scale = expand_blocks(expand_blocks(w_scale.float(), block_n, n, dim=-2), block_k, k, dim=-1)
    return w_fp8.float() * scale


def block_fp8_matmul_ref(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                         block_n: int, block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """`[M, K] x [N, K]^T → [M, N]` in fp32 from dequantised operands, cast to `out_dtype` once."""
    a = dequant_activation(x_fp8, x_scale, block_k)
    return (a @ dequant_weight(w_fp8, w_scale, block_n, block_k).T).to(out_dtype)


def fp8_linear_ref(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                   block_k: int) -> torch.Tensor:
    """What an FP8 linear layer computes: quantise `x [M, K]` per token group, then the block GEMM."""
    x_fp8, x_scale = per_token_group_quant_ref(x, block_k)
    return block_fp8_matmul_ref(x_fp8, x_scale, w_fp8, w_scale, block_n, block_k, x.dtype)
