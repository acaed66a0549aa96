"""`align_by_expert` in one Triton launch for small batches (decode), instead of ~30 torch ops.

Decode is bound by launches, not bytes: the torch version of the sort costs ~30 kernel launches per
MoE layer. For up to `MAX_PAIRS` (token, expert) pairs one program does it all in registers:
    rank[p]   pairs before p with the same expert (a [P, P] comparison: the stable order of the
              torch version, so both produce identical blocks)
    counts    tl.histogram of expert ids (dropped ids in bin E), padded to block_m, cumsum → starts
    then      fill sentinels, barrier, scatter pair p to row starts[e] + rank[p]; the first row of
              every block names its expert (each block of an expert starts with a real pair).
`starts` goes through a small global scratch buffer: registers cannot be gathered by index, and
`tl.debug_barrier()` (bar.sync) makes the block's global writes visible to all its threads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import next_power_of_2
from deepseek_pd.model.kernels.moe_align import ExpertBlocks, padded_capacity

MAX_PAIRS = 256  # the [P, P] rank comparison stays small in registers


@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks"])  # per-batch: kernels/__init__.py
def _align_small_kernel(ids_ptr, sorted_ptr, block_expert_ptr, scratch_ptr, num_pairs, num_experts, capacity,
                        num_blocks, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                        FILL: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    p_ok = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=p_ok, other=-1)
    valid = p_ok & (ids >= 0) & (ids < num_experts)
    expert = tl.where(valid, ids, num_experts).to(tl.int32)
    same = (expert[:, None] == expert[None, :]) & (p[None, :] < p[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    counts = tl.histogram(expert, BLOCK_E)
    bins = tl.arange(0, BLOCK_E)
    padded = tl.where(bins < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(scratch_ptr + bins, starts)
    for c in range(0, capacity, FILL):
        rows = c + tl.arange(0, FILL)
        tl.store(sorted_ptr + rows, tl.full((FILL,), 0, tl.int32) + num_pairs, mask=rows < capacity)
    for c in range(0, num_blocks, FILL):
        blocks = c + tl.arange(0, FILL)
        tl.store(block_expert_ptr + blocks, tl.full((FILL,), 0, tl.int32) + num_experts, mask=blocks < num_blocks)
    tl.debug_barrier()
    start = tl.load(scratch_ptr + expert, mask=valid, other=0)
    dest = start + rank
    tl.store(sorted_ptr + dest, p.to(tl.int32), mask=valid)
    tl.store(block_expert_ptr + dest // BLOCK_M, expert, mask=valid & (rank % BLOCK_M == 0))


def align_by_expert_small(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Same result as `moe_align.align_by_expert` for at most MAX_PAIRS pairs, in one launch."""
    num_pairs = topk_ids.numel()
    if num_pairs > MAX_PAIRS:
        raise ValueError(f"{num_pairs} pairs > {MAX_PAIRS}: use moe_align.align_by_expert")
    device = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    block_e = next_power_of_2(num_experts + 1)
    scratch = torch.empty(block_e, dtype=torch.int32, device=device)
    _align_small_kernel[(1,)](
        ids, sorted_pair_ids, block_expert, scratch, num_pairs, num_experts, capacity,
        capacity // block_m, BLOCK_P=max(16, next_power_of_2(num_pairs)), BLOCK_E=block_e, BLOCK_M=block_m,
        FILL=256, num_warps=4)
    return ExpertBlocks(sorted_pair_ids, block_expert, num_pairs, block_m)
