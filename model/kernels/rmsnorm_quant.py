"""RMSNorm (optionally after the residual add) and per-token-group FP8 quantisation in one launch,
for the FP8 block-scaled linears that follow a norm (`quant/norm_fp8_linear.py`).

One program per row. The row is read twice: once whole, for its sum of squares exactly as
`kernels/rmsnorm.py` computes it (the same load, the same reduction), then again as `[groups,
group]` tiles from the cache, normalised element by element with the same roundings (to the input
dtype, times the weight, to the output dtype) and quantised by `fp8_quant.quantise_groups`. So the
result is `per_token_group_quant(rms_norm(x, ...)[0], group)` without writing the normed row to
memory and reading it back, and without the second launch.

    x_fp8, x_scale, new_residual = rms_norm_quant(x, weight, eps, 128, residual)

The oracle: `norm_rope.rms_norm_ref` then `fp8_ops.per_token_group_quant_ref`; and bit for bit the
two Triton kernels it fuses (tests/model/kernels/test_rmsnorm_quant.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import next_power_of_2
from deepseek_pd.model.kernels.fp8_quant import quantise_groups
from deepseek_pd.model.kernels.rmsnorm import checked_residual_out, inverse_rms, load_row, normalise
from deepseek_pd.model.quant.fp8_ops import EPS, FP8_DTYPE, FP8_MAX, num_groups

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _rmsnorm_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, dim, groups, eps, q_eps, fp8_max,
                          stride_x, stride_r, stride_q, stride_s, stride_ro,
                          HAS_RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                          GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, GROUPS_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # 1 / rms: kernels/rmsnorm.py's load and reduction, so the same bits.
    cols = tl.arange(0, BLOCK)
    x = load_row(x_ptr, r_ptr, res_out_ptr, row, cols, cols < dim, stride_x, stride_r, stride_ro, HAS_RESIDUAL, True)
    rstd = inverse_rms(x, dim, eps)
    # The row again, as [groups, group] tiles (from the cache): normalised as there, then quantised.
    grps = tl.arange(0, GROUPS_BLOCK)
    inner = tl.arange(0, GROUP_BLOCK)
    tile = grps[:, None] * GROUP + inner[None, :]
    in_row = (inner[None, :] < GROUP) & (tile < dim)
    xt = load_row(x_ptr, r_ptr, res_out_ptr, row, tile, in_row, stride_x, stride_r, stride_ro, HAS_RESIDUAL, False)
    w = tl.load(w_ptr + tile, mask=in_row, other=0.0)
    y = normalise(xt, rstd, w, OUT_DTYPE).to(tl.float32)
    q, scale = quantise_groups(y, q_eps, fp8_max)
    tl.store(q_ptr + row * stride_q + tile, q.to(q_ptr.dtype.element_ty), mask=in_row)
    tl.store(s_ptr + row * stride_s + grps, scale, mask=grps < groups)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                   residual: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x `[T, D]` (unit last stride, any row stride), weight `[D]` → (x_fp8 `[T, D]` e4m3, x_scale
    fp32 `[T, ceil(D/group)]`, the new residual `x + residual` or None).

    `out`: the (x_fp8, x_scale) to write, any row strides (e.g. both parts of one packed buffer that
    a collective then moves whole). The normed row before quantisation is in `promote(weight, x)`'s
    dtype, as `rms_norm` returns it."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    res_out = checked_residual_out(x, weight, residual)
    tokens, dim = x.shape
    groups = num_groups(dim, group)
    q, scale = out if out is not None else (torch.empty(tokens, dim, dtype=FP8_DTYPE, device=x.device),
                                            torch.empty(tokens, groups, dtype=torch.float32, device=x.device))
    _check_out(q, scale, tokens, dim, groups, x.device)
    if tokens == 0 or dim == 0:
        return q, scale, res_out
    block = max(16, next_power_of_2(dim))
    _rmsnorm_quant_kernel[(tokens,)](
        x, residual if residual is not None else x, weight, q, scale, res_out if res_out is not None else x,
        dim, groups, eps, EPS, FP8_MAX, x.stride(0), residual.stride(0) if residual is not None else 0, q.stride(0),
        scale.stride(0), res_out.stride(0) if res_out is not None else 0, HAS_RESIDUAL=residual is not None,
        OUT_DTYPE=_TL_DTYPES[torch.promote_types(weight.dtype, x.dtype)], BLOCK=block, GROUP=group,
        GROUP_BLOCK=max(16, next_power_of_2(group)), GROUPS_BLOCK=next_power_of_2(groups),
        num_warps=4 if block <= 2048 else 8)  # kernels/rmsnorm.py's, so its reduction
    return q, scale, res_out


def _check_out(q: torch.Tensor, scale: torch.Tensor, tokens: int, dim: int, groups: int, device: torch.device) -> None:
    if q.shape != (tokens, dim) or q.dtype != FP8_DTYPE or scale.shape != (tokens, groups) \
            or scale.dtype != torch.float32:
        raise ValueError(f"out must be e4m3 [{tokens}, {dim}] and fp32 [{tokens}, {groups}], got "
                         f"{q.dtype} {tuple(q.shape)} and {scale.dtype} {tuple(scale.shape)}")
    if q.stride(-1) != 1 or scale.stride(-1) != 1 or q.device != device or scale.device != device:
        raise ValueError("out needs a unit last stride, on x's device")
