"""Attention backend "flashmla": FlashMLA's Hopper MLA decode where its route sends a batch, our
Triton elsewhere.

    mla_decode   FlashMLA's sm90 dense kernel (`kernels/flashmla_mla.py`) for the decode batches
                 `FLASHMLA_ROUTE` names (`kernels/mla_decode_route.py`), at DeepSeek's 512 + 64
                 widths, bf16, 64-token pages; one `MLADecodeCall` per batch in `batch.derived`,
                 whose scheduling metadata the first layer computes and the rest reuse. Triton's
                 kernel for the rest (one sequence, other widths, dtypes or page sizes).
    everything else  the Triton backend's (MHA prefill, prefix merges, mla_extend).

Built only where `flash_mla` imports on a Hopper GPU and passes its start-up check: elsewhere
`ATTENTION_BACKENDS.build("flashmla")` is a UserError that says why. Only when named ("auto" does
not pick it until its route is measured), and `RunnerConfig` refuses it up front where it cannot
run (`named_library_blocker`: no CUDA, not installed, a page size other than 64).

CUDA graphs: capturable as it is. FlashMLA plans nothing on the host; the metadata kernel is part
of the captured forward and reads the static lengths on each replay (kernels/flashmla_mla.py).
"""
from __future__ import annotations

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.attention.backend import ATTENTION_BACKENDS
from deepseek_pd.model.attention.triton_backend import TritonAttentionBackend, check_latent_rank, decode_metadata
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.kernels.flashmla_mla import (
    SUPPORTED_DTYPES, MLADecodeCall, flashmla_available, flashmla_blocker,
)
from deepseek_pd.model.kernels.mla_decode_route import (
    FLASHMLA_PAGE_SIZE, FLASHMLA_ROUTE, FLASHMLA_WIDTHS, MLADecodeRoute,
)

_CALL = "flashmla_decode_call"


@ATTENTION_BACKENDS.register("flashmla")
class FlashMLAAttentionBackend(TritonAttentionBackend):
    cuda_graph_safe = True  # no host plan: the metadata kernel is captured with the forward
    device_lengths = True  # FlashMLA and Triton both read the lengths on the device

    def __init__(self, route: MLADecodeRoute | None = None) -> None:
        if not flashmla_available():
            why = flashmla_blocker() or "it needs a Hopper (sm90) GPU and must pass its start-up check (logged)"
            raise UserError(f"attention backend 'flashmla' cannot run here: {why}; use 'auto' or 'triton'")
        super().__init__()
        self.route = route or FLASHMLA_ROUTE

    def uses_flashmla(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      kv_lora_rank: int, batch_size: int) -> bool:
        """Whether this decode goes to FlashMLA: a shape its kernel takes, at a batch its route sends."""
        return (q_latent.dtype in SUPPORTED_DTYPES and (kv_lora_rank, q_pe.shape[-1]) == FLASHMLA_WIDTHS
                and kv_cache.shape[1] == FLASHMLA_PAGE_SIZE and self.route.uses_library(q_latent.shape[1], batch_size))

    def mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        if not self.uses_flashmla(q_latent, q_pe, kv_cache, kv_lora_rank, batch.batch_size):
            return super().mla_decode(q_latent, q_pe, kv_cache, batch, kv_lora_rank, scale)
        check_latent_rank(q_latent, q_pe, kv_cache, kv_lora_rank)
        heads = q_latent.shape[1]
        key = (_CALL, heads, scale)  # one call per batch and shape: its metadata shared by all layers
        call = batch.derived.get(key)
        if call is None:
            table, seq_lens, _ = decode_metadata(batch)
            call = batch.derived[key] = MLADecodeCall(table, seq_lens, heads, scale)
        return call.run(q_latent, q_pe, kv_cache)
