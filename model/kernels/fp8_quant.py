"""Per-token-group FP8 quantisation of activations in Triton (1×group, e4m3, dynamic scales).

One program per row and `GROUPS_PER_PROGRAM` groups; per group `scale = max(|x|) / 448` (floored at `EPS / 448`), `x / scale`
clamped to ±448 and rounded to e4m3. Output scales are fp32 `[M, ceil(K/group)]`, row-major.

The rounding to e4m3's 3 mantissa bits is done explicitly in fp32 (exponent from the bits, one
`floor(v + 0.5)` at that step), so the final conversion is exact. Triton's CPU interpreter (3.7)
rounds values just below a power of two down to half of it when the mantissa carries; with
explicit rounding the interpreter and the GPU give the same bytes. Ties round up rather than to
even (torch's `.to(float8)`), one step apart on exact ties only.
The oracle is `model.fp8_ops.per_token_group_quant_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepseek_pd.model.quant.fp8_ops import EPS, FP8_DTYPE, FP8_MAX, num_groups
from deepseek_pd.model.kernels.checks import check_tensor, next_power_of_2

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Groups per program: one (row, group) per program left each program a single warp's 256 bytes
# of bf16, ~4x its bytes' time at 4096 x 16384 on the H200 (docs/performance.md, 2026-12-03).
GROUPS_PER_PROGRAM = 8


@triton.jit
def quantise_groups(x, eps, fp8_max):
    """fp32 `[groups, group]` (masked elements 0) → (values on e4m3's grid, fp32, and the per-group
    scales `[groups]`); the one rule both this file's kernel and `kernels/rmsnorm_quant.py` run."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / fp8_max
    q = tl.clamp(x / scale[:, None], -fp8_max, fp8_max)
    # e4m3 step at q: 2^(exponent - 3), with exponent floored at -6 (subnormals step 2^-9).
    exponent = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return tl.floor(q / step + 0.5) * step, scale


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, k, num_groups, stride_xm, stride_qm, stride_sm, eps, fp8_max,
                  GROUP: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    grps = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    inner = tl.arange(0, BLOCK)
    cols = grps[:, None] * GROUP + inner[None, :]
    ok = (inner[None, :] < GROUP) & (cols < k) & (grps[:, None] < num_groups)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    q, scale = quantise_groups(x, eps, fp8_max)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + grps, scale, mask=grps < num_groups)


def per_token_group_quant(x: torch.Tensor, group: int,
                          groups_per_program: int = GROUPS_PER_PROGRAM) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` bf16/fp16/fp32 with a unit last stride → (x_fp8 `[M, K]`, x_scale fp32 `[M, ceil(K/group)]`).

    `groups_per_program` (a power of two) changes the launch only, never a byte of the result."""
    check_tensor("x", x, 2, _FLOAT_DTYPES, x.device)
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if groups_per_program < 1 or groups_per_program & (groups_per_program - 1):
        raise ValueError(f"groups_per_program must be a power of two, got {groups_per_program}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    groups = num_groups(k, group)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    per_program = min(groups_per_program, next_power_of_2(groups))
    block = max(16, next_power_of_2(group))
    grid = (m, triton.cdiv(groups, per_program))
    _quant_kernel[grid](x, q, scale, k, groups, x.stride(0), q.stride(0), scale.stride(0), EPS, FP8_MAX,
                        GROUP=group, BLOCK=block, GROUPS=per_program,
                        num_warps=max(1, min(8, per_program * block // 256)))
    return q, scale
