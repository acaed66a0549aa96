"""(token, expert) pairs sorted by expert and padded to a row block, entirely on the device.

A grouped GEMM wants each row block to belong to one expert. With `k` choices per token there are
`P = N*k` pairs; pair `p` is token `p // k` choosing expert `topk_ids.flat[p]`. Pairs whose id is
outside [0, E) (experts another EP rank owns) are dropped. Each expert's pairs are padded to a
multiple of `block_m`, padding rows hold the sentinel pair id `P`.

The number of padded rows depends on the routing, which only the device knows; to avoid a host
sync the buffers are sized by a host-known bound, `P + min(E, P) * (block_m - 1)` rounded up
(at most min(E, P) experts are non-empty, each wastes fewer than block_m rows), and blocks past
the real end are marked with expert E so kernels return at once.

Example, k=2, E=3, block_m=2, topk_ids=[[2, 0], [2, 5]] (5 belongs to another rank):
    pairs by expert: 0 → [1], 2 → [0, 2]
    sorted_pair_ids = [1, P, 0, 2, P, P, ...]   block_expert = [0, 2, 3, 3, ...]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertBlocks:
    sorted_pair_ids: torch.Tensor  # [capacity] int32; P marks a padding row
    block_expert: torch.Tensor  # [capacity // block_m] int32; E marks a block with no work
    num_pairs: int
    block_m: int

    @property
    def capacity(self) -> int:
        return int(self.sorted_pair_ids.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.block_expert.shape[0])


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return max(block_m, -(-bound // block_m) * block_m)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids `[N, k]` (any integer dtype) → pair ids grouped by expert in blocks of `block_m`."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    expert = torch.where(valid, flat, torch.full_like(flat, num_experts))  # sentinel sorts last
    # scatter_add, not bincount: bincount sizes its output from the max id, a device→host sync.
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # a fill kernel; `padded[i] = 0` copies a CPU scalar, which graph capture refuses
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts

    capacity = padded_capacity(num_pairs, num_experts, block_m)
    order = torch.argsort(expert, stable=True)
    sorted_expert = expert[order]
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_expert]
    # Dropped pairs go to one extra dump row past the end, cut off below.
    dest = torch.where(sorted_expert < num_experts, padded_start[sorted_expert] + rank,
                       torch.full_like(rank, capacity))
    sorted_pair_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[dest] = order.to(torch.int32)

    block_start = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end[:num_experts].contiguous(), block_start, right=True)
    return ExpertBlocks(sorted_pair_ids[:capacity], block_expert.to(torch.int32), num_pairs, block_m)
