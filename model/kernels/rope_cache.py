"""RoPE of q_pe and k_pe fused with the latent-cache write, one Triton launch per layer.

One program per new token t at position p: `freq_j = p * inv_freq[j]`, cos/sin in fp32 times the
YaRN attention factor; pairs `(x1_j, x2_j)` are `(x[2j], x[2j+1])` (interleaved, DeepSeek's
default) or `(x[j], x[j + d/2])`; the rotated vector is written de-interleaved,
`[x1 cos - x2 sin | x2 cos + x1 sin]`, as `model/rope.py` does. Outputs: q_pe for every head,
k_pe, and the cache row `cache[out_slots[t]] = [c_kv | k_pe]` in the cache's dtype; torch's version
of the same takes ~20 launches (cos/sin, slices, products, cat, index_put).
With a norm weight (`norm_rope_and_cache_write`, issue 21: one launch less per layer) the latent
`c_kv` is first RMS-normalised as `kernels/rmsnorm.py` does it (its `inverse_rms` and `normalise`,
the same bits), written to the cache and returned; the kv_a norm then needs no launch of its own.
The oracle is `RotaryEmbedding.forward` plus the indexed cache write (after `rms_norm_ref`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import check_tensor, next_power_of_2
from deepseek_pd.model.kernels.rmsnorm import inverse_rms, normalise

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rotate(x_base, half_offs, half_ok, stride_pair, second, cos, sin, out_base, out_ptr_dtype_ref,
            HALF: tl.constexpr):
    x1 = tl.load(x_base + half_offs * stride_pair, mask=half_ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + half_offs * stride_pair + second, mask=half_ok, other=0.0).to(tl.float32)
    dtype = out_ptr_dtype_ref.dtype.element_ty
    tl.store(out_base + half_offs, (x1 * cos - x2 * sin).to(dtype), mask=half_ok)
    tl.store(out_base + HALF + half_offs, (x2 * cos + x1 * sin).to(dtype), mask=half_ok)


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, c_ptr, pos_ptr, inv_freq_ptr, slot_ptr, q_out_ptr, k_out_ptr, cache_ptr,
                       norm_w_ptr, c_out_ptr, heads, rank, attention_factor, eps,
                       stride_qt, stride_qh, stride_kt, stride_ct, stride_qot, stride_qoh, stride_kot, stride_cache,
                       stride_cot, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_R: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freq = pos * tl.load(inv_freq_ptr + j, mask=j_ok, other=0.0)
    cos = tl.cos(freq) * attention_factor
    sin = tl.sin(freq) * attention_factor
    stride_pair = 2 if INTERLEAVED else 1  # element step between pairs (static: INTERLEAVED is constexpr)
    second = 1 if INTERLEAVED else HALF  # offset of a pair's second element
    h = tl.arange(0, BLOCK_H)
    ok = (h < heads)[:, None] & j_ok[None, :]
    q_rows = q_ptr + t * stride_qt + h[:, None] * stride_qh + j[None, :] * stride_pair
    x1 = tl.load(q_rows, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(q_rows + second, mask=ok, other=0.0).to(tl.float32)
    q_out = q_out_ptr + t * stride_qot + h[:, None] * stride_qoh + j[None, :]
    tl.store(q_out, (x1 * cos[None, :] - x2 * sin[None, :]).to(q_out_ptr.dtype.element_ty), mask=ok)
    tl.store(q_out + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(q_out_ptr.dtype.element_ty), mask=ok)
    _rotate(k_ptr + t * stride_kt, j, j_ok, stride_pair, second, cos, sin, k_out_ptr + t * stride_kot, k_out_ptr,
            HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = cache_ptr + slot * stride_cache
    _rotate(k_ptr + t * stride_kt, j, j_ok, stride_pair, second, cos, sin, row + rank, cache_ptr, HALF)
    r = tl.arange(0, BLOCK_R)
    if NORM:  # the whole row in one block (the wrapper checks rank <= BLOCK_R)
        r_ok = r < rank
        c = tl.load(c_ptr + t * stride_ct + r, mask=r_ok, other=0.0)
        w = tl.load(norm_w_ptr + r, mask=r_ok, other=0.0)
        normed = normalise(c, inverse_rms(c, rank, eps), w, c_out_ptr.dtype.element_ty)
        tl.store(c_out_ptr + t * stride_cot + r, normed, mask=r_ok)
        tl.store(row + r, normed.to(cache_ptr.dtype.element_ty), mask=r_ok)
    else:
        for r0 in range(0, rank, BLOCK_R):
            # Not `ok`: Triton's compiler types a name once per loop, and `ok` above is 2-D.
            r_ok = r0 + r < rank
            c = tl.load(c_ptr + t * stride_ct + r0 + r, mask=r_ok, other=0.0)
            tl.store(row + r0 + r, c.to(cache_ptr.dtype.element_ty), mask=r_ok)


MAX_NORM_RANK = 1024  # the fused norm holds a latent row in one block


def rope_and_cache_write(q_pe: torch.Tensor, k_pe: torch.Tensor, c_kv: torch.Tensor, positions: torch.Tensor,
                         inv_freq: torch.Tensor, attention_factor: float, interleaved: bool, cache: torch.Tensor,
                         out_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q_pe `[T, H, d]`, k_pe `[T, d]`, c_kv `[T, R]` (unit last strides), positions / out_slots `[T]`,
    inv_freq fp32 `[d/2]`, cache `[S, R + d]` → roped (q_pe `[T, H, d]`, k_pe `[T, d]`), cache rows written."""
    q_out, k_out, _ = _launch(q_pe, k_pe, c_kv, positions, inv_freq, attention_factor, interleaved, cache,
                              out_slots, None, 0.0)
    return q_out, k_out


