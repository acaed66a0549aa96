"""RMSNorm, optionally fused with the residual add, in one Triton launch (one program per row).

Exactly HF DeepSeek's rounding: `residual = x + residual` rounded to the input dtype; normalise
in fp32; round to the input dtype; multiply by the weight and round once more (as torch's
`weight * normed` in bf16 does). The oracle is `model.norm.rms_norm_ref` / `add_rms_norm_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import check_tensor, next_power_of_2

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def load_row(x_ptr, r_ptr, res_out_ptr, row, cols, ok, stride_x, stride_r, stride_ro, HAS_RESIDUAL: tl.constexpr,
             STORE_RESIDUAL: tl.constexpr):
    """Row `row`'s elements at `cols` (any shape), with the residual added in fp32 and rounded to
    the input dtype (stored to `res_out_ptr` with STORE_RESIDUAL)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    return x


@triton.jit
def inverse_rms(x, dim, eps):
    """1 / rms of a whole row `[BLOCK]` in fp32 (this reduction, so `rmsnorm_quant` gets the same bits)."""
    xf = x.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)


@triton.jit
def normalise(x, rstd, w, OUT_DTYPE: tl.constexpr):
    """HF's roundings: x * rstd to x's dtype, times the weight, to the output dtype."""
    return (w.to(tl.float32) * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, dim, eps, stride_x, stride_r, stride_o, stride_ro,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = load_row(x_ptr, r_ptr, res_out_ptr, row, cols, ok, stride_x, stride_r, stride_ro, HAS_RESIDUAL, True)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, normalise(x, inverse_rms(x, dim, eps), w, out_ptr.dtype.element_ty),
             mask=ok)


def checked_residual_out(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """Checks a norm's inputs (x `[T, D]` with a unit last stride, weight `[D]`, residual like x or
    None); the new residual's buffer when there is one."""
    device = x.device
    check_tensor("x", x, 2, _FLOAT_DTYPES, device)
    check_tensor("weight", weight, 1, _FLOAT_DTYPES, device)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}")
    if residual is None:
        return None
    check_tensor("residual", residual, 2, (x.dtype,), device)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not fit x {tuple(x.shape)}")
    return torch.empty(x.shape, dtype=x.dtype, device=device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x `[T, D]` (unit last stride, any row stride), weight `[D]` → (normed `[T, D]`, new residual or None).

    With `residual`, the new residual `x + residual` is returned and normalised (HF's add-then-norm).
    """
    res_out = checked_residual_out(x, weight, residual)
    tokens, dim = x.shape
    out = torch.empty(tokens, dim, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if tokens == 0:
        return out, res_out
    block = max(16, next_power_of_2(dim))
    _rmsnorm_kernel[(tokens,)](
        x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out, dim, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=4 if block <= 2048 else 8)
    return out, res_out
