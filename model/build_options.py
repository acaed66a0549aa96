"""`BuildOptions`: how to build the model (not what the model is — that is `ModelConfig`).

Frozen and resolved ("auto" already decided) before the model is constructed; passed down the
constructors. Backends named here are looked up in their registries once, at build time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.eplb.expert_location import ExpertLocation
from deepseek_pd.model.distributed.dispatch_mode import DispatchConfig
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.distributed.tbo_rules import TboRules
from deepseek_pd.model.runner_rules import range_blocker


@dataclass(frozen=True)
class BuildOptions:
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    attention_backend: str = "torch"
    moe_backend: str = "torch"
    dispatcher: str = "local"
    # The EP dispatcher's layout per step (normal / low_latency / auto) and low-latency capacity.
    dispatch: DispatchConfig = DispatchConfig()
    # Shared experts appended to the routed experts as always-selected experts of weight 1
    # (SGLang's fusion): 0 (separate shared MLP) or exactly n_shared_experts.
    num_fused_shared_experts: int = 0
    # Cached-prefix tokens up-projected per MHA_CHUNKED_KV step (bounds the K/V working set).
    prefix_chunk_size: int = 8192
    # Expert parallelism: this rank's EP size/rank and process group (routed experts are sharded
    # by it; attention is data parallel). ep_size > 1 needs an EP dispatcher (all_to_all, deepep).
    parallel: ParallelInfo = ParallelInfo()
    # Redundant experts / a static placement (model/eplb/expert_location.py): which logical expert
    # each physical slot of each MoE layer holds. None: slot j is expert j, no replicas.
    expert_location: ExpertLocation | None = None
    # Two-batch overlap: split each batch into two micro-batches and interleave their layer ops
    # (model/distributed/tbo.py) so one micro-batch's dispatch/combine hides behind the other's compute.
    enable_tbo: bool = False
    # When and where TBO splits a batch (model/distributed/tbo_rules.py; the `tbo_*` engine options).
    tbo_rules: TboRules = TboRules()
    # FP8 checkpoints: keep the block-scaled FP8 weights in FP8 and multiply them with this backend
    # (`fp8_linear.FP8_GEMM_BACKENDS`, and `moe.experts.MOE_BACKENDS` of the same name: "torch", "triton");
    # None dequantises them to `dtype` at load.
    fp8_backend: str | None = None
    # RMSNorm (+ residual) and RoPE + latent-cache write (`norm_rope.NORM_ROPE_BACKENDS`).
    norm_rope_backend: str = "torch"
    # Build the checkpoint's MTP layer (model/speculative/mtp.py), the speculative draft model; its latent KV
    # is one more layer of the KV pool.
    mtp: bool = False
    # `--deterministic` on CUDA: every reduction a row takes part in has an order that depends on
    # that row alone (model/batch_invariant.py; the "*_invariant" attention and MoE backends), so
    # greedy outputs do not depend on what else is in the batch (docs/deterministic.md). Off CUDA
    # the runner runs each sequence alone instead (`RunnerConfig.invariant_kernels`).
    deterministic: bool = False
    # Batch-1 decode fusions (issue 21): a one-token batch's MoE in two launches without the sort
    # (`kernels/moe_single_token.py`, "triton" MoE backend, experts in the model dtype) and the
    # router's scoring + top-k + weights + fused shared ids in one launch (`kernels/router_select.py`),
    # and MLA's kv_a norm inside the rope + cache-write launch (`kernels/rope_cache.py`).
    # Off: the general paths (the bench's baseline, bench/decode_bs1_gpu.py).
    small_batch_fusions: bool = False

    def __post_init__(self) -> None:
        if (blocker := range_blocker(prefix_chunk_size=self.prefix_chunk_size,
                                     num_fused_shared_experts=self.num_fused_shared_experts)) is not None:
            raise UserError(blocker)
