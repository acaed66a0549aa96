"""Fused MoE experts in Triton: two grouped GEMMs over expert-sorted row blocks (`moe_align`),
with the experts in the model dtype or in block-scaled FP8 (the quantisation method, `scales`).

    gate_up kernel  rows of block b are pairs of expert e = block_expert[b]; gathers their tokens'
                    hidden rows, multiplies by w13[e]'s gate and up halves in one K loop, writes
                    silu(gate) * up to `inter[row]` (model dtype).
    down kernel     inter[rows] @ w2[e]^T, times the pair's routing weight, written to the pair's
                    row of `per_pair` [N*k, H]; rows of dropped pairs stay zero.
Then `out[t] = sum_j per_pair[t*k + j]` in fp32 (deterministic; no atomics).

No host synchronisation: grids are sized by `moe_align`'s host bound; idle blocks return early.
Up to `moe_align_small.MAX_PAIRS` pairs the sort is one Triton launch, beyond it three
(`moe_align_large`); the torch `moe_align.align_by_expert` is their oracle.
FP8 (W8A8, DeepSeek-V3's blocks): both GEMMs read e4m3 operands; `hidden` is quantised per
token group once (group = w13's K block) and gathered by pair, `inter` per row group (w2's K
block); each K step is one scale group, `acc += dot(a, w) * a_scale[:, None] * w_scale[None, :]`.
Decode then reads the experts' FP8 bytes only (half of bf16).
The oracle is `TorchMoEKernel` (`model/moe/experts.py`), for both methods.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels import tile_table
from deepseek_pd.model.kernels.checks import check_tensor
from deepseek_pd.model.kernels.fp8_gemm import check_block_scaled_weight
from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
from deepseek_pd.model.kernels.moe_align import ExpertBlocks
from deepseek_pd.model.kernels.moe_align_large import align_by_expert_large
from deepseek_pd.model.kernels.moe_align_small import MAX_PAIRS, align_by_expert_small
from deepseek_pd.model.quant.fp8_ops import FP8_DTYPE
from deepseek_pd.model.quant.moe_scales import Fp8ExpertScales

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


def measured_tile(device: torch.device, num_pairs: int, num_experts: int, inter_size: int, hidden_size: int,
                  fp8: bool) -> MoETile | None:
    """The tile measured fastest for this GPU, expert shape and pair count (`tiles/fused_moe.json`)."""
    shape = f"E{num_experts}xN{inter_size}xK{hidden_size}-{'fp8' if fp8 else 'bf16'}"
    fields = tile_table.lookup("fused_moe", device, shape, num_pairs)
    return None if fields is None else MoETile(**fields)


@triton.jit(do_not_specialize=["num_pairs"])  # per-batch ints: kernels/__init__.py
def _gate_up_kernel(x_ptr, xs_ptr, w13_ptr, ws_ptr, inter_ptr, pair_ptr, block_expert_ptr,
                    num_pairs, top_k, hidden, inter_size, num_experts, group_n,
                    stride_xm, stride_xsm, stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_im,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr, FP8: tl.constexpr):
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
    if FP8:
        s_gate = ws_ptr + expert * stride_wse + (cols // group_n).to(tl.int64) * stride_wsn
        s_up = ws_ptr + expert * stride_wse + ((cols + inter_size) // group_n).to(tl.int64) * stride_wsn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + inter_size) * stride_wn + ks[:, None] * stride_wk,
                       mask=w_mask, other=0.0)
        if FP8:  # one K step is one scale group of both operands
            a_s = tl.load(xs_ptr + token * stride_xsm + kb, mask=row_ok, other=0.0)
            g_s = tl.load(s_gate + kb, mask=col_ok, other=0.0)
            u_s = tl.load(s_up + kb, mask=col_ok, other=0.0)
            acc_gate += tl.dot(a, w_gate) * a_s[:, None] * g_s[None, :]
            acc_up += tl.dot(a, w_up) * a_s[:, None] * u_s[None, :]
        elif IEEE:
            acc_gate += tl.dot(a, w_gate, input_precision="ieee")
            acc_up += tl.dot(a, w_up, input_precision="ieee")
        else:
            acc_gate += tl.dot(a, w_gate)
            acc_up += tl.dot(a, w_up)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :]
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # per-batch ints: kernels/__init__.py
def _down_kernel(a_ptr, as_ptr, w2_ptr, ws_ptr, out_ptr, pair_ptr, block_expert_ptr, weight_ptr,
                 num_pairs, hidden, inter_size, num_experts, group_n,
                 stride_am, stride_asm, stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, FP8: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    row_ok = pair < num_pairs
    rows64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w2_ptr + expert * stride_we
    if FP8:
        s_base = ws_ptr + expert * stride_wse + (cols // group_n).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter_size, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < inter_size
        a = tl.load(a_ptr + rows64[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8:
            a_s = tl.load(as_ptr + rows64 * stride_asm + kb, mask=row_ok, other=0.0)
            w_s = tl.load(s_base + kb, mask=col_ok, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        elif IEEE:
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


@dataclass(frozen=True)
class _Operand:
    """One GEMM's left operand as the kernel reads it: the model-dtype rows, or their FP8 bytes
    with per-token-group scales (`scale` is then `[rows, K groups]`; unused, and a stand-in, otherwise)."""

    rows: torch.Tensor
    scale: torch.Tensor


def _operand(x: torch.Tensor, fp8_group: int | None) -> _Operand:
    if fp8_group is None:
        return _Operand(x, x)
    return _Operand(*per_token_group_quant(x, fp8_group))


def _check_weights(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales: Fp8ExpertScales | None) -> None:
    if scales is None:
        check_tensor("w13", w13, 3, (hidden.dtype,), hidden.device)
        check_tensor("w2", w2, 3, (hidden.dtype,), hidden.device)
        return
    check_tensor("w13", w13, 3, (FP8_DTYPE,), hidden.device)
    check_tensor("w2", w2, 3, (FP8_DTYPE,), hidden.device)
    check_block_scaled_weight(w13, scales.w13_scale, scales.block13.block_out, scales.block13.block_in)
    check_block_scaled_weight(w2, scales.w2_scale, scales.block2.block_out, scales.block2.block_in)
    for block in (scales.block13.block_in, scales.block2.block_in):
        if block < 16 or block & (block - 1):
            raise ValueError(f"FP8 K blocks must be powers of two >= 16 (one K step each), got {block}")


def fused_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, tile: MoETile | None = None, invariant: bool = False,
              scales: Fp8ExpertScales | None = None) -> torch.Tensor:
    """`sum_j w_j * expert_{id_j}(x)` per token; ids outside [0, E) contribute nothing.

    `scales`: the quantisation method. None: `w13`/`w2` are in hidden's dtype. `Fp8ExpertScales`:
    they are e4m3 with block scales (`model/quant/moe_scales.py`); `hidden` and the SiLU-mul
    intermediate are quantised per token group of each GEMM's `block_in`, which is then the K
    step (so `tile.block_k` is not used), and each step's product is rescaled in fp32.

    `invariant`: `INVARIANT_TILE`, and each token's k expert outputs summed in slot order, one
    elementwise add after another (a reduction kernel's order may follow the batch's shape).

    hidden `[N, H]`, topk_ids `[N, k]` int, topk_weights `[N, k]`, w13 `[E, 2I, H]`, w2 `[E, H, I]`
    → `[N, H]` in hidden's dtype. fp32 inputs in the model dtype use exact fp32 products (no tf32).
    """
    device = hidden.device
    check_tensor("hidden", hidden, 2, _FLOAT_DTYPES, device)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, N, K]")
    _check_weights(hidden, w13, w2, scales)
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
    fp8 = scales is not None
    tile = tile or (INVARIANT_TILE if invariant else measured_tile(device, num_pairs, num_experts, inter_size,
                                                                   hidden_size, fp8)
                    or default_tile(num_pairs, num_experts))
    # A stand-in for the scale operands the bf16 kernels never read.
    w13_scale, w2_scale = (scales.w13_scale, scales.w2_scale) if fp8 else (w13, w2)
    group13, group2 = (scales.block13, scales.block2) if fp8 else (None, None)
    # One launch for decode-sized batches, three beyond (~30 torch ops in the oracle).
    align = align_by_expert_small if num_pairs <= MAX_PAIRS else align_by_expert_large
    blocks: ExpertBlocks = align(topk_ids, num_experts, tile.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    ieee = hidden.dtype == torch.float32 and not fp8
    x = _operand(hidden.contiguous(), group13.block_in if fp8 else None)
    inter = torch.empty(blocks.capacity, inter_size, dtype=hidden.dtype, device=device)
    grid = (blocks.num_blocks, triton.cdiv(inter_size, tile.block_n))
    _gate_up_kernel[grid](
        x.rows, x.scale, w13, w13_scale, inter, blocks.sorted_pair_ids, blocks.block_expert,
        num_pairs, top_k, hidden_size, inter_size, num_experts, group13.block_out if fp8 else 1,
        x.rows.stride(0), x.scale.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        w13_scale.stride(0), w13_scale.stride(1), inter.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=group13.block_in if fp8 else tile.block_k,
        IEEE=ieee, FP8=fp8, num_warps=tile.num_warps, num_stages=tile.num_stages)
    a = _operand(inter, group2.block_in if fp8 else None)
    per_pair = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=device)
    grid = (blocks.num_blocks, triton.cdiv(hidden_size, tile.block_n))
    _down_kernel[grid](
        a.rows, a.scale, w2, w2_scale, per_pair, blocks.sorted_pair_ids, blocks.block_expert, weights,
        num_pairs, hidden_size, inter_size, num_experts, group2.block_out if fp8 else 1,
        a.rows.stride(0), a.scale.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        w2_scale.stride(0), w2_scale.stride(1), per_pair.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=group2.block_in if fp8 else tile.block_k,
        IEEE=ieee, FP8=fp8, num_warps=tile.num_warps, num_stages=tile.num_stages)
    per_token = per_pair.view(num_tokens, top_k, hidden_size)
    if not invariant:
        return per_token.sum(dim=1, dtype=torch.float32).to(hidden.dtype)
    total = per_token[:, 0].float()
    for slot in range(1, top_k):
        total = total + per_token[:, slot].float()
    return total.to(hidden.dtype)
