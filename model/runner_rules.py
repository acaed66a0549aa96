"""The runner's rules on combinations of settings that hold whatever the checkpoint and the device.

Torch-free, so that `serve` (workers/serve/flag_rules.py), through it the operator (a CR's
engineArgs, refused as an InvalidSpec condition instead of a pod that crash-loops), and
`RunnerConfig` (model/runner_config.py) apply the same words. Each function returns why the settings
cannot run together, or None when they can.

Example: `tbo_blocker(tp_size=2)` -> "two-batch overlap (enable_tbo) is not supported with
attention TP (tp_size > 1)"; `tbo_blocker(tp_size=1)` -> None.
"""
from __future__ import annotations

from typing import Mapping

from deepseek_pd.bounds import Bounds, bounds_blocker
from deepseek_pd.choices import not_one_of
from deepseek_pd.model.kv.memory_budget import GpuShare

# `fp8_backend`'s choices (model/quant/fp8_linear.py); the operator's memory plan reads them too.
# "deep_gemm" (DeepGEMM, where installed) is never what "auto" picks; model/jit_backends.py falls back
# from it where it cannot compile.
FP8_BACKEND_CHOICES = ("auto", "dequant", "torch", "triton", "deep_gemm")
# The backends with a batch-invariant version (model/attention/invariant_backends.py, model/moe/invariant_experts.py).
INVARIANT_BACKENDS = ("auto", "torch", "triton")
# Every string setting of `RunnerConfig` and the values it may take. A backend's values are every name
# its registry can hold, installed here or not ("grouped", "deep_gemm" and "deepep" register only where
# their library imports; one that is absent is refused when the model is built, by its registry, or
# replaced by what "auto" picks, model/jit_backends.py). `RunnerConfig` applies them, and through
# `serve`'s engine-option table (workers/serve/engine_option_keys.py) so do the CLI, `up` and the
# operator, before any worker starts. tests/model/test_runner_rules.py checks them against the
# registries, `DispatchMode` and `AttentionMethod`.
RUNNER_CHOICES: Mapping[str, tuple[str, ...]] = {
    "attention_method": ("auto", "mha", "mha_chunked_kv", "mla"),  # model/attention/policy.py
    "attention_backend": ("auto", "torch", "triton", "flashinfer", "flashmla", "torch_invariant",
                          "triton_invariant"),
    "moe_backend": ("auto", "torch", "triton", "grouped", "deep_gemm", "torch_invariant", "triton_invariant"),
    "dispatcher": ("auto", "local", "all_to_all", "deepep"),  # model/moe/dispatcher.py DISPATCHERS
    "dispatch_mode": ("normal", "low_latency", "auto"),  # model/distributed/dispatch_mode.py DispatchMode
    "fp8_backend": FP8_BACKEND_CHOICES,
    "norm_rope_backend": ("auto", "torch", "triton"),  # model/norm_rope.py NORM_ROPE_BACKENDS
}


# Every numeric setting of `RunnerConfig` with a range (but the memory settings': `sizing_blocker`), and its bounds (deepseek_pd/bounds.py). `RunnerConfig`
# applies them, and so do the parts built from it (AttentionPolicy, TboRules, DispatchConfig,
# CudaGraphConfig, BuildOptions) for their other callers; `serve`'s engine-option table carries them, so
# the CLI, `up` and the operator refuse a value out of range before any worker starts.
RUNNER_BOUNDS: Mapping[str, Bounds] = {
    "mha_chunked_kv_threshold": Bounds(0),  # model/attention/policy.py
    "prefix_chunk_size": Bounds(1),
    "num_fused_shared_experts": Bounds(0),
    "low_latency_max_tokens": Bounds(1),  # model/distributed/dispatch_mode.py
    "tbo_min_decode_tokens": Bounds(2, why="two micro-batches of a token each"),  # model/distributed/tbo_rules.py
    "tbo_min_extend_tokens": Bounds(2, why="two micro-batches of a token each"),
    "tbo_token_distribution_threshold": Bounds(0, 0.5),
    "cuda_graph_max_batch": Bounds(1),  # model/graph_inputs.py
    "cuda_graph_max_context": Bounds(1),
    # model/extend_graph_inputs.py: the smallest token bucket is 64 (EXTEND_GRAPH_MIN_TOKENS)
    "extend_graph_max_tokens": Bounds(64, why="the smallest extend-graph bucket is 64 tokens"),
}


def range_blocker(**settings: float) -> str | None:
    """Which of the numeric settings given (`RUNNER_BOUNDS`' names) is out of its range; None when
    none is. Example: `range_blocker(cuda_graph_max_batch=0)` -> "cuda_graph_max_batch must be >= 1, got 0"."""
    return bounds_blocker(RUNNER_BOUNDS, **settings)


def choice_blocker(**settings: str) -> str | None:
    """Which of the string settings given (`RUNNER_CHOICES`' names) is none of its values; None when
    all are. Example: `choice_blocker(moe_backend="tritn")` -> "moe_backend 'tritn' is not one of auto, ..."."""
    for name, value in settings.items():
        if (blocker := not_one_of(name, value, RUNNER_CHOICES[name])) is not None:
            return blocker
    return None


