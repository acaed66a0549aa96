"""`align_by_expert` for any number of pairs in three Triton launches (prefill), instead of ~30 torch ops.

    count    grid over pair blocks: a histogram of expert ids per block, atomically added to
             `counts [E+1]` (bin E: pairs other EP ranks own, dropped).
    offsets  one program: counts padded to `block_m`, exclusive cumsum → each expert's first row
             (written to `cursor`); every row filled with the sentinel pair id P; each block's
             expert by counting the padded ends at or before its first row (E past the end).
    scatter  grid over pair blocks: `row = atomic_add(cursor[e], 1)` per pair, `sorted[row] = p`.
Same blocks and capacity as `moe_align.align_by_expert` (its torch oracle); only the order of pairs
inside one expert's rows may differ, which no kernel depends on (each row is computed on its own).
No host synchronisation: the capacity is the host bound `padded_capacity`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import next_power_of_2
from deepseek_pd.model.kernels.moe_align import ExpertBlocks, padded_capacity

_PAIRS_PER_PROGRAM = 1024
_FILL = 32  # blocks per step of the offsets program: a [FILL, BLOCK_E] compare stays in registers


@triton.jit
def _expert_of(ids_ptr, p, num_pairs, num_experts):
    ok = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=ok, other=-1)
    valid = ok & (ids >= 0) & (ids < num_experts)
    return tl.where(valid, ids, num_experts).to(tl.int32), valid


@triton.jit(do_not_specialize=["num_pairs"])  # per-batch ints: kernels/__init__.py
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    expert, _ = _expert_of(ids_ptr, p, num_pairs, num_experts)
    expert = tl.where(p < num_pairs, expert, BLOCK_E - 1)  # past the end: a bin nobody reads
    hist = tl.histogram(expert, BLOCK_E)
    bins = tl.arange(0, BLOCK_E)
    tl.atomic_add(counts_ptr + bins, hist, mask=(bins <= num_experts) & (hist > 0))


@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks"])  # per-batch: kernels/__init__.py
def _offsets_kernel(counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, capacity,
                    num_blocks, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, FILL: tl.constexpr):
    bins = tl.arange(0, BLOCK_E)
    real = bins < num_experts
    counts = tl.load(counts_ptr + bins, mask=real, other=0)
    padded = tl.where(real, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + bins, ends - padded, mask=real)
    for c in range(0, capacity, FILL):
        rows = c + tl.arange(0, FILL)
        tl.store(sorted_ptr + rows, tl.full((FILL,), 0, tl.int32) + num_pairs, mask=rows < capacity)
    for c in range(0, num_blocks, FILL):
        blocks = c + tl.arange(0, FILL)
        first_row = blocks * BLOCK_M
        # The block's expert: how many experts' padded rows end at or before its first row.
        done = (ends[None, :] <= first_row[:, None]) & real[None, :]
        expert = tl.sum(done.to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_pairs"])  # per-batch ints: kernels/__init__.py
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, num_experts, BLOCK_P: tl.constexpr):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    expert, valid = _expert_of(ids_ptr, p, num_pairs, num_experts)
    row = tl.atomic_add(cursor_ptr + expert, tl.full((BLOCK_P,), 1, tl.int32), mask=valid)
    tl.store(sorted_ptr + row, p.to(tl.int32), mask=valid)


def align_by_expert_large(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids `[N, k]` (any integer dtype) → pair ids grouped by expert in blocks of `block_m`."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    num_pairs = ids.numel()
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    num_blocks = capacity // block_m
    block_e = next_power_of_2(num_experts + 2)  # + the dropped bin + one unused bin for padding lanes
    counts = torch.zeros(block_e, dtype=torch.int32, device=device)
    cursor = torch.empty(block_e, dtype=torch.int32, device=device)
    sorted_pair_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    grid = (triton.cdiv(max(num_pairs, 1), _PAIRS_PER_PROGRAM),)
    _count_kernel[grid](ids, counts, num_pairs, num_experts, BLOCK_P=_PAIRS_PER_PROGRAM, BLOCK_E=block_e)
    _offsets_kernel[(1,)](counts, cursor, sorted_pair_ids, block_expert, num_pairs, num_experts, capacity,
                          num_blocks, BLOCK_E=block_e, BLOCK_M=block_m, FILL=_FILL, num_warps=4)
    _scatter_kernel[grid](ids, cursor, sorted_pair_ids, num_pairs, num_experts, BLOCK_P=_PAIRS_PER_PROGRAM)
    return ExpertBlocks(sorted_pair_ids, block_expert, num_pairs, block_m)
