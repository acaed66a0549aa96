"""Attention backend "triton": the Triton absorbed-MLA decode kernel; extend paths from the torch backend.

Decode (`mla_decode`) runs all sequences of the batch in one launch (plus a small combine), over a
`[batch, max_pages]` int32 page table and int32 lengths derived once per batch and shared by all
layers through `batch.derived`. Extend (`mha_causal`, `mha_cross`, `merge_states`, `mla_extend`)
is delegated to `TorchAttentionBackend` for now; a Triton prefill kernel is the next step.
"""
from __future__ import annotations

import torch

from deepseek_pd.model.attention.backend import ATTENTION_BACKENDS
from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.kernels.checks import require_triton

_DECODE_META = "triton_decode_meta"


def decode_metadata(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(page_table int32, seq_lens int32, host max seq len), built once per batch."""
    if _DECODE_META not in batch.derived:
        batch.derived[_DECODE_META] = (batch.page_table.to(torch.int32).contiguous(),
                                       batch.seq_lens_t.to(torch.int32).contiguous(), max(batch.seq_lens))
    return batch.derived[_DECODE_META]


@ATTENTION_BACKENDS.register("triton")
class TritonAttentionBackend:
    def __init__(self) -> None:
        require_triton("attention backend 'triton'")
        from deepseek_pd.model.kernels.mla_decode import mla_decode

        self._mla_decode = mla_decode
        reference = TorchAttentionBackend()
        self.mha_causal = reference.mha_causal
        self.mha_cross = reference.mha_cross
        self.merge_states = reference.merge_states
        self.mla_extend = reference.mla_extend

    def mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        if kv_cache.shape[-1] != kv_lora_rank + q_pe.shape[-1] or q_latent.shape[-1] != kv_lora_rank:
            raise ValueError(f"kv_lora_rank {kv_lora_rank} does not fit q_latent {tuple(q_latent.shape)} / "
                             f"kv_cache {tuple(kv_cache.shape)}")
        page_table, seq_lens, max_len = decode_metadata(batch)
        # The kernel takes any row strides but a unit stride along the feature axis.
        q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
        q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
        return self._mla_decode(q_latent, q_pe, kv_cache, page_table, seq_lens, max_len, scale)
