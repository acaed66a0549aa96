"""Batched token sampling with per-request parameters and per-request seeded generators.

Order of operations per row (SGLang's, so a request samples the same way here and there):
1. penalties on the raw logits:
   - repetition (HF/CTRL rule: positive logits divided, negative multiplied) over tokens of the
     prompt AND the output so far, as vLLM and HF do;
   - frequency (`-= f * count`) and presence (`-= p * [count > 0]`) over the OUTPUT tokens only,
     as OpenAI, vLLM and SGLang define them;
2. greedy rows (temperature below 1e-6, as SGLang, or top_k 1) take the argmax of the penalised logits;
3. the rest: `softmax(logits / temperature)`, then in descending-probability order keep a token if
   - its rank < top_k (top_k -1/0 disables),
   - the mass strictly before it is <= top_p (so the most likely token always survives),
   - its probability >= min_p * the largest probability;
   all three measured on the same (untruncated) distribution, then renormalise and draw.

A request with a seed owns a `torch.Generator`; its draws depend only on its own seed and step,
never on which other requests share the batch. Requests without a seed share the sampler's one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepseek_pd.model.sampling_params import SamplingParams
# Stop conditions live in their own module; re-exported because callers think of them as sampling.
from deepseek_pd.model.stop_checker import Finish, IncrementalDetokenizer, StopChecker  # noqa: F401


@dataclass
class SamplingState:
    """What one request carries between steps: its params, its generator and its token counts."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_mask: torch.Tensor | None = None  # [V] bool, only when repetition_penalty != 1
    output_counts: torch.Tensor | None = None  # [V] float, only when any penalty is active
    num_output_tokens: int = 0

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
               device: torch.device | str = "cpu") -> "SamplingState":
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        state = cls(params, generator)
        if params.repetition_penalty != 1.0:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)
            mask[ids[(ids >= 0) & (ids < vocab_size)]] = True
            state.prompt_mask = mask
        if _uses_output_counts(params):
            state.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        return state

    def append(self, token_id: int) -> None:
        """Records a sampled token so the next step's penalties see it."""
        self.num_output_tokens += 1
        if self.output_counts is not None:
            self.output_counts[token_id] += 1


def _uses_output_counts(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] fp32: log-probability of the chosen token under the penalised,
    # temperature-scaled (before truncation) distribution; greedy rows use temperature 1


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Returns penalised logits (a copy when any row is penalised, else `logits` itself)."""
    rows = [i for i, s in enumerate(states) if s.output_counts is not None]
    if not rows:
        return logits
    logits = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    counts = torch.stack([states[i].output_counts for i in rows])
    sub = logits[index]
    params = [states[i].params for i in rows]
    rep = torch.tensor([p.repetition_penalty for p in params], device=logits.device).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], device=logits.device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=logits.device).unsqueeze(1)
    seen = counts > 0
    prompt = torch.stack([states[i].prompt_mask if states[i].prompt_mask is not None
                          else torch.zeros_like(seen[0]) for i in rows])
    repeated = seen | prompt
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(repeated, penalised, sub)
    sub = sub - freq * counts - pres * seen.to(sub.dtype)
    logits[index] = sub
    return logits


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool, True where a token survives top-k, top-p and min-p (see module docstring)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p >= 1 keeps everything even where fp32 cumsum rounds past 1.0.
    within_p = (mass_before <= top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
    keep_sorted = (ranks < top_k.unsqueeze(1)) & within_p
    keep_sorted &= sorted_probs >= min_p.unsqueeze(1) * sorted_probs[:, :1]
    keep_sorted[:, 0] = True
    keep = torch.empty_like(keep_sorted)
    keep.scatter_(1, order, keep_sorted)
    return keep


@dataclass
class Sampler:
    """Samples one token per row of fp32 logits `[B, V]`; stateless apart from the fallback generator."""

    fallback_generator: torch.Generator | None = field(default=None)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} requests")
        logits = apply_penalties(logits.float(), states)
        batch, vocab = logits.shape
        device = logits.device
        greedy = torch.tensor([s.params.greedy for s in states], device=device)
        temperature = torch.tensor([1.0 if s.params.greedy else s.params.temperature for s in states],
                                   device=device).unsqueeze(1)
        # Clamped: a huge penalty boost (repetition_penalty near 0) must not become inf, whose
        # inf - inf = nan would make multinomial fail every row of the batch.
        fp32_max = torch.finfo(torch.float32).max
        log_probs = torch.log_softmax((logits / temperature).clamp(-fp32_max, fp32_max), dim=-1)
        token_ids = logits.argmax(dim=-1)
        sampled_rows = (~greedy).nonzero().flatten().tolist()
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=device)
            params = [states[i].params for i in sampled_rows]
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            min_p = torch.tensor([p.min_p for p in params], device=device)
            probs = log_probs[rows].exp()
            if any(0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
                probs = probs.masked_fill(~truncation_mask(probs, top_k, top_p, min_p), 0.0)  # sorts: O(V log V)
            # Seeded rows draw from their own generator, one row at a time, so their stream is
            # independent of the batch; the others share one batched draw.
            shared = [j for j, i in enumerate(sampled_rows) if states[i].generator is None]
            if shared:
                draws = torch.multinomial(probs[shared], 1, generator=self.fallback_generator).squeeze(1)
                token_ids[rows[shared]] = draws
            for j, i in enumerate(sampled_rows):
                if states[i].generator is not None:
                    token_ids[i] = torch.multinomial(probs[j], 1, generator=states[i].generator)[0]
        chosen = log_probs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return SampleOutput(token_ids=token_ids, logprobs=chosen)
