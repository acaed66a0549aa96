"""A sampling step's results on the host: the one device-to-host layout and what it unpacks into.

A step sends everything it sampled to the host in ONE copy of one float64 tensor `[B, 2 + 2K]`
(float64 holds every token id and every fp32 value exactly):

    column 0          the sampled token id
    column 1          its logprob
    columns 2..2+K    the row's K largest logprobs, descending
    columns 2+K..     their token ids

K is the batch's widest request (`SampleOutput.top_counts`, at most the vocabulary; 0 when no row
asks, and the tensor is then `[B, 2]`). Each row keeps its own count of the K on the host, so rows
without top logprobs cost only their share of the batch's one `topk`.

    out = batch.sample(logits)                 # SampleOutput, on the device
    host = pack(out).cpu()                     # the step's one copy (or HostCopy(pack(out)))
    sampled = unpack(host, out.top_counts)     # SampledTokens
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from deepseek_pd.model.sampling.batch import SampleOutput


@dataclass(frozen=True)
class TopLogprobs:
    """One position's most likely tokens, most likely first (as OpenAI's `top_logprobs`)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class SampledTokens:
    """One step's results for its rows, in row order."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[TopLogprobs | None]  # None where the row asked for no top logprobs


def pack(out: SampleOutput) -> torch.Tensor:
    """`out` as the `[B, 2 + 2K]` float64 device tensor of the module docstring (nothing waits)."""
    columns = [out.token_ids.unsqueeze(1).to(torch.float64), out.logprobs.unsqueeze(1).to(torch.float64)]
    if out.top_ids.shape[1] > 0:
        columns += [out.top_logprobs.to(torch.float64), out.top_ids.to(torch.float64)]
    return torch.cat(columns, dim=1)


def unpack(host: torch.Tensor, top_counts: Sequence[int]) -> SampledTokens:
    """The host tensor from `pack` back into Python values; row i keeps `top_counts[i]` entries."""
    if host.dim() != 2 or host.shape[0] != len(top_counts) or (host.shape[1] - 2) % 2:
        raise ValueError(f"sampled values {tuple(host.shape)} do not match {len(top_counts)} rows")
    width = (host.shape[1] - 2) // 2
    rows = host.tolist()
    tops: list[TopLogprobs | None] = []
    for row, count in zip(rows, top_counts):
        n = min(count, width)
        tops.append(TopLogprobs(tuple(int(t) for t in row[2 + width:2 + width + n]), tuple(row[2:2 + n]))
                    if count > 0 else None)
    return SampledTokens([int(row[0]) for row in rows], [row[1] for row in rows], tops)