def norm_rope_and_cache_write(q_pe: torch.Tensor, k_pe: torch.Tensor, c_kv: torch.Tensor, norm_weight: torch.Tensor,
                              eps: float, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
                              interleaved: bool, cache: torch.Tensor,
                              out_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope_and_cache_write` of the RMS-normalised latent (`norm_weight` `[R]`, R <= 1024): → (roped
    q_pe, roped k_pe, normalised c_kv `[T, R]`), the cache rows holding the normalised latent."""
    check_tensor("norm_weight", norm_weight, 1, _FLOAT_DTYPES, q_pe.device)
    if norm_weight.shape[0] != c_kv.shape[-1] or c_kv.shape[-1] > MAX_NORM_RANK:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} must be [R] for c_kv {tuple(c_kv.shape)}, "
                         f"R <= {MAX_NORM_RANK}")
    return _launch(q_pe, k_pe, c_kv, positions, inv_freq, attention_factor, interleaved, cache, out_slots,
                   norm_weight, eps)


def _launch(q_pe, k_pe, c_kv, positions, inv_freq, attention_factor, interleaved, cache, out_slots, norm_weight,
            eps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    device = q_pe.device
    check_tensor("q_pe", q_pe, 3, _FLOAT_DTYPES, device)
    check_tensor("k_pe", k_pe, 2, (q_pe.dtype,), device)
    check_tensor("c_kv", c_kv, 2, _FLOAT_DTYPES, device)
    check_tensor("cache", cache, 2, _FLOAT_DTYPES, device)
    check_tensor("inv_freq", inv_freq, 1, (torch.float32,), device)
    tokens, heads, dim = q_pe.shape
    rank = c_kv.shape[1]
    if (dim % 2 or k_pe.shape != (tokens, dim) or c_kv.shape[0] != tokens or cache.shape[1] != rank + dim
            or inv_freq.shape[0] != dim // 2 or positions.shape != (tokens,) or out_slots.shape != (tokens,)):
        raise ValueError(f"shapes do not fit: q_pe {tuple(q_pe.shape)}, k_pe {tuple(k_pe.shape)}, c_kv "
                         f"{tuple(c_kv.shape)}, cache {tuple(cache.shape)}, inv_freq {tuple(inv_freq.shape)}")
    q_out = torch.empty(tokens, heads, dim, dtype=q_pe.dtype, device=device)
    k_out = torch.empty(tokens, dim, dtype=k_pe.dtype, device=device)
    norm = norm_weight is not None
    c_out = (torch.empty(tokens, rank, dtype=torch.promote_types(norm_weight.dtype, c_kv.dtype), device=device)
             if norm else None)
    if tokens == 0:
        return q_out, k_out, c_out
    half = dim // 2
    _rope_cache_kernel[(tokens,)](
        q_pe, k_pe, c_kv, positions, inv_freq, out_slots, q_out, k_out, cache,
        norm_weight if norm else inv_freq, c_out if norm else k_out, heads, rank, attention_factor, eps,
        q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), c_kv.stride(0), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), cache.stride(0), c_out.stride(0) if norm else 0, HALF=half,
        BLOCK_HALF=max(16, next_power_of_2(half)), BLOCK_H=max(2, next_power_of_2(heads)),
        BLOCK_R=min(MAX_NORM_RANK, max(16, next_power_of_2(rank))), INTERLEAVED=interleaved, NORM=norm, num_warps=4)
    return q_out, k_out, c_out
