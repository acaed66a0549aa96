"""Fused MoE experts in Triton: two grouped GEMMs over expert-sorted row blocks (`moe_align`).

    gate_up kernel  rows of block b are pairs of expert e = block_expert[b]; gathers their tokens'
                    hidden rows, multiplies by w13[e]'s gate and up halves in one K loop, writes
                    silu(gate) * up to `inter[row]` (model dtype).
    down kernel     inter[rows] @ w2[e]^T, times the pair's routing weight, written to the pair's
                    row of `per_pair` [N*k, H]; rows of dropped pairs stay zero.
Then `out[t] = sum_j per_pair[t*k + j]` in fp32 (deterministic; no atomics).

No host synchronisation: grids are sized by `moe_align`'s host bound; idle blocks return early.
Up to `moe_align_small.MAX_PAIRS` pairs the sort is one Triton launch, beyond it three
(`moe_align_large`); the torch `moe_align.align_by_expert` is their oracle.
The oracle is `TorchMoEKernel` (`model/moe/experts.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import check_tensor
from deepseek_pd.model.kernels.moe_align import ExpertBlocks
from deepseek_pd.model.kernels.moe_align_large import align_by_expert_large
from deepseek_pd.model.kernels.moe_align_small import MAX_PAIRS, align_by_expert_small

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MoETile:
    """Tile sizes of both GEMMs; `block_m` is also the padding unit of `align_by_expert`."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def default_tile(num_pairs: int, num_experts: int) -> MoETile:
    """Few rows per expert (decode): thin row blocks, wide K steps; many rows (prefill): square tiles."""
    rows_per_expert = num_pairs / max(1, num_experts)
    if rows_per_expert <= 16:
        return MoETile(16, 64, 128, num_warps=4, num_stages=4)
    if rows_per_expert <= 128:
        return MoETile(32, 64, 64, num_warps=4, num_stages=4)
    if rows_per_expert <= 256:
        return MoETile(64, 128, 64, num_warps=8, num_stages=3)
    # H200, 2026-12-02 sweep (docs/performance.md): 128x128 tiles won at 574 and 1985 rows per expert.
    return MoETile(128, 128, 64, num_warps=8, num_stages=3)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, inter_ptr, pair_ptr, block_expert_ptr,
                    num_pairs, top_k, hidden, inter_size, num_experts,
                    stride_xm, stride_we, stride_wn, stride_wk, stride_im,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    row_ok = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    w_base = w13_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + inter_size) * stride_wn + ks[:, None] * stride_wk,
                       mask=w_mask, other=0.0)
        if IEEE:
            acc_gate += tl.dot(a, w_gate, input_precision="ieee")
            acc_up += tl.dot(a, w_up, input_precision="ieee")
        else:
            acc_gate += tl.dot(a, w_gate)
            acc_up += tl.dot(a, w_up)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :]
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(inter_ptr, w2_ptr, out_ptr, pair_ptr, block_expert_ptr, weight_ptr,
                 num_pairs, hidden, inter_size, num_experts,
                 stride_im, stride_we, stride_wn, stride_wk, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    row_ok = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w2_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter_size
        a = tl.load(inter_ptr + rows.to(tl.int64)[:, None] * stride_im + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    weight = tl.load(weight_ptr + pair, mask=row_ok, other=0.0)
    acc = acc * weight[:, None]
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# `--deterministic`: one tile whatever the batch (`default_tile` is keyed on rows per expert, and the
# tile sets the MMA shape and the K steps, i.e. the order each output sums its products in).
INVARIANT_TILE = MoETile(64, 64, 64, num_warps=4, num_stages=3)


def fused_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, tile: MoETile | None = None, invariant: bool = False) -> torch.Tensor:
    """`sum_j w_j * expert_{id_j}(x)` per token; ids outside [0, E) contribute nothing.

    `invariant`: `INVARIANT_TILE`, and each token's k expert outputs summed in slot order, one
    elementwise add after another (a reduction kernel's order may follow the batch's shape).

    hidden `[N, H]`, topk_ids `[N, k]` int, topk_weights `[N, k]`, w13 `[E, 2I, H]`, w2 `[E, H, I]`
    → `[N, H]` in hidden's dtype. fp32 inputs use exact fp32 products (no tf32).
    """
    device = hidden.device
    check_tensor("hidden", hidden, 2, _FLOAT_DTYPES, device)
    check_tensor("w13", w13, 3, (hidden.dtype,), device)
    check_tensor("w2", w2, 3, (hidden.dtype,), device)
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[N={hidden.shape[0]}, k]")
    if topk_ids.dtype.is_floating_point or topk_ids.device != device or topk_weights.device != device:
        raise ValueError("topk_ids must be an integer tensor on hidden's device, as must topk_weights be")
    num_experts, two_inter, hidden_size = w13.shape
    inter_size = two_inter // 2
    if two_inter % 2 or hidden.shape[1] != hidden_size or tuple(w2.shape) != (num_experts, hidden_size, inter_size):
        raise ValueError(f"shapes do not fit: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(num_tokens, hidden_size)
    hidden = hidden.contiguous()
    tile = tile or (INVARIANT_TILE if invariant else default_tile(num_pairs, num_experts))
    # One launch for decode-sized batches, three beyond (~30 torch ops in the oracle).
    align = align_by_expert_small if num_pairs <= MAX_PAIRS else align_by_expert_large
    blocks: ExpertBlocks = align(topk_ids, num_experts, tile.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    ieee = hidden.dtype == torch.float32
    inter = torch.empty(blocks.capacity, inter_size, dtype=hidden.dtype, device=device)
    grid = (blocks.num_blocks, triton.cdiv(inter_size, tile.block_n))
    _gate_up_kernel[grid](
        hidden, w13, inter, blocks.sorted_pair_ids, blocks.block_expert,
        num_pairs, top_k, hidden_size, inter_size, num_experts,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, IEEE=ieee,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    per_pair = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=device)
    grid = (blocks.num_blocks, triton.cdiv(hidden_size, tile.block_n))
    _down_kernel[grid](
        inter, w2, per_pair, blocks.sorted_pair_ids, blocks.block_expert, weights,
        num_pairs, hidden_size, inter_size, num_experts,
        inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), per_pair.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, IEEE=ieee,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    per_token = per_pair.view(num_tokens, top_k, hidden_size)
    if not invariant:
        return per_token.sum(dim=1, dtype=torch.float32).to(hidden.dtype)
    total = per_token[:, 0].float()
    for slot in range(1, top_k):
        total = total + per_token[:, slot].float()
    return total.to(hidden.dtype)