def sizing_blocker(*, page_size: int | None, mem_fraction_static: float | None, mem_headroom_gib: float | None,
                   gpu_workers: int, kv_share: float, ep_num_redundant_experts: int, fp8_backend: str) -> str | None:
    """Which of the settings that size a rank's memory (the KV pool, the headroom, the GPU share, the
    expert slots, how FP8 weights are kept) is out of range; None when none is. The operator's memory
    plan reads the same settings, and `serve`'s flag rules refuse them first. `page_size` None: not
    given (model/kv/page_size.py decides it)."""
    if page_size is not None and page_size < 1:
        return f"page_size must be >= 1, got {page_size}"
    if mem_fraction_static is not None and not 0 < mem_fraction_static <= 1:
        return f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}"
    if mem_headroom_gib is not None and mem_headroom_gib < 0:
        return f"mem_headroom_gib must be >= 0, got {mem_headroom_gib}"
    try:
        GpuShare(gpu_workers, kv_share)
    except ValueError as exc:
        return f"--gpu-workers/--kv-share: {exc}"
    if ep_num_redundant_experts < 0:
        return f"ep_num_redundant_experts must be >= 0, got {ep_num_redundant_experts}"
    return choice_blocker(fp8_backend=fp8_backend)


def tbo_blocker(tp_size: int) -> str | None:
    """Why two-batch overlap cannot run with this attention TP; None when it can."""
    if tp_size > 1:
        return "two-batch overlap (enable_tbo) is not supported with attention TP (tp_size > 1)"
    return None


def graph_settings_blocker(*, record_expert_load: bool, enable_tbo: bool, tp_size: int) -> str | None:
    """Why decode cannot be captured as CUDA graphs with these settings, whatever the backends; None
    when nothing here stops it (`RunnerConfig.cuda_graph_blocker` then asks the device and backends)."""
    if record_expert_load:
        return "expert-load recording (record_expert_load) is not counted in CUDA graph replays"
    if enable_tbo:
        return "CUDA graphs cannot capture two-batch overlap (enable_tbo)"
    if tp_size > 1:
        return "CUDA graphs are not captured with attention TP (tp_size > 1): decode runs eagerly"
    return None


def extend_graph_settings_blocker(*, record_expert_load: bool, enable_tbo: bool, tp_size: int, ep_size: int,
                                  deterministic: bool, speculative_num_steps: int) -> str | None:
    """Why extend cannot be captured as piecewise CUDA graphs (`extend_cuda_graph`,
    model/extend_graph.py) with these settings, whatever the backends; None when nothing here stops
    it (`RunnerConfig.extend_graph_blocker` then asks the device and the backends). Per call, an
    extend of more tokens than the largest bucket runs eagerly instead (`ExtendGraphRunner.extend`)."""
    if record_expert_load:
        return "expert-load recording (record_expert_load) is not counted in CUDA graph replays"
    if enable_tbo:
        return "extend graphs cannot capture two-batch overlap (enable_tbo): its micro-batches follow the batch"
    if tp_size > 1:
        return "extend graphs are not captured with attention TP (tp_size > 1): their collectives run eagerly"
    if ep_size > 1:
        return ("extend graphs are not captured with expert parallelism (ep_size > 1): an extend's EP "
                "dispatch counts its tokens on the host")
    if deterministic:
        return "--deterministic runs its own batch-invariant extend (each row alone off CUDA); run without extend graphs"
    if speculative_num_steps:
        return ("speculative decoding's prefill rounds run extend_hidden (every token's hidden state for the "
                "MTP layer), which extend graphs do not capture; run without speculative_num_steps")
    return None


def deterministic_blocker(*, enable_tbo: bool, tp_size: int, ep_size: int, speculative_num_steps: int,
                          attention_backend: str = "auto", moe_backend: str = "auto",
                          fp8_backend: str = "auto") -> str | None:
    """What these settings do that is not batch-invariant yet (`--deterministic`); None when nothing is."""
    if enable_tbo:
        return "two-batch overlap (enable_tbo) cuts micro-batches by the batch; run without it"
    if tp_size > 1 or ep_size > 1:
        return ("TP/EP collectives sum over ranks in an order NCCL picks by message size; "
                "run with tp_size = ep_size = 1")
    if speculative_num_steps:
        return "speculative verify steps are not batch-invariant yet; run without speculative_num_steps"
    if attention_backend not in INVARIANT_BACKENDS:
        return (f"the attention backend {attention_backend!r} has no batch-invariant version "
                "(torch and triton have); run with attention_backend auto, torch or triton")
    if moe_backend not in INVARIANT_BACKENDS:
        return (f"the MoE backend {moe_backend!r} has no batch-invariant version "
                "(torch and triton have); run with moe_backend auto, torch or triton")
    if fp8_backend not in ("auto", "dequant"):
        return (f"the FP8 GEMM backend {fp8_backend!r} picks its tile by M; "
                "use fp8_backend dequant (or auto, which deterministic resolves to dequant)")
    return None
