"""Fused MoE experts with block-scaled FP8 weights (W8A8, DeepSeek-V3 format) in Triton.

The structure of `fused_moe.py` (expert-sorted row blocks from `moe_align`, gate+up with SiLU-mul,
then down × routing weight, per-pair rows summed in fp32), with both GEMMs in FP8:
    hidden [N, H]  → per-token-group quantised once (group = w13's K block), gathered by pair;
    w13 [E, 2I, H] e4m3, w13_scale [E, ceil(2I/bn1), ceil(H/bk1)];
    inter [rows, I] (model dtype) → quantised per row group (group = w2's K block);
    w2 [E, H, I] e4m3, w2_scale [E, ceil(H/bn2), ceil(I/bk2)].
Each K step is one scale group: `acc += dot(a, w) * a_scale[:, None] * w_scale[None, :]`.
Decode reads the experts' FP8 bytes only (half of bf16). The oracle is `TorchFp8MoEKernel`
(`model/moe/fp8_experts.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
from deepseek_pd.model.kernels.checks import check_tensor
from deepseek_pd.model.kernels.fp8_gemm import check_block_scaled_weight
from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
from deepseek_pd.model.kernels.fused_moe import MoETile, default_tile
from deepseek_pd.model.kernels.moe_align_large import align_by_expert_large
from deepseek_pd.model.kernels.moe_align_small import MAX_PAIRS, align_by_expert_small

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _gate_up_fp8_kernel(x_ptr, xs_ptr, w13_ptr, ws_ptr, inter_ptr, pair_ptr, block_expert_ptr,
                        num_pairs, top_k, hidden, inter_size, num_experts, group_n,
                        stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_im,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    ks = tl.arange(0, BLOCK_K)
    w_base = w13_ptr + expert * stride_we
    s_gate = ws_ptr + expert * stride_wse + (cols // group_n).to(tl.int64) * stride_wsn
    s_up = ws_ptr + expert * stride_wse + ((cols + inter_size) // group_n).to(tl.int64) * stride_wsn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        k = kb * BLOCK_K + ks
        k_ok = k < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(xs_ptr + token * stride_xsm + kb, mask=row_ok, other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + inter_size) * stride_wn + k[:, None], mask=w_mask, other=0.0)
        g_s = tl.load(s_gate + kb, mask=col_ok, other=0.0)
        u_s = tl.load(s_up + kb, mask=col_ok, other=0.0)
        acc_gate += tl.dot(a, w_gate) * a_s[:, None] * g_s[None, :]
        acc_up += tl.dot(a, w_up) * a_s[:, None] * u_s[None, :]
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :]
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_fp8_kernel(a_ptr, as_ptr, w2_ptr, ws_ptr, out_ptr, pair_ptr, block_expert_ptr, weight_ptr,
                     num_pairs, hidden, inter_size, num_experts, group_n,
                     stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    ks = tl.arange(0, BLOCK_K)
    w_base = w2_ptr + expert * stride_we
    s_base = ws_ptr + expert * stride_wse + (cols // group_n).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter_size, BLOCK_K)):
        k = kb * BLOCK_K + ks
        k_ok = k < inter_size
        a = tl.load(a_ptr + rows64[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + rows64 * stride_asm + kb, mask=row_ok, other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        w_s = tl.load(s_base + kb, mask=col_ok, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    weight = tl.load(weight_ptr + pair, mask=row_ok, other=0.0)
    acc = acc * weight[:, None]
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fused_moe_fp8(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w13_scale: torch.Tensor, block13: Fp8BlockQuantConfig,
                  w2: torch.Tensor, w2_scale: torch.Tensor, block2: Fp8BlockQuantConfig,
                  tile: MoETile | None = None) -> torch.Tensor:
    """`sum_j w_j * expert_{id_j}(x)` with FP8 experts; ids outside [0, E) contribute nothing.

    hidden `[N, H]` (model dtype), topk `[N, k]`, w13 `[E, 2I, H]` / w2 `[E, H, I]` e4m3 with their
    block scales → `[N, H]` in hidden's dtype. K blocks must be powers of two >= 16.
    """
    device = hidden.device
    check_tensor("hidden", hidden, 2, _FLOAT_DTYPES, device)
    check_block_scaled_weight(w13, w13_scale, block13.block_out, block13.block_in)
    check_block_scaled_weight(w2, w2_scale, block2.block_out, block2.block_in)
    num_experts, two_inter, hidden_size = w13.shape
    inter_size = two_inter // 2
    if (w13.dim() != 3 or two_inter % 2 or hidden.shape[1] != hidden_size
            or tuple(w2.shape) != (num_experts, hidden_size, inter_size)):
        raise ValueError(f"shapes do not fit: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must be "
                         f"[N={hidden.shape[0]}, k]")
    for block in (block13.block_in, block2.block_in):
        if block < 16 or block & (block - 1):
            raise ValueError(f"FP8 K blocks must be powers of two >= 16, got {block}")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(num_tokens, hidden_size)
    tile = tile or default_tile(num_pairs, num_experts)
    align = align_by_expert_small if num_pairs <= MAX_PAIRS else align_by_expert_large
    blocks = align(topk_ids, num_experts, tile.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    x_fp8, x_scale = per_token_group_quant(hidden.contiguous(), block13.block_in)
    inter = torch.empty(blocks.capacity, inter_size, dtype=hidden.dtype, device=device)
    grid = (blocks.num_blocks, triton.cdiv(inter_size, tile.block_n))
    _gate_up_fp8_kernel[grid](
        x_fp8, x_scale, w13, w13_scale, inter, blocks.sorted_pair_ids, blocks.block_expert,
        num_pairs, top_k, hidden_size, inter_size, num_experts, block13.block_out,
        x_fp8.stride(0), x_scale.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        inter.stride(0), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block13.block_in,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    inter_fp8, inter_scale = per_token_group_quant(inter, block2.block_in)
    per_pair = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=device)
    grid = (blocks.num_blocks, triton.cdiv(hidden_size, tile.block_n))
    _down_fp8_kernel[grid](
        inter_fp8, inter_scale, w2, w2_scale, per_pair, blocks.sorted_pair_ids, blocks.block_expert, weights,
        num_pairs, hidden_size, inter_size, num_experts, block2.block_out,
        inter_fp8.stride(0), inter_scale.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0),
        w2_scale.stride(1), per_pair.stride(0), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=block2.block_in, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return per_pair.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
