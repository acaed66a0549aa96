"""The sampler's tensor steps on a whole batch, per-row parameters as device tensors.

Each function is a fixed handful of kernels whatever the batch size, reads no value back to the
host, and is the rule of deepseek_pd.model.sampling.sampler's docstring in one place.
"""
from __future__ import annotations

import torch

_FP32_MAX = torch.finfo(torch.float32).max


def penalise(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor | None,
             repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Penalised copy of fp32 `logits` `[B, V]`.

    `counts` `[B, V]` are the output-token counts, `prompt_mask` `[B, V]` bool marks prompt tokens
    (None: no row has one), the factors are `[B, 1]`. A row with factors (1, 0, 0) comes out
    bit-identical, so unpenalised rows may share the batch.
    """
    seen = counts > 0
    repeated = seen if prompt_mask is None else seen | prompt_mask
    # HF/CTRL rule: a positive logit is divided, a negative one multiplied.
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(repeated, scaled, logits)
    return logits - frequency * counts - presence * seen.to(logits.dtype)


def scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`logits / temperature` (`[B, 1]`), clamped to finite fp32.

    A huge penalty boost (repetition_penalty near 0) must not become inf, whose inf - inf = nan
    would poison the row's softmax.
    """
    return (logits / temperature).clamp_(-_FP32_MAX, _FP32_MAX)


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool, True where a token survives top-k, top-p and min-p (see module docstring).

    `top_k` `[B]` int (the vocabulary size disables it), `top_p` and `min_p` `[B]` float.
    """
    # Stable, so tied probabilities keep token order and the kept set does not depend on the batch.
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
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


def gumbel(uniforms: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise `-log(-log u)` in place on uniforms in (0, 1); returns it."""
    return uniforms.log_().neg_().log_().neg_()


def choose(scaled: torch.Tensor, noise: torch.Tensor | None, keep: torch.Tensor | None,
           lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens `[B]` int64 and their logprobs `[B]` fp32.

    Gumbel-max: `argmax(scaled + noise)` over the kept tokens draws from `softmax(scaled)`
    restricted to them and renormalised, with no normalisation or cumulative sum (so the draw is
    exact and does not depend on the batch). Rows whose `noise` is 0 take the argmax (greedy).
    The logprob is the chosen token's under the untruncated `log_softmax(scaled)`, i.e.
    `scaled[token] - lse` with `lse = logsumexp(scaled)` `[B]`.
    """
    if noise is None:
        score = scaled if keep is None else scaled.masked_fill(~keep, float("-inf"))
    else:
        score = noise.add_(scaled)
        if keep is not None:
            score.masked_fill_(~keep, float("-inf"))
    tokens = score.argmax(dim=-1)
    chosen = scaled.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, chosen - lse


def top_logprobs(scaled: torch.Tensor, lse: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest logprobs of every row `[B, k]` fp32 (descending) and their token ids `[B, k]`.

    The same arithmetic as `choose`'s logprob (`scaled[token] - lse`), so the sampled token's
    entry in its row's list, when it is there, equals its reported logprob bit for bit. One
    `topk` over the whole batch: `k` is the batch's largest request, callers cut each row.
    """
    values, ids = scaled.topk(k, dim=-1)
    return values - lse.unsqueeze(1), ids
