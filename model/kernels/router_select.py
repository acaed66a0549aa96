"""The MoE router after its GEMM in one Triton launch: scoring, grouped top-k, the weights' finish,
and the fused shared experts' ids — ~7 to ~15 torch launches per MoE layer in `moe/topk.py`.

One program per token holds the row of router logits as a `[groups, experts per group]` tile
(expert e = g * per_group + j; greedy is one group), and does what `DeepseekMoE.select_experts`
does with torch ops (`moe/topk.py` is the oracle and says what each method means):
    scores      softmax over the row, or sigmoid: bit for bit torch's on CUDA (libdevice's exp, IEEE
                division, softmax's sum in the order of torch's one-warp kernel, rows of <= 1024)
    groups      (group_limited_greedy, noaux_tc) each group's max score, or the sum of its top-2
                biased scores; the best `topk_group` groups kept, the others' scores set to 0
                (group_limited_greedy, as HF) or out of the choice (noaux_tc)
    top-k       k rounds of argmax, ties to the lower expert id (torch keeps the first equal ones)
    order       the k slots in the order torch's CUDA top-k (`sorted=False`) writes them: the values
                above the k-th in id order, then those equal to it in id order. The MoE sums its
                slots in their order, so another order changes the sum's last bits (and greedy
                tokens on random weights)
    finish      / (sum + 1e-20) if norm_topk_prob, the sum added slot after slot (`slot_sum`),
                * routed_scaling_factor
    shared      ids first_shared .. first_shared + n - 1 with weight 1 appended (fused shared experts)
Writes weights `[T, k + n]` fp32 and ids `[T, k + n]` int64, the layout `select_experts` returns:
on CUDA the very bits of the torch path. Under the CPU interpreter exp is numpy's, so scores may
differ from torch's CPU ones in the last bit; the ids and their order follow the same rules.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepseek_pd.model.kernels.checks import check_tensor, next_power_of_2

METHOD_CODES = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
SCORING_CODES = {"softmax": 0, "sigmoid": 1}


@triton.jit
def _exp(x, CUDA_MATH: tl.constexpr):
    # On CUDA, libdevice's expf: what torch's kernels call (std::exp), where tl.exp is ex2.approx.
    if CUDA_MATH:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _softmax_sum(logits_ptr, top, num_experts, WARP: tl.constexpr, ITERS: tl.constexpr, LOG_WARP: tl.constexpr,
                 CUDA_MATH: tl.constexpr):
    """sum(exp(logits - top)) added in the order of torch's one-warp softmax (rows of at most 1024):
    lane l adds elements l, l + WARP, ... one after another, then the lanes meet pairwise (l, l + w/2),
    w = WARP, WARP/2, ..., 2 (its xor butterfly). Padding is exp(-inf) = 0, an exact no-op."""
    rows = tl.arange(0, ITERS)
    lanes = tl.arange(0, WARP)
    flat = rows[:, None] * WARP + lanes[None, :]
    e = _exp(tl.load(logits_ptr + flat, mask=flat < num_experts, other=float("-inf")).to(tl.float32) - top,
             CUDA_MATH)
    lane_sum = tl.sum(tl.where(rows[:, None] == 0, e, 0.0), axis=0)  # a sum of one value and zeros: exact
    for it in tl.static_range(1, ITERS):
        lane_sum = lane_sum + tl.sum(tl.where(rows[:, None] == it, e, 0.0), axis=0)
    for level in tl.static_range(LOG_WARP):
        lane_sum = tl.sum(tl.reshape(lane_sum, (2, WARP >> (level + 1))), axis=0)  # [a | b] -> a + b
    return tl.sum(lane_sum, axis=0)  # one value left


@triton.jit
def _router_select_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_l, stride_w, stride_i,
                          top_k, topk_group, num_shared, first_shared, scaling,
                          N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, METHOD: tl.constexpr,
                          SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                          WARP: tl.constexpr, ITERS: tl.constexpr, LOG_WARP: tl.constexpr,
                          CUDA_MATH: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_P)
    expert = g[:, None] * PER_GROUP + j[None, :]
    ok = (g[:, None] < N_GROUP) & (j[None, :] < PER_GROUP)
    eid = tl.where(ok, expert, num_experts)  # padding cells of the tile name no expert
    neg_inf = float("-inf")
    row_ptr = logits_ptr + token * stride_l
    logits = tl.load(row_ptr + expert, mask=ok, other=neg_inf).to(tl.float32)
    # Scores bit for bit torch's (moe/topk.py SCORING on CUDA): the same exp, IEEE division, and
    # softmax's sum in its order; near ties then fall the same way.
    if SCORING == 0:
        top = tl.max(tl.max(logits, axis=1), axis=0)
        total = _softmax_sum(row_ptr, top, num_experts, WARP, ITERS, LOG_WARP, CUDA_MATH)
        scores = tl.where(ok, tl.math.div_rn(_exp(logits - top, CUDA_MATH), total), 0.0)
    else:
        scores = tl.where(ok, tl.math.div_rn(tl.full(logits.shape, 1.0, tl.float32),
                                             1.0 + _exp(-logits, CUDA_MATH)), 0.0)
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
            top_group = tl.max(group_score, axis=0)
            pick = tl.min(tl.where(group_score == top_group, g, BLOCK_G), axis=0)
            kept = kept | (g == pick)
            group_score = tl.where(g == pick, neg_inf, group_score)
        if METHOD == 1:
            choice = tl.where(ok, tl.where(kept[:, None], scores, 0.0), neg_inf)
        else:
            choice = tl.where(kept[:, None] & ok, choice, neg_inf)
    # The set: k rounds of argmax, ties to the lower expert id (as torch's top-k keeps the first
    # equal ones); `kth` is the last value taken.
    remaining = choice
    chosen = eid < 0
    kth = tl.max(tl.max(choice, axis=1), axis=0)
    for _ in range(0, top_k):
        kth = tl.max(tl.max(remaining, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(remaining == kth, eid, num_experts), axis=1), axis=0)
        chosen = chosen | (eid == pick)
        remaining = tl.where(eid == pick, neg_inf, remaining)
    # The order: torch's CUDA top-k (sorted=False) writes the values above the k-th in id order,
    # then those equal to it in id order; the MoE sums its slots in this order.
    order_key = tl.where(chosen, eid + tl.where(choice == kth, num_experts, 0), 2 * num_experts)
    value = scores if METHOD == 2 else choice  # noaux_tc weighs by the unbiased score
    slots = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_id = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for slot in range(0, top_k):
        key = tl.min(tl.min(order_key, axis=1), axis=0)
        hit = order_key == key
        chosen_w = tl.where(slots == slot, tl.sum(tl.sum(tl.where(hit, value, 0.0), axis=1), axis=0), chosen_w)
        chosen_id = tl.where(slots == slot, (key % num_experts).to(tl.int64), chosen_id)
        order_key = tl.where(hit, 2 * num_experts, order_key)
    if NORM:  # moe/topk.py `slot_sum`: the slots added one after another
        total_w = tl.sum(tl.where(slots == 0, chosen_w, 0.0), axis=0)
        for slot in range(1, top_k):
            total_w = total_w + tl.sum(tl.where(slots == slot, chosen_w, 0.0), axis=0)
        chosen_w = tl.math.div_rn(chosen_w, tl.zeros((BLOCK_K,), tl.float32) + (total_w + 1e-20))
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
    # torch's softmax row as one warp holds it: min(next power of 2, 32) lanes (2 at least: no one-wide axis).
    warp = max(2, min(next_power_of_2(num_experts), 32))
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
        HAS_BIAS=bias is not None and method == "noaux_tc", NORM=bool(norm_topk_prob),
        WARP=warp, ITERS=max(1, next_power_of_2(num_experts) // warp), LOG_WARP=warp.bit_length() - 1,
        CUDA_MATH=logits.is_cuda, num_warps=4)
    return weights, ids
