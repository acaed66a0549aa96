"""Absorbed-MLA decode in Triton: one new token per sequence, all sequences in one launch.

Stage 1, grid (batch, head blocks x value splits, splits): split s of sequence b covers an equal share of its
`seq_len` cache positions (rounded to BLOCK_N); the program walks them in BLOCK_N steps, looking
each position's page up in `page_table[b]`, and keeps an online softmax over
    score = (q_latent · c_kv + q_pe · k_pe) * scale
with the latent `c_kv` as the value. It writes its partial output and log-sum-exp (natural log;
-inf for an empty split). Stage 2, grid (batch, heads): merges the splits by log-sum-exp.

The split count is chosen on the host from the batch size and the longest sequence (host-known
lengths, no sync): enough programs to fill the GPU, never more splits than BLOCK_N steps. Under a
CUDA graph the host length is the captured max context, but each split's share follows the real
`seq_len` on the device: the splits past it are empty, write only their lse, and the combine reads
no partial of them, so the bytes moved follow the real context (one program launch per empty split).
The oracle is `TorchAttentionBackend.mla_decode`.
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
class MLADecodeTile:
    block_h: int = 16  # heads per program; tl.dot needs >= 16 rows
    block_n: int = 32  # cache positions per step
    max_splits: int = 64
    target_programs: int = 528  # ~4 per SM on an H200 (132 SMs); best of the 2026-12-02 sweep
    num_warps: int = 4
    num_stages: int = 2
    # Programs per head block that each accumulate 1/value_splits of the latent output (all compute
    # the full scores): smaller accumulators, so more heads per program fit in registers.
    value_splits: int = 1
    # > 0 (`--deterministic`): every split covers exactly this many positions of its own sequence, so
    # a sequence's splits, and the order its combine merges them in, follow its length alone (not
    # the batch size); a multiple of block_n. 0: the split count is chosen to fill the GPU.
    split_len: int = 0

    def __post_init__(self) -> None:
        if self.split_len < 0 or self.split_len % self.block_n:
            raise ValueError(f"split_len {self.split_len} must be a non-negative multiple of block_n {self.block_n}")


# The batch-invariant decode: FlashInfer's `fixed_split_size` idea, splits of 256 positions (short
# contexts lose occupancy at batch 1-8; bench/batch_invariant_gpu.py measures it).
INVARIANT_DECODE_TILE = MLADecodeTile(split_len=256, max_splits=1 << 30)


def num_splits(batch_size: int, head_blocks: int, max_seq_len: int, tile: MLADecodeTile) -> int:
    if tile.split_len:  # the longest sequence's; a shorter one's extra splits are empty (lse -inf, weight 0)
        return -(-max_seq_len // tile.split_len)
    wanted = -(-tile.target_programs // max(1, batch_size * head_blocks))
    return max(1, min(wanted, tile.max_splits, -(-max_seq_len // tile.block_n)))


# Per-batch ints (kernels/__init__.py): the split count, the page table's width, the lse strides (splits).
@triton.jit(do_not_specialize=["num_splits", "stride_tb", "stride_lb", "stride_lh"])
def _split_kernel(q_ptr, qpe_ptr, kv_ptr, table_ptr, seq_lens_ptr, mid_out_ptr, mid_lse_ptr,
                  num_heads, page_size, num_splits, scale_log2,
                  stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_tb,
                  stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                  RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, V_SPLITS: tl.constexpr,
                  IEEE: tl.constexpr, SPLIT_LEN: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1) // V_SPLITS
    v_lo = (tl.program_id(1) % V_SPLITS) * BLOCK_V
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if SPLIT_LEN > 0:
        share = SPLIT_LEN
    else:
        share = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * share
    end = tl.minimum(start + share, seq_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < ROPE
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_r[None, :],
                mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(qpe_ptr + b * stride_pb + heads[:, None] * stride_ph + offs_p[None, :],
                   mask=h_ok[:, None] & p_ok[None, :], other=0.0)

    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_H,), dtype=tl.float32)
    offs_v = v_lo + tl.arange(0, BLOCK_V)
    v_ok = offs_v < RANK
    acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        page = tl.load(table_ptr + b * stride_tb + pos // page_size, mask=pos_ok, other=0)
        slot = page.to(tl.int64) * page_size + pos % page_size
        row = kv_ptr + slot * stride_kv
        c_kv = tl.load(row[:, None] + offs_r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(row[:, None] + RANK + offs_p[None, :], mask=pos_ok[:, None] & p_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(c_kv), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(c_kv))
            s += tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(pos_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        if V_SPLITS == 1:
            values = c_kv
        else:  # this program's slice of the latent (an L1/L2 hit: the full rows were just read)
            values = tl.load(row[:, None] + offs_v[None, :], mask=pos_ok[:, None] & v_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
        m = m_new

    has_keys = denom > 0
    out = acc / tl.where(has_keys, denom, 1.0)[:, None]
    lse = tl.where(has_keys, (m + tl.log2(tl.where(has_keys, denom, 1.0))) * 0.6931471805599453, float("-inf"))
    # An empty split (past its sequence's end: a graph's split count is fixed for the captured
    # max context) writes its -inf lse alone; the combine reads no partial of it.
    tl.store(mid_out_ptr + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_v[None, :],
             out, mask=h_ok[:, None] & v_ok[None, :] & (start < end))
    tl.store(mid_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_ok & (v_lo == 0))


@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])  # per-batch: kernels/__init__.py
def _combine_kernel(mid_out_ptr, mid_lse_ptr, out_ptr, num_splits,
                    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < num_splits
    lse = tl.load(mid_lse_ptr + b * stride_lb + h * stride_lh + splits, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)  # finite: split 0 of a sequence with >= 1 key is never empty
    w = tl.exp(lse - top)
    w = w / tl.sum(w, axis=0)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    has_part = s_ok & (lse > float("-inf"))  # empty splits wrote no partial (weight 0 anyway)
    parts = tl.load(mid_out_ptr + b * stride_mb + h * stride_mh + splits[:, None] * stride_ms + offs_r[None, :],
                    mask=has_part[:, None] & r_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r, out.to(out_ptr.dtype.element_ty), mask=r_ok)


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, scale: float,
               tile: MLADecodeTile = MLADecodeTile()) -> torch.Tensor:
    """q_latent `[B, H, R]`, q_pe `[B, H, P]`, kv_cache `[num_pages, page_size, R+P]`,
    page_table int32 `[B, max_pages]`, seq_lens int32 `[B]` (each >= 1, <= max_seq_len, the host
    copy of its maximum) → latent output `[B, H, R]` in q's dtype.
    """
    device = q_latent.device
    check_tensor("q_latent", q_latent, 3, _FLOAT_DTYPES, device)
    check_tensor("q_pe", q_pe, 3, (q_latent.dtype,), device)
    check_tensor("kv_cache", kv_cache, 3, (q_latent.dtype,), device)
    check_tensor("page_table", page_table, 2, (torch.int32,), device)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), device)
    batch, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    num_pages, page_size, kv_dim = kv_cache.shape
    if tuple(q_pe.shape[:2]) != (batch, heads) or kv_dim != rank + rope:
        raise ValueError(f"q_latent {tuple(q_latent.shape)}, q_pe {tuple(q_pe.shape)} and kv_cache "
                         f"{tuple(kv_cache.shape)} do not fit (cache rows must be rank + rope)")
    if page_table.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} need {batch} rows")
    if max_seq_len < 1 or max_seq_len > page_table.shape[1] * page_size:
        raise ValueError(f"max_seq_len {max_seq_len} outside 1..{page_table.shape[1] * page_size} (page table width)")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (slots are addressed as page * page_size + offset)")
    out = q_latent.new_empty(batch, heads, rank)
    if batch == 0:
        return out
    head_blocks = triton.cdiv(heads, tile.block_h)
    splits = num_splits(batch, head_blocks * tile.value_splits, max_seq_len, tile)
    mid_out = torch.empty(batch, heads, splits, rank, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=device)
    block_r, block_p = max(16, next_power_of_2(rank)), max(16, next_power_of_2(rope))
    block_v = block_r // tile.value_splits
    if block_v < 16 or block_r % tile.value_splits:
        raise ValueError(f"value_splits {tile.value_splits} must split the padded rank {block_r} into >= 16 columns")
    _split_kernel[(batch, head_blocks * tile.value_splits, splits)](
        q_latent, q_pe, kv_cache, page_table, seq_lens, mid_out, mid_lse,
        heads, page_size, splits, scale * _LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), kv_dim, page_table.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        RANK=rank, ROPE=rope, BLOCK_R=block_r, BLOCK_P=block_p, BLOCK_H=tile.block_h, BLOCK_N=tile.block_n,
        BLOCK_V=block_v, V_SPLITS=tile.value_splits, IEEE=q_latent.dtype == torch.float32,
        SPLIT_LEN=tile.split_len, num_warps=tile.num_warps, num_stages=tile.num_stages)
    _combine_kernel[(batch, heads)](
        mid_out, mid_lse, out, splits,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        RANK=rank, BLOCK_R=next_power_of_2(rank), BLOCK_S=max(2, next_power_of_2(splits)), num_warps=4)
    return out
