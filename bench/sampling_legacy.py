"""The sampler as it was before issue 7 (commit ad12657), frozen as the baseline of bench/sampling.py.

Per call it builds its parameter tensors from Python lists, reads the greedy rows back to the
host (`.nonzero().tolist()`), and draws each seeded row with its own `torch.Generator`, one
`torch.multinomial` per row. Not used by the serving code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from deepseek_pd.model.sampling.ops import truncation_mask
from deepseek_pd.model.sampling.params import SamplingParams


@dataclass
class LegacyRow:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_mask: torch.Tensor | None
    output_counts: torch.Tensor | None

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: Sequence[int], vocab: int, device) -> "LegacyRow":
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        mask = counts = None
        if params.repetition_penalty != 1.0:
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            mask[torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        if (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                or params.presence_penalty != 0.0):
            counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        return cls(params, generator, mask, counts)

    def append(self, token_id: int) -> None:
        if self.output_counts is not None:
            self.output_counts[token_id] += 1


def _apply_penalties(logits: torch.Tensor, rows: Sequence[LegacyRow]) -> torch.Tensor:
    chosen = [i for i, s in enumerate(rows) if s.output_counts is not None]
    if not chosen:
        return logits
    logits = logits.clone()
    index = torch.tensor(chosen, device=logits.device)
    counts = torch.stack([rows[i].output_counts for i in chosen])
    sub = logits[index]
    params = [rows[i].params for i in chosen]
    rep = torch.tensor([p.repetition_penalty for p in params], device=logits.device).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], device=logits.device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=logits.device).unsqueeze(1)
    seen = counts > 0
    prompt = torch.stack([rows[i].prompt_mask if rows[i].prompt_mask is not None
                          else torch.zeros_like(seen[0]) for i in chosen])
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen | prompt, penalised, sub)
    logits[index] = sub - freq * counts - pres * seen.to(sub.dtype)
    return logits


def legacy_sample(logits: torch.Tensor, rows: Sequence[LegacyRow],
                  fallback: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids, logprobs) of the old `Sampler.sample`."""
    logits = _apply_penalties(logits.float(), rows)
    vocab, device = logits.shape[1], logits.device
    greedy = torch.tensor([s.params.greedy for s in rows], device=device)
    temperature = torch.tensor([1.0 if s.params.greedy else s.params.temperature for s in rows],
                               device=device).unsqueeze(1)
    fp32_max = torch.finfo(torch.float32).max
    log_probs = torch.log_softmax((logits / temperature).clamp(-fp32_max, fp32_max), dim=-1)
    token_ids = logits.argmax(dim=-1)
    sampled_rows = (~greedy).nonzero().flatten().tolist()
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=device)
        params = [rows[i].params for i in sampled_rows]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = log_probs[index].exp()
        if any(0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            probs = probs.masked_fill(~truncation_mask(probs, top_k, top_p, min_p), 0.0)
        shared = [j for j, i in enumerate(sampled_rows) if rows[i].generator is None]
        if shared:
            draws = torch.multinomial(probs[shared], 1, generator=fallback).squeeze(1)
            token_ids[index[shared]] = draws
        for j, i in enumerate(sampled_rows):
            if rows[i].generator is not None:
                token_ids[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
    chosen = log_probs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return token_ids, chosen
