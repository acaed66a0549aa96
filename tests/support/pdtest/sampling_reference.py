"""Plain per-token reference implementations of deepseek_pd.model.sampling.sampler's rules, written from
the definitions in its docstring (loops over tokens, Python floats): the oracles of the sampler tests."""
from __future__ import annotations

import math
import random

import torch

from deepseek_pd.model.sampling.params import SamplingParams


def ref_penalised(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    out = list(logits)
    for token in range(len(out)):
        count = output.count(token)
        if token in prompt or count:
            out[token] = out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
        out[token] -= params.frequency_penalty * count
        if count:
            out[token] -= params.presence_penalty
    return out


def ref_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """The final distribution a non-greedy request samples from."""
    scaled = [x / params.temperature for x in logits]
    peak = max(scaled)
    weights = [math.exp(x - peak) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept, mass_before = set(), 0.0
    for rank, token in enumerate(order):
        within_k = params.top_k <= 0 or rank < params.top_k
        within_p = params.top_p >= 1.0 or mass_before <= params.top_p
        above_min = probs[token] >= params.min_p * probs[order[0]]
        if rank == 0 or (within_k and within_p and above_min):
            kept.add(token)
        mass_before += probs[token]
    total_kept = sum(probs[t] for t in kept)
    return [probs[t] / total_kept if t in kept else 0.0 for t in range(len(probs))]


def ref_logprob(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int],
                token: int) -> float:
    """The logprob the sampler reports for `token`: penalised, temperature-scaled (1 when greedy), untruncated."""
    temperature = 1.0 if params.greedy else params.temperature
    scaled = [x / temperature for x in ref_penalised(logits, params, prompt, output)]
    peak = max(scaled)
    return scaled[token] - peak - math.log(sum(math.exp(x - peak) for x in scaled))


def random_params(rng: random.Random, seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_p=rng.choice([1.0, 0.9, 0.5, 0.2]),
        top_k=rng.choice([-1, 0, 1, 3, 10]),
        min_p=rng.choice([0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.5, -0.4]),
        presence_penalty=rng.choice([0.0, 0.7, -1.0]),
        seed=seed,
    )


def assert_frequencies_match(tokens: torch.Tensor, ref: list[float], context) -> None:
    """Per-token frequencies of `tokens` within 5 sigma of `ref`; never a token `ref` excludes."""
    draws, vocab = len(tokens), len(ref)
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    for token in range(vocab):
        if ref[token] == 0:
            assert counts[token] == 0, (context, token)
        else:
            sigma = math.sqrt(draws * ref[token] * (1 - ref[token])) + 1
            assert abs(counts[token] - draws * ref[token]) < 5 * sigma, (context, token, counts, ref)
