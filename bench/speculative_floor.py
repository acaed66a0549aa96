"""What a speculative step must read from HBM against a plain decode step: the bound on issue 22's
speed-up once decode runs at its weight-read floor.

A decode step at small batch reads every weight it touches once. Routed experts are the exception
that decides speculation's bound: a plain step of B rows reads the experts that B tokens route to,
while the verify of k drafts reads those of B * (k + 1) tokens, and the draft chain and its catch-up
read the MTP layer's again. With independent routing (random weights route each token to `top_k`
of `E` experts uniformly), n tokens touch, per MoE layer,

    distinct(n) = E * (1 - (1 - top_k / E) ** n)        experts on average,

so at batch 1 with V2-Lite's 64 experts top-6 a plain step reads 6 experts a layer and a k = 2 verify
16.4. Real checkpoints route consecutive tokens to overlapping experts more often than this, so the
figure is the bound for the random-weight benches and a pessimistic one for served models.

The step model (counting what `SpeculativeDecoder` runs, model/speculative/decoder.py):
    plain(B)    = dense + lm_head + MoE layers x distinct(B) experts            (+ KV, ignored: the
    spec(B, k)  = verify: dense + lm_head + MoE layers x distinct(B (k + 1))      same in both at a
                + k drafts: MTP layer (its dense part, distinct(B) experts) + lm_head    context that
                + catch-up: MTP layer over B (k + 1) tokens                         fits the cache)
and `floor_speedup(A) = A * plain / spec`: the speed-up at accept length A when both steps run at
their weight-read floor. KV reads are left out: at the small batches where the bound bites they
are a few percent of the weights (V2-Lite, 1k context: 0.03 GB of 4.9 GB).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from param_reads import expected_distinct, expert_slots, nbytes, param_kind  # noqa: E402,F401 (re-exported)


@dataclass(frozen=True)
class StepBytes:
    """A model's weight bytes, split the way a decode step reads them."""
    dense: int          # every main-model weight outside the routed experts and the LM head
    lm_head: int
    expert: int         # one routed expert of one MoE layer (all its stacked tensors' slices)
    moe_layers: int
    mtp_dense: int      # the MTP layer outside its routed experts (0 without one)
    mtp_moe: bool       # whether the MTP layer routes (V3's does)
    experts: int
    top_k: int

    def plain(self, batch: int) -> float:
        return self.dense + self.lm_head + self.moe_layers * expected_distinct(
            self.experts, self.top_k, batch) * self.expert

    def speculative(self, batch: int, k: int) -> float:
        def mtp(tokens: int) -> float:
            return self.mtp_dense + (expected_distinct(self.experts, self.top_k, tokens) * self.expert
                                     if self.mtp_moe else 0.0)
        verify = self.dense + self.lm_head + self.moe_layers * expected_distinct(
            self.experts, self.top_k, batch * (k + 1)) * self.expert
        return verify + k * (mtp(batch) + self.lm_head) + mtp(batch * (k + 1))

    def floor_speedup(self, batch: int, k: int, accept_length: float) -> float:
        return accept_length * self.plain(batch) / self.speculative(batch, k)


def step_bytes(model: torch.nn.Module, experts: int, top_k: int) -> StepBytes:
    """`StepBytes` of a built model (`DeepseekForCausalLM`, its MTP layer under `mtp.` if loaded),
    each parameter by its kind (bench/param_reads.py): stacked expert tensors are split per slot,
    fused shared experts' slots read every step like the dense weights."""
    dense = lm_head = expert_total = mtp_dense = 0
    moe_layers: set[str] = set()
    mtp_moe = False
    for name, p in model.named_parameters():
        kind = param_kind(model, name, p)
        if kind == "lm_head":
            lm_head += nbytes(p)
        elif kind in ("experts", "mtp_experts"):
            slot, _, shared = expert_slots(model, p)
            if kind == "mtp_experts":  # its routed experts are read as the main layers' (one size)
                mtp_moe = True
                mtp_dense += shared * slot
            else:
                moe_layers.add(name.split(".mlp.experts.")[0])
                expert_total += slot
                dense += shared * slot
        elif kind == "mtp_dense":
            mtp_dense += nbytes(p)
        elif kind == "dense":  # (an embedding: a step reads one row per token, nothing here)
            dense += nbytes(p)
    per_expert = expert_total // max(1, len(moe_layers))
    return StepBytes(dense=dense, lm_head=lm_head, expert=per_expert, moe_layers=len(moe_layers),
                     mtp_dense=mtp_dense, mtp_moe=mtp_moe, experts=experts, top_k=top_k)


def floor_rows(bytes_: StepBytes, batches: list[int], draft_steps: list[int],
               accept_lengths: tuple[float, ...]) -> list[dict]:
    """Per batch: the plain step's bytes, each k's speculative bytes and their ratio, and the
    speed-up at the floor for each accept length the k can reach (A <= k + 1)."""
    rows = []
    for batch in batches:
        row: dict = {"batch": batch, "plain_gb": round(bytes_.plain(batch) / 1e9, 3),
                     "experts_read_plain": round(expected_distinct(bytes_.experts, bytes_.top_k, batch), 1)}
        for k in draft_steps:
            row[f"spec{k}_gb"] = round(bytes_.speculative(batch, k) / 1e9, 3)
            row[f"spec{k}_over_plain"] = round(bytes_.speculative(batch, k) / bytes_.plain(batch), 3)
            row[f"experts_read_verify{k}"] = round(expected_distinct(bytes_.experts, bytes_.top_k, batch * (k + 1)), 1)
            for a in accept_lengths:
                if a <= k + 1:
                    row[f"spec{k}_floor_speedup_at_{a}"] = round(bytes_.floor_speedup(batch, k, a), 3)
        rows.append(row)
    return rows
