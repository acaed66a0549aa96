"""Ragged (varlen) flash attention forward in Triton, returning the log-sum-exp: MHA prefill.

One launch for the whole batch, grid (sequence, query block, head). Sequence i's queries are
rows q_offsets[i]..q_offsets[i+1] of `q [T, H, Dqk]`; its keys/values rows kv_offsets[i]..
kv_offsets[i+1] of `k [S, H, Dqk]`, `v [S, H, Dv]`.
    causal=True   query j attends keys 0..j of its segment (q and kv segments are the same rows);
                  blocks left of the diagonal run unmasked, the diagonal block masked.
    causal=False  every query attends every key of its segment (the chunked-prefix MHA path).
The online softmax runs in base 2 (`scale * log2 e` folded in); `lse` is returned in natural log,
`-inf` (and output 0) for a query that saw no key. Head dims need not be powers of two: Dqk is
split into a power-of-two part and a masked remainder (192 = 128 + 64), Dv is padded and masked.

The two parts are read through two pointers each: MLA can hand its no-rope and rope parts as they
are (`q_rope`, `k_rope`; the key's rope part one row for all heads) instead of concatenating them
into new tensors every layer. Where the no-rope width is the power-of-two part (MLA's 128 of 192),
that is the same loads and dots, so the same bits, as the concatenated tensors.
The oracle is `TorchAttentionBackend.mha_causal` / `mha_cross`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import check_tensor, next_power_of_2

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class FlashTile:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


def default_tile(dtype: torch.dtype) -> FlashTile:
    """bf16/fp16: 128x64 (best of the 2026-12-02 H200 sweep, 64 KiB shared memory at qk 192).
    fp32 at qk 192 needs 288 KiB with that tile, over the 227 KiB limit: 64x32, 2 stages (96 KiB)."""
    return FlashTile(64, 32, num_warps=4, num_stages=2) if dtype == torch.float32 else FlashTile()


def split_head_dim(dim: int) -> tuple[int, int]:
    """(D1, D2): D1 a power of two >= 16 covering most of `dim`, D2 the padded rest (0 if none).

    Example: 192 → (128, 64); 128 → (128, 0); 20 → (16, 16); 4 → (16, 0).
    """
    d1 = max(16, 1 << (dim.bit_length() - 1))
    rest = dim - d1
    return d1, (max(16, next_power_of_2(rest)) if rest > 0 else 0)


@triton.jit
def _attend(acc, m, denom, q1, q2, k_base, k2_base, v_base, stride_k, stride_k2, stride_v, lo, hi, kv_len, q_idx,
            scale_log2, offs_d1, offs_d2, offs_dv, d1_ok, d2_ok, dv_ok,
            D1: tl.constexpr, HAS_D2: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
            IEEE: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        kn = n0 + tl.arange(0, BLOCK_N)
        k_ok = kn < kv_len
        k1 = tl.load(k_base + kn[None, :] * stride_k + offs_d1[:, None], mask=d1_ok[:, None] & k_ok[None, :],
                     other=0.0)
        if IEEE:
            s = tl.dot(q1, k1, input_precision="ieee")
        else:
            s = tl.dot(q1, k1)
        if HAS_D2:
            k2 = tl.load(k2_base + kn[None, :] * stride_k2 + offs_d2[:, None],
                         mask=d2_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                s += tl.dot(q2, k2, input_precision="ieee")
            else:
                s += tl.dot(q2, k2)
        s = s * scale_log2
        if CAUSAL_MASK:
            s = tl.where((q_idx[:, None] >= kn[None, :]) & k_ok[None, :], s, float("-inf"))
        else:
            s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep zeros, not NaN
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + kn[:, None] * stride_v + offs_dv[None, :], mask=k_ok[:, None] & dv_ok[None, :],
                    other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return acc, m, denom


@triton.jit
def _flash_kernel(q_ptr, q2_ptr, k_ptr, k2_ptr, v_ptr, o_ptr, lse_ptr, q_offsets_ptr, kv_offsets_ptr, scale_log2,
                  stride_qt, stride_qh, stride_q2t, stride_q2h, stride_kt, stride_kh, stride_k2t, stride_k2h,
                  stride_vt, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh, dim1, dim2, v_dim,
                  D1: tl.constexpr, D2: tl.constexpr, HAS_D2: tl.constexpr, DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(q_offsets_ptr + seq)
    q_len = tl.load(q_offsets_ptr + seq + 1) - q_start
    m_start = m_block * BLOCK_M
    if m_start >= q_len:
        return
    kv_start = tl.load(kv_offsets_ptr + seq)
    kv_len = tl.load(kv_offsets_ptr + seq + 1) - kv_start

    q_idx = m_start + tl.arange(0, BLOCK_M)
    q_ok = q_idx < q_len
    offs_d1 = tl.arange(0, D1)
    d1_ok = offs_d1 < dim1
    offs_d2 = tl.arange(0, D2)
    d2_ok = offs_d2 < dim2
    offs_dv = tl.arange(0, DV)
    dv_ok = offs_dv < v_dim
    q_rows = q_ptr + (q_start + q_idx).to(tl.int64)[:, None] * stride_qt + head * stride_qh
    q1 = tl.load(q_rows + offs_d1[None, :], mask=q_ok[:, None] & d1_ok[None, :], other=0.0)
    q2 = q1  # unused unless HAS_D2
    if HAS_D2:
        q2_rows = q2_ptr + (q_start + q_idx).to(tl.int64)[:, None] * stride_q2t + head * stride_q2h
        q2 = tl.load(q2_rows + offs_d2[None, :], mask=q_ok[:, None] & d2_ok[None, :], other=0.0)
    k_base = k_ptr + kv_start.to(tl.int64) * stride_kt + head * stride_kh
    k2_base = k2_ptr + kv_start.to(tl.int64) * stride_k2t + head * stride_k2h
    v_base = v_ptr + kv_start.to(tl.int64) * stride_vt + head * stride_vh

    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
    if CAUSAL:
        # Keys left of this query block are visible to all its rows; the diagonal block is masked.
        acc, m, denom = _attend(acc, m, denom, q1, q2, k_base, k2_base, v_base, stride_kt, stride_k2t, stride_vt, 0,
                                m_start, kv_len, q_idx, scale_log2, offs_d1, offs_d2, offs_dv, d1_ok, d2_ok, dv_ok,
                                D1, HAS_D2, BLOCK_N, False, IEEE)
        acc, m, denom = _attend(acc, m, denom, q1, q2, k_base, k2_base, v_base, stride_kt, stride_k2t, stride_vt,
                                m_start, tl.minimum(m_start + BLOCK_M, kv_len), kv_len, q_idx, scale_log2, offs_d1,
                                offs_d2, offs_dv, d1_ok, d2_ok, dv_ok, D1, HAS_D2, BLOCK_N, True, IEEE)
    else:
        acc, m, denom = _attend(acc, m, denom, q1, q2, k_base, k2_base, v_base, stride_kt, stride_k2t, stride_vt, 0,
                                kv_len, kv_len, q_idx, scale_log2, offs_d1, offs_d2, offs_dv, d1_ok, d2_ok, dv_ok,
                                D1, HAS_D2, BLOCK_N, False, IEEE)
    has_keys = denom > 0
    safe = tl.where(has_keys, denom, 1.0)
    out = acc / safe[:, None]
    lse = tl.where(has_keys, (m + tl.log2(safe)) * 0.6931471805599453, float("-inf"))
    rows = (q_start + q_idx).to(tl.int64)
    tl.store(o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_ok[:, None] & dv_ok[None, :])
    tl.store(lse_ptr + rows * stride_lt + head * stride_lh, lse, mask=q_ok)


def rope_split_fits(nope: int, rope: int) -> bool:
    """Whether queries and keys of `nope` + `rope` features can be handed as their two parts with
    the result of the concatenated ones: the no-rope part is exactly the power-of-two part
    (`split_head_dim`). MLA's 128 + 64 and the tiny models' 32 + 16 do."""
    return rope > 0 and split_head_dim(nope + rope)[0] == nope


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                    kv_offsets: torch.Tensor, max_q_len: int, scale: float, causal: bool,
                    tile: FlashTile | None = None, q_rope: torch.Tensor | None = None,
                    k_rope: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, H, Dqk]`, k `[S, H, Dqk]`, v `[S, H, Dv]`, offsets int32 `[B+1]` on the device (host
    maximum segment length `max_q_len`) → out `[T, H, Dv]` in q's dtype, lse fp32 `[T, H]`.
    With `causal`, q and kv segments must be the same rows (`kv_offsets` is `q_offsets`).

    With `q_rope` `[T, H, P]` and `k_rope` `[S, H, P]` or `[S, P]` (one row for all heads), q and k
    are the no-rope parts `[.., H, N]` only (`rope_split_fits(N, P)`): the result is that of
    `cat([q, q_rope], -1)` and `cat([k, k_rope expanded], -1)`, bit for bit, without the copies.
    """
    device = q.device
    check_tensor("q", q, 3, _FLOAT_DTYPES, device)
    check_tensor("k", k, 3, (q.dtype,), device)
    check_tensor("v", v, 3, (q.dtype,), device)
    check_tensor("q_offsets", q_offsets, 1, (torch.int32,), device)
    check_tensor("kv_offsets", kv_offsets, 1, (torch.int32,), device)
    tokens, heads, head_dim = q.shape
    if (q_rope is None) != (k_rope is None):
        raise ValueError("give both rope parts (q_rope and k_rope) or neither")
    if q_rope is not None:
        check_tensor("q_rope", q_rope, 3, (q.dtype,), device)
        check_tensor("k_rope", k_rope, k_rope.dim(), (q.dtype,), device)
        if k_rope.dim() == 2:
            k_rope = k_rope.unsqueeze(1).expand(-1, heads, -1)  # stride 0 over heads: no copy
        rope = q_rope.shape[-1]
        if q_rope.shape[:2] != q.shape[:2] or k_rope.shape != (k.shape[0], heads, rope) \
                or not rope_split_fits(head_dim, rope):
            raise ValueError(f"rope parts q {tuple(q_rope.shape)}, k {tuple(k_rope.shape)} do not fit no-rope "
                             f"parts q {tuple(q.shape)}, k {tuple(k.shape)} (the no-rope width must be the "
                             f"power-of-two part of the whole)")
    if k.shape[1:] != q.shape[1:] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if q_offsets.shape != kv_offsets.shape or q_offsets.numel() < 1:
        raise ValueError(f"q_offsets {tuple(q_offsets.shape)} and kv_offsets {tuple(kv_offsets.shape)} must be [B+1]")
    if causal and k.shape[0] != tokens:
        raise ValueError("causal attention needs one key per query row (the same segments)")
    v_dim = v.shape[-1]
    out = q.new_empty(tokens, heads, v_dim)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=device)
    batch = q_offsets.numel() - 1
    if tokens == 0 or batch == 0 or max_q_len <= 0:
        return out, lse
    if q_rope is None:  # the second part is the tail of each row
        d1, d2 = split_head_dim(head_dim)
        q2, k2, dim2 = q[..., d1:], k[..., d1:], head_dim - d1
    else:
        d1, d2 = split_head_dim(head_dim + q_rope.shape[-1])
        q2, k2, dim2 = q_rope, k_rope, q_rope.shape[-1]
    if d2 == 0:
        q2, k2 = q, k  # unread (HAS_D2 is off)
    tile = tile or default_tile(q.dtype)
    grid = (batch, triton.cdiv(max_q_len, tile.block_m), heads)
    _flash_kernel[grid](
        q, q2, k, k2, v, out, lse, q_offsets, kv_offsets, scale * _LOG2E,
        q.stride(0), q.stride(1), q2.stride(0), q2.stride(1), k.stride(0), k.stride(1), k2.stride(0), k2.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), min(d1, head_dim), dim2,
        v_dim,
        D1=d1, D2=max(d2, 16), HAS_D2=d2 > 0, DV=max(16, next_power_of_2(v_dim)), BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, CAUSAL=causal, IEEE=q.dtype == torch.float32, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    return out, lse
