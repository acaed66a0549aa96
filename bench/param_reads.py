"""What a decode step reads of each parameter of a built model: one rule for the benches that count
weight bytes (`speculative_floor.step_bytes`, `decode_kernel_count.OpScopes`).

Kinds, in the order they are decided:
- "lm_head": the LM head's weight (read whole every step);
- "experts" / "mtp_experts": a routed-expert tensor stacked under `.mlp.experts.` (weights and
  their FP8 scales, first dimension = experts): a step reads the slices of the experts its tokens
  route to, in the main model or in the MTP layer (`mtp.`);
- "mtp_dense": the MTP layer's other parameters (read whole when it drafts);
- "embedding": the token embedding (a step reads one row per token; if tied to the LM head, the
  LM head's kind wins, above);
- "dense": everything else (read whole every step).

A stacked expert tensor holds the routed experts' slots, then the shared experts' where the model
fuses them (`num_fused_shared_experts`, model/moe/experts.py): a step reads every shared slot and
the routed slots its tokens pick (`expert_slots`). The benches run one rank without EPLB, so every
routed expert has its one slot here.
"""
from __future__ import annotations

import torch

KINDS = ("lm_head", "experts", "mtp_experts", "mtp_dense", "embedding", "dense")


def param_kind(model: torch.nn.Module, name: str, param: torch.Tensor) -> str:
    """The kind of `model`'s parameter `name` (see the module doc)."""
    head = getattr(model, "lm_head", None)
    if head is not None and param is head.weight:
        return "lm_head"
    in_mtp = name.startswith("mtp.")
    if ".mlp.experts." in name and param.dim() == 3:
        return "mtp_experts" if in_mtp else "experts"
    if in_mtp:
        return "mtp_dense"
    if "embed_tokens" in name:
        return "embedding"
    return "dense"


def nbytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


def expert_slots(model: torch.nn.Module, param: torch.Tensor) -> tuple[int, int, int]:
    """(bytes of one slot, routed slots, fused shared slots) of a stacked expert tensor of `model`
    (kind "experts" or "mtp_experts")."""
    shared = getattr(getattr(model, "options", None), "num_fused_shared_experts", 0)
    slots = param.shape[0]
    return nbytes(param) // slots, slots - shared, shared


def expected_distinct(experts: int, top_k: int, tokens: int) -> float:
    """Mean number of distinct experts that `tokens` tokens touch when each picks `top_k` of
    `experts` uniformly at random without repeats (each expert is missed by one token with
    probability 1 - top_k / experts, independently across tokens)."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def step_reads(model: torch.nn.Module, name: str, param: torch.Tensor, experts_read: float,
               tokens: int = 1) -> float:
    """Bytes of `param` one decode step of `tokens` tokens reads when they route to `experts_read`
    experts (a mean where routing is random): the routed slots picked and every fused shared one of
    a stacked expert tensor, one row per token of the embedding, all of anything else."""
    kind = param_kind(model, name, param)
    if kind in ("experts", "mtp_experts"):
        slot, routed, shared = expert_slots(model, param)
        return slot * (min(experts_read, routed) + shared)
    if kind == "embedding":
        return tokens * param.shape[-1] * param.element_size()
    return nbytes(param)


def decode_weight_bytes(model: torch.nn.Module, batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens reads under uniform routing (its floor's
    weights; a model's MTP layer, if loaded, counted as read)."""
    cfg = model.config
    touched = expected_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok, batch)
    return sum(step_reads(model, name, p, touched, batch) for name, p in model.named_parameters())


def active_values(model: torch.nn.Module) -> int:
    """Weight values one token multiplies by in a forward (a forward's FLOPs per token / 2): every
    matrix outside the embedding and the LM head, of stacked experts the `num_experts_per_tok` routed
    slots it picks and every fused shared one; FP8 scales and vectors left out."""
    top_k = model.config.num_experts_per_tok
    total = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.endswith("_scale_inv"):
            continue
        kind = param_kind(model, name, p)
        if kind in ("experts", "mtp_experts"):
            _, routed, shared = expert_slots(model, p)
            total += p.numel() // p.shape[0] * (min(top_k, routed) + shared)
        elif kind not in ("lm_head", "embedding"):
            total += p.numel()
    return total
