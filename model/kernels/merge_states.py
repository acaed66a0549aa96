"""Exact merge of two partial attentions over disjoint key sets, in one Triton launch.

For each (token, head): `lse = logaddexp(lse_a, lse_b)`, `out = e^(lse_a-lse) out_a + e^(lse_b-lse) out_b`
(a side that saw no key has lse -inf and weight 0; both empty gives out 0, lse -inf). This is the
MHA_CHUNKED_KV step after each prefix chunk; the oracle is `TorchAttentionBackend.merge_states`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import check_tensor, next_power_of_2

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _merge_kernel(oa_ptr, la_ptr, ob_ptr, lb_ptr, o_ptr, l_ptr, heads, dim,
                  s_oat, s_oah, s_obt, s_obh, s_ot, s_oh, s_lat, s_lbt, s_lt,
                  BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    la = tl.load(la_ptr + tok * s_lat + head)
    lb = tl.load(lb_ptr + tok * s_lbt + head)
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    safe = tl.where(total > 0, total, 1.0)
    lse = tl.where(total > 0, m_safe + tl.log(safe), float("-inf"))
    d = tl.arange(0, BLOCK_D)
    ok = d < dim
    oa = tl.load(oa_ptr + tok * s_oat + head * s_oah + d, mask=ok, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + tok * s_obt + head * s_obh + d, mask=ok, other=0.0).to(tl.float32)
    # Select a side that saw no keys (weight 0) away: 0 * a NaN it may hold would still be NaN.
    out = (tl.where(wa > 0, wa * oa, 0.0) + tl.where(wb > 0, wb * ob, 0.0)) / safe
    tl.store(o_ptr + tok * s_ot + head * s_oh + d, out.to(o_ptr.dtype.element_ty), mask=ok)
    tl.store(l_ptr + tok * s_lt + head, lse)


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out `[T, H, D]` (any float dtype, both the same), lse fp32 `[T, H]` → merged (out, lse)."""
    device = out_a.device
    check_tensor("out_a", out_a, 3, _FLOAT_DTYPES, device)
    check_tensor("out_b", out_b, 3, (out_a.dtype,), device)
    check_tensor("lse_a", lse_a, 2, (torch.float32,), device)
    check_tensor("lse_b", lse_b, 2, (torch.float32,), device)
    if out_a.shape != out_b.shape or lse_a.shape != out_a.shape[:2] or lse_b.shape != lse_a.shape:
        raise ValueError(f"shapes do not fit: out {tuple(out_a.shape)}/{tuple(out_b.shape)}, "
                         f"lse {tuple(lse_a.shape)}/{tuple(lse_b.shape)}")
    tokens, heads, dim = out_a.shape
    out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    if tokens == 0 or heads == 0:
        return out, lse
    _merge_kernel[(tokens, heads)](
        out_a, lse_a, out_b, lse_b, out, lse, heads, dim,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_b.stride(0), lse.stride(0), BLOCK_D=max(16, next_power_of_2(dim)), num_warps=1)
    return out, lse
