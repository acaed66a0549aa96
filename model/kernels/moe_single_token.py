"""Fused MoE for a batch of one token (batch-1 decode) in two launches, without the expert sort.

At M = 1 the grouped path (`fused_moe`) spends six launches on one token: the sort
(`moe_align_small`), gate_up over 16-row blocks holding one real row each, a zeroed `[k, H]`
buffer, down, the sum over the k slots and its cast. Here the sort is skipped: each (token, slot)
pair is its own program row, and the down projection sums the slots in its epilogue.

    pair gate_up   program (pair, n-tile): silu(x·w13[e]_gate^T) * (x·w13[e]_up^T) for the n-tile of
                   pair p = token * k + slot, e = topk_ids.flat[p], written to `inter[p]` (model dtype).
    token down     program (token, n-tile): inter[p]·w2[e]^T of all k slots at once (one [slots, n, k]
                   weight tile per K step), each times its pair's weight and rounded to the model dtype
                   (as `fused_moe` stores each pair's product), summed over the slots in fp32, rounded
                   once into `out[token]`.

Both read each chosen expert's weights once per token, as the grouped path does at M = 1 (it
reads an expert once per row block); at M > 1 tokens sharing an expert would read it again, so
`fused_moe` takes this path only for `MAX_TOKENS` tokens. Ids outside [0, E) (other EP ranks'
experts) contribute nothing. The products are row-vector times tile (`tl.sum` of a broadcast
product in fp32): no 16-row MMA padding for one row. The oracle is `TorchMoEKernel`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import next_power_of_2

MAX_TOKENS = 1  # beyond one token, shared experts across tokens make the sorted path read less
DEFAULT_SMS = 132  # H100/H200, for a device that reports none (the CPU interpreter)


@dataclass(frozen=True)
class SingleTokenTile:
    """How the two launches spread one token's weight read over the card.

    A GEMV streams each weight byte once: its speed is the bytes in flight per SM. Each launch
    narrows its n-tile (gate_up: down to `min_block_n_gate_up` rows of one pair's expert; down: to
    `min_block_n_down` rows of each of the token's slots) until it has at least
    `programs_per_sm` x SMs programs, and each program reads `[n, block_k]` weight tiles along the
    contiguous K axis (whole 2 x block_k-byte runs per row: coalesced), `num_stages` K steps in flight.

    Example (V2-Lite: 6 routed + 2 fused shared experts, H 2048, I 1408, 132 SMs, 4 per SM):
        gate_up: 8 pairs x 88 tiles of 16 rows = 704 programs >= 528
        down:    1 token x 1024 tiles of 2 rows (x 8 slots) = 1024 programs >= 528
    (the 2026-12-07 kernel: 352 and 256 programs, 0.89x of the sorted path on an H100).
    """

    programs_per_sm: int = 4
    max_block_n: int = 64
    min_block_n_gate_up: int = 4
    min_block_n_down: int = 2
    block_k_gate_up: int = 256
    tile_elements_down: int = 8192  # the down kernel's [slots, n, k] weight tile per K step (16 KB in bf16)
    num_warps: int = 4
    num_warps_down: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class SingleTokenLaunch:
    """The two grids and tile widths of one call (`plan_launch`)."""

    gate_up_grid: tuple[int, int]
    gate_up_block_n: int
    gate_up_block_k: int
    down_grid: tuple[int, int]
    down_block_s: int
    down_block_n: int
    down_block_k: int

    @property
    def programs(self) -> tuple[int, int]:
        return (self.gate_up_grid[0] * self.gate_up_grid[1], self.down_grid[0] * self.down_grid[1])


@triton.jit
def _pair_gate_up_kernel(x_ptr, w13_ptr, ids_ptr, inter_ptr, top_k, hidden, inter_size, num_experts,
                         stride_xm, stride_we, stride_wn, stride_wk, stride_im,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return  # another rank's expert: `inter[pair]` stays unread (the down kernel masks it)
    token = (pair // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    w_base = w13_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Pipelined by request: a loop with no tl.dot gets no cp.async stages unless it asks.
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + token * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
        mask = col_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :] * stride_wk, mask=mask, other=0.0)
        w_up = tl.load(w_base + (cols[:, None] + inter_size) * stride_wn + ks[None, :] * stride_wk, mask=mask,
                       other=0.0)
        acc_gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
        acc_up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + cols, act.to(inter_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _token_down_kernel(inter_ptr, w2_ptr, ids_ptr, weight_ptr, out_ptr, top_k, hidden, inter_size, num_experts,
                       stride_im, stride_we, stride_wn, stride_wk, stride_om,
                       BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       STAGES: tl.constexpr):
    # All k slots of the token in one [slots, n, k] tile per K step: a program keeps BLOCK_S * BLOCK_N
    # weight rows in flight (a slot at a time would leave too few bytes in flight to fill HBM).
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slots = tl.arange(0, BLOCK_S)
    slot_ok = slots < top_k
    pair = token * top_k + slots
    expert = tl.load(ids_ptr + pair, mask=slot_ok, other=-1).to(tl.int64)
    valid = slot_ok & (expert >= 0) & (expert < num_experts)  # another rank's expert reads nothing
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_rows = w2_ptr + tl.where(valid, expert, 0)[:, None, None] * stride_we + cols[None, :, None] * stride_wn
    row_ok = valid[:, None, None] & col_ok[None, :, None]
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, inter_size, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter_size
        a = tl.load(inter_ptr + pair[:, None] * stride_im + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, None, :] * stride_wk, mask=row_ok & k_ok[None, None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    weight = tl.load(weight_ptr + pair, mask=valid, other=0.0)
    # Each pair's product rounded to the model dtype, as fused_moe's per-pair buffer holds it.
    product = (acc * weight[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    total = tl.sum(tl.where(valid[:, None], product, 0.0), axis=0)
    tl.store(out_ptr + token * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def _block_n(rows: int, programs_per_row: int, wanted: int, tile: SingleTokenTile, floor: int) -> int:
    """The widest n-tile (`floor`..`max_block_n`, powers of 2) that still gives `wanted` programs."""
    block = tile.max_block_n
    while block > floor and programs_per_row * triton.cdiv(rows, block) < wanted:
        block //= 2
    return block


def plan_launch(num_tokens: int, top_k: int, hidden_size: int, inter_size: int, num_sms: int,
                tile: SingleTokenTile = SingleTokenTile()) -> SingleTokenLaunch:
    """The grids of one call: each launch has >= `tile.programs_per_sm * num_sms` programs unless its
    n-tile is already at its floor. Pure (no device), so the CPU tests check it for any SM count."""
    wanted = tile.programs_per_sm * max(1, num_sms)
    num_pairs = num_tokens * top_k
    gate_n = _block_n(inter_size, num_pairs, wanted, tile, tile.min_block_n_gate_up)
    block_s = max(2, next_power_of_2(top_k))  # no one-wide axis
    down_n = _block_n(hidden_size, num_tokens, wanted, tile, tile.min_block_n_down)
    down_k = max(16, min(next_power_of_2(inter_size), tile.tile_elements_down // (block_s * down_n)))
    return SingleTokenLaunch((num_pairs, triton.cdiv(inter_size, gate_n)), gate_n,
                             min(tile.block_k_gate_up, max(16, next_power_of_2(hidden_size))),
                             (num_tokens, triton.cdiv(hidden_size, down_n)), block_s, down_n, down_k)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_moe_single_token(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                           w13: torch.Tensor, w2: torch.Tensor,
                           tile: SingleTokenTile = SingleTokenTile()) -> torch.Tensor:
    """`sum_j w_j * expert_{id_j}(x)` for at most `MAX_TOKENS` tokens, experts in hidden's dtype.

    The caller (`fused_moe`) has checked the shapes, dtypes and devices. hidden `[N, H]` contiguous,
    topk_ids `[N, k]` int, topk_weights `[N, k]`, w13 `[E, 2I, H]`, w2 `[E, H, I]` → `[N, H]`.
    """
    num_tokens, top_k = topk_ids.shape
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"{num_tokens} tokens > {MAX_TOKENS}: use fused_moe's sorted path")
    num_experts, two_inter, hidden_size = w13.shape
    inter_size = two_inter // 2
    num_pairs = num_tokens * top_k
    plan = plan_launch(num_tokens, top_k, hidden_size, inter_size, _sm_count(hidden.device), tile)
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    inter = torch.empty(num_pairs, inter_size, dtype=hidden.dtype, device=hidden.device)
    _pair_gate_up_kernel[plan.gate_up_grid](
        hidden, w13, ids, inter, top_k, hidden_size, inter_size, num_experts,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0),
        BLOCK_N=plan.gate_up_block_n, BLOCK_K=plan.gate_up_block_k, STAGES=tile.num_stages,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _token_down_kernel[plan.down_grid](
        inter, w2, ids, weights, out, top_k, hidden_size, inter_size, num_experts,
        inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        BLOCK_S=plan.down_block_s, BLOCK_N=plan.down_block_n, BLOCK_K=plan.down_block_k,
        STAGES=tile.num_stages, num_warps=tile.num_warps_down, num_stages=tile.num_stages)
    return out
