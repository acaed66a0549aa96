"""The attention kernel interface and its registry.

The MLA layer (`mla.py`) owns the weights and the three methods; a backend supplies the inner
attention kernels. The torch reference (`torch_backend.py`) is the oracle for faster ones
(Triton in `model/kernels/`, FlashMLA/FlashInfer when importable). All shapes are ragged: tokens
of all sequences packed along the first axis, split by host offsets.

`lse` is the natural-log log-sum-exp of the scaled scores per (token, head), `-inf` for a token
that saw no keys; `merge_states` combines two partial results exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

import torch

from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.registry import Registry


@dataclass(frozen=True)
class RopeSplit:
    """MLA's queries or keys as their two parts, not concatenated: `nope` `[N, H, n]` and `rope`
    `[N, H, r]`, or for keys `[N, r]` (one rotated row for all heads). Its value is `joined()`,
    `[N, H, n + r]`; a backend whose kernel reads the parts where they are spares that copy.

    Example: RopeSplit(q_nope, q_pe).joined() == torch.cat([q_nope, q_pe], -1).
    """

    nope: torch.Tensor
    rope: torch.Tensor

    def joined(self) -> torch.Tensor:
        rope = self.rope if self.rope.dim() == 3 else self.rope.unsqueeze(1).expand(-1, self.nope.shape[1], -1)
        return torch.cat([self.nope, rope], dim=-1)


QK = Union[torch.Tensor, RopeSplit]


def joined(x: QK) -> torch.Tensor:
    """A query or key tensor, from itself or its `RopeSplit`."""
    return x.joined() if isinstance(x, RopeSplit) else x


class AttentionBackend(Protocol):
    # True: MLA extend and decode take every sequence's length from the device (`positions`,
    # `seq_lens_t`), the host lengths only bounding the work, so a batch may be built from upper
    # bounds and its lengths filled in on the device (model/speculative/future_positions.py).
    device_lengths: bool

    def mha_causal(self, q: QK, k: QK, v: torch.Tensor, qo_offsets: tuple[int, ...],
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence, q[i] attends k/v[0..i] of the same sequence. q,k `[T,H,Dqk]` (or their
        `RopeSplit`), v `[T,H,Dv]`."""

    def mha_cross(self, q: QK, k: QK, v: torch.Tensor, qo_offsets: tuple[int, ...],
                  kv_offsets: tuple[int, ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence, every query attends every key of that sequence's kv segment (no mask)."""

    def merge_states(self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                     lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact softmax merge of two partial attentions over disjoint key sets."""

    def mla_extend(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        """Absorbed MLA for new tokens over the paged latent cache (their own KV already written).

        q_latent `[T,H,R]`, q_pe `[T,H,P]`, kv_cache `[num_pages, page_size, R+P]`; the token at
        position p attends cache positions 0..p of its sequence. Returns the latent output `[T,H,R]`.
        """

    def mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        """`mla_extend` for exactly one new token per sequence (the decode fast path)."""


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend")
