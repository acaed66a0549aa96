"""The attention kernel interface and its registry.

The MLA layer (`mla.py`) owns the weights and the three methods; a backend supplies the inner
attention kernels. The torch reference (`torch_backend.py`) is the oracle for faster ones
(Triton in `model/kernels/`, FlashMLA/FlashInfer when importable). All shapes are ragged: tokens
of all sequences packed along the first axis, split by host offsets.

`lse` is the natural-log log-sum-exp of the scaled scores per (token, head), `-inf` for a token
that saw no keys; `merge_states` combines two partial results exactly.
"""
from __future__ import annotations

from typing import Protocol

import torch

from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.registry import Registry


class AttentionBackend(Protocol):
    def mha_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_offsets: tuple[int, ...],
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence, q[i] attends k/v[0..i] of the same sequence. q,k `[T,H,Dqk]`, v `[T,H,Dv]`."""

    def mha_cross(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_offsets: tuple[int, ...],
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
