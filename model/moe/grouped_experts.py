"""MoE backend "grouped": `torch._grouped_mm` over expert-sorted rows, without host synchronisation.

Registered only when this torch has `torch._grouped_mm` (CUTLASS on Hopper; a plain fallback on
CPU). Pairs (token, expert) are sorted by expert on the device; the per-expert row offsets are a
device cumsum, so nothing is counted on the host. Rows of dropped ids (other EP ranks) sit past
the last offset, where `_grouped_mm` leaves garbage: they are zeroed with `where`, never used.
"""
from __future__ import annotations

import torch

from deepseek_pd.model.moe.experts import MOE_BACKENDS, grouped_expert_products


class GroupedMMMoEKernel:
    cuda_graph_safe = True  # offsets are a device cumsum: no host sync

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, scales: None = None) -> torch.Tensor:
        num_experts = w13.shape[0]
        num_tokens, top_k = topk_ids.shape
        if num_tokens == 0:
            return hidden.new_zeros(num_tokens, hidden.shape[-1])
        flat = topk_ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < num_experts)
        expert = torch.where(valid, flat, torch.full_like(flat, num_experts))
        order, y = grouped_expert_products(hidden, expert, top_k, w13, w2)
        weight = topk_weights.reshape(-1).float()[order]
        y = torch.where(valid[order, None], y.float() * weight[:, None], 0.0)
        per_pair = torch.empty_like(y)
        per_pair[order] = y
        return per_pair.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


if hasattr(torch, "_grouped_mm"):
    MOE_BACKENDS.register("grouped")(GroupedMMMoEKernel)
