"""The MoE router after its GEMM in one Triton launch: scoring, grouped top-k, the weights' finish,
and the fused shared experts' ids — ~7 to ~15 torch launches per MoE layer in `moe/topk.py`.

One program per token holds the row of router logits as a `[groups, experts per group]` tile
(expert e = g * per_group + j; greedy is one group), and does what `DeepseekMoE.select_experts`
does with torch ops (`moe/topk.py` is the oracle and says what each method means):
    scores      softmax over the row, or sigmoid
    groups      (group_limited_greedy, noaux_tc) each group's max score, or the sum of its top-2
                biased scores; the best `topk_group` groups kept, the others' scores set to 0
                (group_limited_greedy, as HF) or out of the choice (noaux_tc)
    top-k       k rounds of argmax (ties to the lower expert id), best first
    finish      / (sum + 1e-20) if norm_topk_prob, * routed_scaling_factor
    shared      ids first_shared .. first_shared + n - 1 with weight 1 appended (fused shared experts)
Writes weights `[T, k + n]` fp32 and ids `[T, k + n]` int64, the layout `select_experts` returns.
The order of the k routed slots is best-first here and unspecified in torch's (`sorted=False`):
the chosen set is the same; the MoE sums its slots in their order, so sums may differ in the last bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepseek_pd.model.kernels.checks import check_tensor, next_power_of_2

METHOD_CODES = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
SCORING_CODES = {"softmax": 0, "sigmoid": 1}


@triton.jit
def _router_select_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_l, stride_w, stride_i,
                          top_k, topk_group, num_shared, first_shared, scaling,
                          N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, METHOD: tl.constexpr,
                          SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_P)
    expert = g[:, None] * PER_GROUP + j[None, :]
    ok = (g[:, None] < N_GROUP) & (j[None, :] < PER_GROUP)
    eid = tl.where(ok, expert, num_experts)  # padding cells of the tile name no expert
    neg_inf = float("-inf")
    logits = tl.load(logits_ptr + token * stride_l + expert, mask=ok, other=neg_inf).to(tl.float32)
    if SCORING == 0:
        shifted = tl.exp(logits - tl.max(tl.max(logits, axis=1), axis=0))
        shifted = tl.where(ok, shifted, 0.0)
        scores = shifted / tl.sum(tl.sum(shifted, axis=1), axis=0)
    else:
        scores = tl.where(ok, 1.0 / (1.0 + tl.exp(-logits)), 0.0)
    choice = tl.where(ok, scores, neg_inf)
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + expert, mask=ok, other=0.0).to(tl.float32)
    if METHOD != 0:
        # Each group's score: its best (group_limited_greedy) or its two best choices' sum (noaux_tc).
        best = tl.max(choice, axis=1)
        if METHOD == 2:
            first = tl.min(tl.where(choice == best[:, None], j[None, :], BLOCK_P), axis=1)
            rest = tl.where(j[None, :] == first[:, None], neg_inf, choice)
            best = best + tl.max(rest, axis=1)
        group_score = tl.where(g < N_GROUP, best, neg_inf)
        kept = g < 0
        for _ in range(0, topk_group):
            top = tl.max(group_score, axis=0)
            pick = tl.min(tl.where(group_score == top, g, BLOCK_G), axis=0)
            kept = kept | (g == pick)
            group_score = tl.where(g == pick, neg_inf, group_score)
        if METHOD == 1:
            choice = tl.where(ok, tl.where(kept[:, None], scores, 0.0), neg_inf)
        else:
            choice = tl.where(kept[:, None] & ok, choice, neg_inf)
    slots = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_id = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for slot in range(0, top_k):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, eid, num_experts), axis=1), axis=0)
        hit = eid == pick
        if METHOD == 2:  # the unbiased score of the chosen expert
            value = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        else:
            value = top
        chosen_w = tl.where(slots == slot, value, chosen_w)
        chosen_id = tl.where(slots == slot, pick.to(tl.int64), chosen_id)
        choice = tl.where(hit, neg_inf, choice)
    if NORM:
        chosen_w = chosen_w / (tl.sum(tl.where(slots < top_k, chosen_w, 0.0), axis=0) + 1e-20)
    chosen_w = chosen_w * scaling
    shared = slots - top_k
    is_shared = (shared >= 0) & (shared < num_shared)
    chosen_w = tl.where(is_shared, 1.0, chosen_w)
    chosen_id = tl.where(is_shared, (first_shared + shared).to(tl.int64), chosen_id)
    width = top_k + num_shared
    tl.store(weights_ptr + token * stride_w + slots, chosen_w, mask=slots < width)
    tl.store(ids_ptr + token * stride_i + slots, chosen_id, mask=slots < width)


def router_select(logits: torch.Tensor, bias: torch.Tensor | None, method: str, scoring: str, top_k: int,
                  n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                  num_shared: int = 0, first_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[T, E]` fp32 → (weights fp32 `[T, k + num_shared]`, ids int64 `[T, k + num_shared]`):
    `moe/topk.py`'s scoring, method and `finish_weights`, then `num_shared` fused shared experts
    (ids from `first_shared`, weight 1), as `DeepseekMoE.select_experts` returns them."""
    check_tensor("logits", logits, 2, (torch.float32,), logits.device)
    num_tokens, num_experts = logits.shape
    if method not in METHOD_CODES or scoring not in SCORING_CODES:
        raise ValueError(f"unknown top-k method {method!r} or scoring {scoring!r}")
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{num_experts} experts do not split into {n_group} groups keeping {topk_group}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} out of 1..{num_experts}")
    if bias is not None:
        check_tensor("bias", bias, 1, (torch.float32,), logits.device)
    groups = n_group if method != "greedy" else 1
    per_group = num_experts // groups
    width = top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    _router_select_kernel[(num_tokens,)](
        logits, logits if bias is None else bias, weights, ids, num_experts, logits.stride(0), weights.stride(0),
        ids.stride(0), top_k, topk_group, num_shared, first_shared, float(routed_scaling_factor),
        # Blocks of at least 2 (masked): as rope_cache's head block, no one-wide axis to reduce over.
        N_GROUP=groups, PER_GROUP=per_group, BLOCK_G=max(2, next_power_of_2(groups)),
        BLOCK_P=max(2, next_power_of_2(per_group)), BLOCK_K=max(2, next_power_of_2(width)), METHOD=METHOD_CODES[method], SCORING=SCORING_CODES[scoring],
        HAS_BIAS=bias is not None and method == "noaux_tc", NORM=bool(norm_topk_prob), num_warps=4)
    return weights, ids
