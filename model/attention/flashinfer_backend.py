"""Attention backend "flashinfer": FlashInfer's Hopper MLA decode where it wins, our Triton elsewhere.

    mla_decode   FlashInfer's sm90 kernel (`kernels/flashinfer_mla.py`) for the batch shapes in
                 `MLADecodeRoute` (`kernels/mla_decode_route.py`, with the rule by which "auto"
                 picks this backend), planned once per batch and shared by all layers through
                 `batch.derived`; the Triton kernel for the rest (it wins at small batches, where
                 FlashInfer's fixed planning and launch cost dominates), for fp32, and for
                 widths other than DeepSeek's 512 + 64 (the tiny test models).
    everything else  the Triton backend's (MHA prefill, prefix merges, mla_extend).

Built only where FlashInfer imports and the GPU is Hopper: `ATTENTION_BACKENDS.build("flashinfer")`
is a UserError elsewhere, and "auto" never picks it there (nor where its start-up check fails,
model/jit_backends.py).

CUDA graphs: the plan is host work on each batch's lengths, which a replayed graph would skip.
A graph's static batch (`batch.graph_bucket`) therefore uses one `GraphMLAPlan` per bucket and
shape, built at capture over buffers reserved for the bucket's whole page table, and the graph
runner calls `prepare_replay` with the step's real lengths and pages before each replay.
Eager batches plan wrappers lent by a `WrapperPool` (one per device), built once and reused.
"""
from __future__ import annotations

from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.attention.backend import ATTENTION_BACKENDS
from deepseek_pd.model.attention.triton_backend import TritonAttentionBackend, check_latent_rank
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.kernels.flashinfer_mla import (
    SUPPORTED_WIDTHS, GraphMLAPlan, MLAPlan, WrapperPool, eager_wrapper_pool, flashinfer_mla_available, plan_decode,
)
from deepseek_pd.model.kernels.mla_decode_route import MLADecodeRoute

_PLAN = "flashinfer_mla_plan"


@ATTENTION_BACKENDS.register("flashinfer")
class FlashInferAttentionBackend(TritonAttentionBackend):
    cuda_graph_safe = True  # graph batches re-plan before each replay (module docstring)
    device_lengths = False  # it plans from the host lengths

    def __init__(self, route: MLADecodeRoute | None = None) -> None:
        if not flashinfer_mla_available():
            raise UserError("attention backend 'flashinfer' needs the flashinfer package and a Hopper (sm90) GPU; "
                            "use 'triton'")
        super().__init__()
        self.route = route or MLADecodeRoute()
        self._graph_plans: dict[tuple, GraphMLAPlan] = {}  # (bucket, heads, scale, dtype) -> plan
        self._eager_wrappers: dict[torch.device, WrapperPool] = {}  # eager batches' wrappers, reused

    def mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        heads = q_latent.shape[1]
        if q_latent.dtype not in (torch.bfloat16, torch.float16) or (kv_lora_rank, q_pe.shape[-1]) != SUPPORTED_WIDTHS \
                or not self.route.uses_library(heads, batch.batch_size):
            return super().mla_decode(q_latent, q_pe, kv_cache, batch, kv_lora_rank, scale)
        check_latent_rank(q_latent, q_pe, kv_cache, kv_lora_rank)
        key = (_PLAN, heads, scale, q_latent.dtype)  # one plan per batch for all layers of this shape
        plan = batch.derived.get(key)
        if plan is None:
            plan = self._graph_plan(batch, heads, kv_lora_rank, q_pe.shape[-1], kv_cache.shape[1], scale,
                                    q_latent.dtype) if batch.graph_bucket is not None else \
                plan_decode(batch.page_table, batch.seq_lens, heads, kv_lora_rank, q_pe.shape[-1],
                            kv_cache.shape[1], scale, q_latent.dtype, page_lists=batch.page_lists,
                            pool=self._eager_pool(q_latent.device))
            batch.derived[key] = plan
        return plan.run(q_latent, q_pe, kv_cache)

    def _eager_pool(self, device: torch.device) -> WrapperPool:
        pool = self._eager_wrappers.get(device)
        if pool is None:
            pool = self._eager_wrappers[device] = eager_wrapper_pool(device)
        return pool

    def _graph_plan(self, batch: ForwardBatch, heads: int, rank: int, rope: int, page_size: int, scale: float,
                    dtype: torch.dtype) -> MLAPlan:
        """The bucket's plan, planned in the warm-up runs for the batch the graph is captured with;
        replays re-plan it in `prepare_replay`. Never planned while capturing: planning copies host
        metadata to the device, which a capture would either refuse (pageable memory) or record."""
        key = (batch.graph_bucket, heads, scale, dtype)
        graph_plan = self._graph_plans.get(key)
        if graph_plan is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("FlashInfer MLA: a graph must be warmed up (planned) before it is captured")
            graph_plan = GraphMLAPlan(batch.batch_size, batch.page_table.numel(), heads, rank, rope, page_size,
                                      scale, dtype, batch.page_table.device)
            self._graph_plans[key] = graph_plan
        if not torch.cuda.is_current_stream_capturing():
            graph_plan.replan(batch.seq_lens, batch.page_lists)
        return graph_plan.plan

    def prepare_replay(self, bucket: int, seq_lens: Sequence[int], page_lists: Sequence[Sequence[int]]) -> None:
        """Before a replay of `bucket`'s graph: re-plan its FlashInfer plans for this step (host work)."""
        for (plan_bucket, *_), graph_plan in self._graph_plans.items():
            if plan_bucket == bucket:
                graph_plan.replan(seq_lens, page_lists)
