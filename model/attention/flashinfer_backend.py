"""Attention backend "flashinfer": FlashInfer's Hopper MLA decode where it wins, our Triton elsewhere.

    mla_decode   FlashInfer's sm90 kernel (`kernels/flashinfer_mla.py`) for the batch shapes in
                 `MLADecodeRoute`, planned once per batch and shared by all layers through
                 `batch.derived`; the Triton kernel for the rest (it wins at small batches, where
                 FlashInfer's fixed planning and launch cost dominates), for fp32, and for
                 widths other than DeepSeek's 512 + 64 (the tiny test models).
    everything else  the Triton backend's (MHA prefill, prefix merges, mla_extend).

Built only where FlashInfer imports and the GPU is Hopper: `ATTENTION_BACKENDS.build("flashinfer")`
is a UserError elsewhere, and "auto" never picks it there.

CUDA graphs: the plan is host work on each batch's lengths, which a replayed graph would skip, so
this backend is not capturable yet (`cuda_graph_safe = False`): decode runs eagerly with it. Re-planning
before each replay into the graph's fixed buffers (FlashInfer's `use_cuda_graph=True`) is the next step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.attention.backend import ATTENTION_BACKENDS
from deepseek_pd.model.attention.triton_backend import TritonAttentionBackend, check_latent_rank
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.kernels.flashinfer_mla import SUPPORTED_WIDTHS, flashinfer_mla_available, plan_decode

_PLAN = "flashinfer_mla_plan"


@dataclass(frozen=True)
class MLADecodeRoute:
    """Which decode batches go to FlashInfer: at least `min_batch_many_heads` sequences when a
    rank holds `many_heads` heads or more (V3: 128), at least `min_batch_few_heads` below that
    (V2-Lite: 16). Measured on one H100 (docs/performance.md, 2026-12-06): at 128 heads FlashInfer
    is 2.8x faster at batch 32 and 4.4x at 128, Triton 2.3x faster at batch 1; at 16 heads, batch
    128, the two are equal.

    Example: route = MLADecodeRoute(); route.uses_flashinfer(128, 1) → False; (128, 32) → True.
    """

    many_heads: int = 64
    min_batch_many_heads: int = 8
    min_batch_few_heads: int = 1 << 30  # never: equal at batch 128, and Triton is capturable

    def uses_flashinfer(self, heads: int, batch: int) -> bool:
        need = self.min_batch_many_heads if heads >= self.many_heads else self.min_batch_few_heads
        return batch >= need


@ATTENTION_BACKENDS.register("flashinfer")
class FlashInferAttentionBackend(TritonAttentionBackend):
    cuda_graph_safe = False  # planning is host work per batch (module docstring)

    def __init__(self, route: MLADecodeRoute | None = None) -> None:
        if not flashinfer_mla_available():
            raise UserError("attention backend 'flashinfer' needs the flashinfer package and a Hopper (sm90) GPU; "
                            "use 'triton'")
        super().__init__()
        self.route = route or MLADecodeRoute()

    def mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        heads = q_latent.shape[1]
        if q_latent.dtype not in (torch.bfloat16, torch.float16) or (kv_lora_rank, q_pe.shape[-1]) != SUPPORTED_WIDTHS \
                or not self.route.uses_flashinfer(heads, batch.batch_size):
            return super().mla_decode(q_latent, q_pe, kv_cache, batch, kv_lora_rank, scale)
        check_latent_rank(q_latent, q_pe, kv_cache, kv_lora_rank)
        key = (_PLAN, heads, scale, q_latent.dtype)  # one plan per batch for all layers of this shape
        plan = batch.derived.get(key)
        if plan is None:
            plan = plan_decode(batch.page_table, batch.seq_lens, heads, kv_lora_rank, q_pe.shape[-1],
                               kv_cache.shape[1], scale, q_latent.dtype, page_lists=batch.page_lists)
            batch.derived[key] = plan
        return plan.run(q_latent, q_pe, kv_cache)
