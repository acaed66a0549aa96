"""Routed experts stacked for grouped kernels, and the MoE kernel registry.

`w13` is `[E, 2I, H]` (gate rows then up rows of each expert, HF's `gate_up_proj` layout) and `w2`
`[E, H, I]`. With `num_fused_shared_experts = n` the n shared experts are appended as experts
E..E+n-1 (the shared MLP of width n*I split into n slices of width I: an MLP is a sum over its
intermediate neurons, so the split is exact) and every token selects them with weight 1.

A kernel computes, per token, `sum_j w_j * expert_{id_j}(x)`; ids outside [0, E) (experts another
EP rank owns) contribute nothing.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_pd.model.registry import Registry


class MoEKernel(Protocol):
    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """hidden `[N, H]`, topk_ids/weights `[N, k]` → `[N, H]` in hidden's dtype."""


MOE_BACKENDS: Registry[MoEKernel] = Registry("MoE backend")


@MOE_BACKENDS.register("torch")
class TorchMoEKernel:
    """Reference: group the (token, expert) pairs by expert, one GEMM pair per expert hit.

    One host sync per call (the per-expert counts) — fine for the oracle, not for CUDA graphs.
    """

    cuda_graph_safe = False
    # The per-expert products (the "torch_invariant" backend swaps in batch_invariant.linear).
    linear = staticmethod(F.linear)

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        num_experts = w13.shape[0]
        num_tokens, top_k = topk_ids.shape
        out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        if num_tokens == 0:
            return out.to(hidden.dtype)
        flat_ids = topk_ids.reshape(-1)
        flat_ids = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids,
                               torch.full_like(flat_ids, num_experts))
        flat_weights = topk_weights.reshape(-1).float()
        token_of = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()
        start = 0
        for expert, count in enumerate(counts[:num_experts]):
            if count:
                pairs = order[start:start + count]
                tokens = token_of[pairs]
                gate, up = self.linear(hidden[tokens], w13[expert]).chunk(2, dim=-1)
                y = self.linear(F.silu(gate) * up, w2[expert])
                out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
            start += count
        return out.to(hidden.dtype)


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: str,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        kw = dict(dtype=dtype, device=device)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        self.kernel: MoEKernel = MOE_BACKENDS.build(backend)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.kernel(hidden, topk_ids, topk_weights, self.w13, self.w2)
