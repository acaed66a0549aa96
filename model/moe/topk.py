"""Expert selection: scoring functions and the three DeepSeek top-k methods, as lookup tables.

All math in fp32 on router logits `[T, E]`. Each method returns (weights `[T, k]`, ids `[T, k]`)
before renormalisation/scaling, which `select_experts` applies the same way for all methods:
    weights /= sum(weights) + 1e-20     if norm_topk_prob   (HF V3; every released V2 has it off)
    weights *= routed_scaling_factor
    greedy                top-k of the scores.
    group_limited_greedy  (V2) groups ranked by their best score; keep topk_group groups; top-k
                          inside them (other experts' scores set to 0, as HF does).
    noaux_tc              (V3) choice scores = scores + e_score_correction_bias; groups ranked by
                          the sum of their top-2 choice scores; top-k of the choice scores inside the
                          kept groups; weights are the *unbiased* scores of the chosen experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

SCORING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda logits: logits.softmax(dim=-1, dtype=torch.float32),
    "sigmoid": lambda logits: logits.float().sigmoid(),
}


@dataclass(frozen=True)
class TopKSpec:
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def _group_mask(group_scores: torch.Tensor, spec: TopKSpec, num_experts: int) -> torch.Tensor:
    group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    per_group = num_experts // spec.n_group
    return group_mask.unsqueeze(-1).expand(-1, spec.n_group, per_group).reshape(-1, num_experts).bool()


def greedy(scores: torch.Tensor, bias: torch.Tensor | None, spec: TopKSpec) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(scores, k=spec.top_k, dim=-1, sorted=False)


def group_limited_greedy(scores: torch.Tensor, bias: torch.Tensor | None,
                         spec: TopKSpec) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts = scores.shape[-1]
    group_scores = scores.view(-1, spec.n_group, num_experts // spec.n_group).max(dim=-1).values
    masked = scores.masked_fill(~_group_mask(group_scores, spec, num_experts), 0.0)
    return torch.topk(masked, k=spec.top_k, dim=-1, sorted=False)


def noaux_tc(scores: torch.Tensor, bias: torch.Tensor | None, spec: TopKSpec) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts = scores.shape[-1]
    choice = scores if bias is None else scores + bias.float()
    group_scores = choice.view(-1, spec.n_group, num_experts // spec.n_group).topk(2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(group_scores, spec, num_experts), float("-inf"))
    ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids


TOPK_METHODS: dict[str, Callable[[torch.Tensor, torch.Tensor | None, TopKSpec],
                                 tuple[torch.Tensor, torch.Tensor]]] = {
    "greedy": greedy,
    "group_limited_greedy": group_limited_greedy,
    "noaux_tc": noaux_tc,
}


def slot_sum(weights: torch.Tensor) -> torch.Tensor:
    """`weights.sum(-1, keepdim=True)` for a few columns, added one column after another: a
    reduction kernel's order over a short row may follow the number of rows (seen on CPU: a row's
    sum differed in a batch of 16), and `--deterministic` needs it to follow the row alone."""
    total = weights[:, :1]
    for slot in range(1, weights.shape[1]):
        total = total + weights[:, slot:slot + 1]
    return total


def finish_weights(weights: torch.Tensor, spec: TopKSpec) -> torch.Tensor:
    if spec.norm_topk_prob:
        weights = weights / (slot_sum(weights) + 1e-20)
    return weights * spec.routed_scaling_factor
