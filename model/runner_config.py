"""`RunnerConfig`: how to run a model, every "auto" resolved before any rank starts.

The workers' `serve` resolution (workers/serve/resolution.py), the offline engine and the benches
build one; `ModelRunner` (model/runner.py) runs it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.attention.policy import AttentionPolicy
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.choices import not_one_of
from deepseek_pd.model.config import DTYPE_CHOICES, ModelConfig
from deepseek_pd.model.device import is_cuda, resolve_device
from deepseek_pd.model.distributed.dispatch_mode import (DEFAULT_LOW_LATENCY_MAX_TOKENS, DispatchConfig, DispatchMode,
                                             decode_capturable)
from deepseek_pd.model.eplb.expert_location import ExpertLocation, resolve_expert_location
from deepseek_pd.model.kv.memory_budget import GpuShare
from deepseek_pd.model.kv.page_size import DEFAULT_PAGE_SIZE, auto_page_size
from deepseek_pd.model.kernels.mla_decode_route import AttentionHost, auto_attention_backend, named_library_blocker
from deepseek_pd.model.kv.memory_headroom import default_headroom_gib
from deepseek_pd.model.speculative.rules import check_speculative_num_steps, graph_tokens_per_sequence
from deepseek_pd.model.graph_inputs import CudaGraphConfig
from deepseek_pd.model.runner_rules import (RUNNER_BOUNDS, RUNNER_CHOICES, choice_blocker, deterministic_blocker,
                                            extend_graph_settings_blocker, graph_settings_blocker, range_blocker,
                                            sizing_blocker, tbo_blocker)
from deepseek_pd.model.moe.dispatcher import DISPATCHERS
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.distributed.tbo_rules import DEFAULT_MIN_TOKENS, DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD, TboRules

log = logging.getLogger(__name__)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401  (only whether it imports matters)
    except ImportError:
        return False
    return True


def attention_host(device: str) -> AttentionHost:
    """The machine as attention backend "auto" sees it (model/kernels/mla_decode_route.py), asked
    without creating a CUDA context."""
    from deepseek_pd.model.kernels.flashinfer_mla import flashinfer_mla_blocker
    from deepseek_pd.model.kernels.flashmla_mla import flashmla_blocker

    cuda = is_cuda(device)
    return AttentionHost(cuda, _triton_available(), flashinfer_mla_blocker() if cuda else "no CUDA device",
                         flashmla_blocker(device) if cuda else "no CUDA device")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
DEFAULT_NUM_PAGES = 1024  # the fixed pool when no memory budget sizes it (the CPU default)


def auto_dtype(device: str, model_config: ModelConfig) -> str:
    """What `dtype="auto"` means: float32 on the CPU (any non-CUDA device); on a GPU the checkpoint's
    `torch_dtype`, except bfloat16 for FP8 block-scaled checkpoints (activations, and weights that
    are dequantised at load, are bf16)."""
    if not is_cuda(device):
        return "float32"
    return "bfloat16" if model_config.is_fp8 else model_config.torch_dtype


def default_page_size(model_config: ModelConfig, device: str, dtype: str = "auto") -> int:
    """The KV page size of a worker given none, on this machine (model/kv/page_size.py's rule, the
    host as attention "auto" sees it), logged with the reason; `device` resolved, `dtype` as given."""
    dtype_name = dtype if dtype != "auto" else auto_dtype(device, model_config)
    size, why = auto_page_size(attention_host(device), widths=(model_config.kv_lora_rank, model_config.qk_rope_head_dim),
                               dtype=dtype_name)
    log.info("page size %d tokens (none given: %s)", size, why)
    return size


@dataclass(frozen=True)
class RunnerConfig:
    """How to run a model.

    A library caller may leave `dtype`, the backends and the dispatcher at "auto" (decided when the
    model is built); commands build theirs with `RunnerConfig.resolve`, which decides every "auto"
    (device, dtype, backends, CUDA graphs) before the config is frozen.
    """

    model: str = "tiny"
    dtype: str = "auto"
    device: str = "cpu"  # a concrete torch device; `model.device.resolve_device` turns "auto" into one
    page_size: int = DEFAULT_PAGE_SIZE  # `resolve` decides it when none is given (`default_page_size`)
    # The KV pool: a fixed `num_pages`, or (CUDA, num_pages=None) whatever `mem_fraction_static` of the
    # GPU's total memory leaves after the weights and `mem_headroom_gib` (model/kv/pool_sizing.py);
    # on a GPU `gpu_workers` workers share, `kv_share` of the room their weights leave (memory_budget.py).
    num_pages: int | None = DEFAULT_NUM_PAGES
    mem_fraction_static: float | None = None
    gpu_workers: int = 1
    kv_share: float = 1.0
    # activations and CUDA graphs, inside the budget; None: `headroom_gib`'s default for the graphs
    mem_headroom_gib: float | None = None
    # Bytes the caller allocates beside the pool, inside the budget, kept out of a pool sized by
    # `mem_fraction_static` (serve: a Mooncake staging area, workers/serve/kv_staging.py).
    mem_reserve_bytes: int = 0
    attention_method: str = "auto"  # auto | mha | mha_chunked_kv | mla
    mha_chunked_kv_threshold: int = 256
    prefix_chunk_size: int = 8192
    num_fused_shared_experts: int = 0
    # auto: FlashMLA's sm90 MLA decode where `flash_mla` is built (bf16, page_size 64), else
    # FlashInfer's where it can run and wins at the model's heads per rank (each checked at start-up,
    # else Triton), the Triton kernels on CUDA when Triton imports, else the plain-torch reference
    # (`resolve_attention_backend`, model/kernels/mla_decode_route.py).
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    dispatcher: str = "auto"  # auto: local for ep_size 1, else deepep (when importable on CUDA) or all_to_all
    # The EP layout per step (model/distributed/dispatch_mode.py): normal | low_latency | auto (normal for extend
    # steps, low_latency for decode steps), and the low-latency capacity in tokens per rank per step.
    dispatch_mode: str = "normal"
    low_latency_max_tokens: int = DEFAULT_LOW_LATENCY_MAX_TOKENS
    ep_size: int = 1  # the process group handed to ModelRunner(parallel=...) must have this size
    # Attention TP: MLA heads split over this many ranks running the same batch (ParallelInfo.tp_*).
    tp_size: int = 1
    enable_tbo: bool = False  # two-batch overlap (model/distributed/tbo.py)
    # When TBO splits (model/distributed/tbo_rules.py): one sequence is cut in two chunks when the best cut between
    # sequences leaves a side below this share of the tokens (SGLang's default; 0: never), and the
    # group splits only when its busiest rank has at least this many tokens.
    tbo_token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD
    tbo_min_decode_tokens: int = DEFAULT_MIN_TOKENS
    tbo_min_extend_tokens: int = DEFAULT_MIN_TOKENS
    # EPLB (model/eplb/): R extra physical expert slots per MoE layer (n_routed + R over the EP
    # group), and a placement file saying which logical expert each slot holds (else slot p holds
    # expert p % n_routed).
    ep_num_redundant_experts: int = 0
    init_expert_location: str | None = None
    # Count tokens per expert from the start (`ModelRunner.expert_load`; a worker serves the dump at
    # /expert_load on its metrics port). Replays would not count, so it keeps CUDA graphs off.
    record_expert_load: bool = False
    # Decode by CUDA-graph replay (model/cuda_graph.py) for batches up to cuda_graph_max_batch
    # sequences and contexts up to cuda_graph_max_context tokens; larger ones run eagerly. Needs
    # CUDA and capturable backends (attention "triton", MoE "triton"/"grouped"); takes one KV page.
    # Always a bool here: `RunnerConfig.resolve` decides the default.
    cuda_graph: bool = False
    cuda_graph_max_batch: int = 128
    cuda_graph_max_context: int = 4096
    # Extend (prefill) as piecewise CUDA graphs (model/extend_graph.py): everything between the
    # attention cores captured per token-count bucket (64, 128, .. up to extend_graph_max_tokens),
    # the cores eager. Opt-in until a GPU has timed it (bench/extend_graph_gpu.py); an extend of more
    # tokens runs eagerly; `extend_graph_blocker` says what cannot be captured.
    extend_cuda_graph: bool = False
    extend_graph_max_tokens: int = 2048
    # FP8 checkpoints: "dequant" widens the weights to `dtype` at load; "torch"/"triton" keep them
    # in FP8 with that GEMM backend (model/quant/fp8_linear.py); "auto": triton on CUDA for an FP8
    # checkpoint when Triton imports, else dequant. Ignored for checkpoints that are not FP8.
    fp8_backend: str = "auto"
    norm_rope_backend: str = "auto"  # RMSNorm and RoPE + cache write: auto = triton on CUDA (model/norm_rope.py)
    # Speculative decoding: draft tokens per step from the checkpoint's MTP layer (model/speculative/decoder.py);
    # 0: off, the MTP layer is not loaded.
    speculative_num_steps: int = 0
    # The decode worker chooses 0..speculative_num_steps drafts per step by batch size from step costs
    # measured at start-up and the accept rate so far (model/speculative/policy.py); off: always all.
    speculative_adaptive: bool = False
    # Batch-invariant forward (docs/deterministic.md): the attention and MoE backends become their
    # "*_invariant" versions, dense products `model/batch_invariant.py`, attention "auto" becomes
    # "mha" (the per-batch method choice would follow the batch); what cannot be made invariant
    # yet is refused (`deterministic_blocker`).
    deterministic: bool = False
    # Batch-1 decode fusions (`BuildOptions.small_batch_fusions`): where the MoE backend is "triton"
    # (auto on CUDA; not under `deterministic`); off keeps the general kernels (what
    # bench/decode_bs1_gpu.py compares them with). Opt-in until a GPU has compiled and timed them
    # (bench/decode_bs1_session.sh): no device time was left in the session that wrote them.
    small_batch_fusions: bool = False

    def __post_init__(self) -> None:
        if (blocker := not_one_of("dtype", self.dtype, DTYPE_CHOICES)) is not None:
            raise UserError(blocker)
        if self.device == "auto":
            raise UserError("device 'auto' must be resolved before the runner config is built "
                            "(model.device.resolve_device, or RunnerConfig.resolve)")
        for name in ("cuda_graph", "extend_cuda_graph"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if (blocker := sizing_blocker(page_size=self.page_size, mem_fraction_static=self.mem_fraction_static,
                                      mem_headroom_gib=self.mem_headroom_gib, gpu_workers=self.gpu_workers,
                                      kv_share=self.kv_share, ep_num_redundant_experts=self.ep_num_redundant_experts,
                                      fp8_backend=self.fp8_backend)) is not None:
            raise UserError(blocker)
        if self.num_pages is not None and self.num_pages < 1:
            raise UserError(f"num_pages must be >= 1, got {self.num_pages}")
        self._check_pool_sizing()
        if (blocker := choice_blocker(**{name: getattr(self, name) for name in RUNNER_CHOICES})) is not None:
            raise UserError(blocker)
        if (blocker := range_blocker(**{name: getattr(self, name) for name in RUNNER_BOUNDS})) is not None:
            raise UserError(blocker)
        if self.attention_backend == "flashmla" and \
                (blocker := named_library_blocker("flashmla", attention_host(self.device), self.page_size)) is not None:
            raise UserError(blocker)
        AttentionPolicy(self.attention_method, self.mha_chunked_kv_threshold)  # validates both
        if self.ep_size < 1:
            raise UserError(f"ep_size must be >= 1, got {self.ep_size}")
        if self.tp_size < 1:
            raise UserError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.enable_tbo and (blocker := tbo_blocker(self.tp_size)) is not None:
            raise UserError(blocker)
        self.tbo_rules()  # validates the thresholds even when TBO is off
        self.dispatch_config()  # validates the mode and the capacity
        self.cuda_graph_config()  # validates the limits even when graphs are off
        check_speculative_num_steps(self.speculative_num_steps)
        if self.deterministic and (blocker := self.deterministic_blocker()) is not None:
            raise UserError(f"--deterministic: {blocker}")

    def deterministic_blocker(self) -> str | None:
        """What these settings do that is not batch-invariant yet; None when nothing is (model/runner_rules.py)."""
        return deterministic_blocker(enable_tbo=self.enable_tbo, tp_size=self.tp_size, ep_size=self.ep_size,
                                     speculative_num_steps=self.speculative_num_steps,
                                     attention_backend=self.attention_backend, moe_backend=self.moe_backend,
                                     fp8_backend=self.fp8_backend)

    def _check_pool_sizing(self) -> None:
        if (self.num_pages is None) == (self.mem_fraction_static is None):
            raise UserError("size the KV pool by num_pages or by mem_fraction_static (with num_pages=None), "
                            f"not {'both' if self.num_pages is not None else 'neither'}")
        if self.mem_reserve_bytes < 0:
            raise UserError(f"mem_reserve_bytes must be >= 0, got {self.mem_reserve_bytes}")
        if self.mem_fraction_static is None:
            return
        if not is_cuda(self.device):
            raise UserError(f"mem_fraction_static sizes the KV pool from GPU memory; on {self.device!r} "
                            f"give the pool size instead (--num-pages / --max-total-tokens)")

    @classmethod
    def resolve(cls, model_config: ModelConfig, *, graphs_by_default: bool, **fields) -> "RunnerConfig":
        """A config with every "auto" decided, for `fields` as a command collected them.

        `device` may be "auto"; `dtype` "auto" becomes `auto_dtype`; `page_size` absent or None
        becomes `default_page_size` (64 where FlashMLA can run, else 16); the backends and the
        dispatcher become their names; `cuda_graph`, when absent, is `graphs_by_default` where the device and the
        backends can capture, else off; an explicit `cuda_graph=True` that cannot work is a UserError.
        """
        fields = dict(fields)
        device = resolve_device(fields.pop("device", "auto"))
        if fields.get("page_size") is None:  # absent or None: none given
            fields["page_size"] = default_page_size(model_config, device, fields.get("dtype", "auto"))
        requested_graphs = fields.pop("cuda_graph", None)
        draft = cls(device=device, **fields)
        resolved = replace(draft, dtype=_DTYPE_NAMES[draft.resolve_dtype(model_config)],
                           attention_backend=draft.resolve_attention_backend(model_config),
                           moe_backend=draft.resolve_backend(draft.moe_backend),
                           norm_rope_backend=draft.resolve_backend(draft.norm_rope_backend),
                           dispatcher=draft.resolve_dispatcher(),
                           fp8_backend=draft.resolve_fp8_backend(model_config) or "dequant")
        resolved.expert_location(model_config)  # a bad placement file fails here, before any rank starts
        if resolved.extend_cuda_graph and (blocker := resolved.extend_graph_blocker()) is not None:
            raise UserError(f"extend_cuda_graph=true: {blocker}")
        blocker = resolved.cuda_graph_blocker()
        if requested_graphs is None:
            return replace(resolved, cuda_graph=graphs_by_default and blocker is None)
        if requested_graphs and blocker is not None:
            raise UserError(f"cuda_graph=true: {blocker}")
        return replace(resolved, cuda_graph=requested_graphs)  # __post_init__ refuses a non-bool

    def cuda_graph_blocker(self) -> str | None:
        """Why decode cannot be captured as CUDA graphs with these (resolved) settings; None if it can.
        Reads each backend's `cuda_graph_safe`, as `cuda_graph.check_capturable` does on the built model."""
        if not is_cuda(self.device):
            return f"CUDA graphs need a CUDA device, not {self.device!r}"
        settings = graph_settings_blocker(record_expert_load=self.record_expert_load, enable_tbo=self.enable_tbo,
                                          tp_size=self.tp_size)
        if settings is not None:
            return settings
        dispatcher = self.resolve_dispatcher()
        if not decode_capturable(DISPATCHERS.get(dispatcher), self.dispatch_config()):
            return (f"the EP dispatcher {dispatcher!r} is capturable only when decode runs its low-latency layout "
                    f"(dispatch mode {self.dispatch_mode!r}; --deepep-mode auto or low_latency)")
        return self._backend_graph_blocker()

    def _backend_graph_blocker(self) -> str | None:
        """Which (resolved) attention, MoE or FP8 MoE backend a CUDA graph cannot capture; None if none."""
        from deepseek_pd.model.attention import ATTENTION_BACKENDS
        from deepseek_pd.model.moe import MOE_BACKENDS

        parts = (("attention backend", ATTENTION_BACKENDS, self.kernel_backend(self.attention_backend)),
                 ("MoE backend", MOE_BACKENDS, self.kernel_backend(self.moe_backend)))
        if self.fp8_backend not in ("auto", "dequant"):
            parts += (("FP8 MoE backend", MOE_BACKENDS, self.fp8_backend),)
        for what, registry, name in parts:
            if name not in registry.names():  # an optional library not installed (model/jit_backends.py)
                return f"the {what} {name!r} is not installed here"
            if not getattr(registry.get(name), "cuda_graph_safe", False):
                return f"the {what} {name!r} is not capturable"
        return None

    def extend_graph_blocker(self) -> str | None:
        """Why extend cannot be captured as piecewise CUDA graphs with these (resolved) settings; None
        if it can (model/runner_rules.py `extend_graph_settings_blocker`, then the device and backends:
        the attention cores run eagerly, but the reference attention is refused as decode's is)."""
        if not is_cuda(self.device):
            return f"extend CUDA graphs need a CUDA device, not {self.device!r}"
        settings = extend_graph_settings_blocker(
            record_expert_load=self.record_expert_load, enable_tbo=self.enable_tbo, tp_size=self.tp_size,
            ep_size=self.ep_size, deterministic=self.deterministic, speculative_num_steps=self.speculative_num_steps)
        if settings is not None:
            return settings
        if self.resolve_dispatcher() != "local":
            return f"extend graphs capture only the local MoE dispatcher, not {self.resolve_dispatcher()!r}"
        return self._backend_graph_blocker()

    def tbo_rules(self) -> TboRules:
        return TboRules(self.tbo_token_distribution_threshold, self.tbo_min_decode_tokens, self.tbo_min_extend_tokens)

    def dispatch_config(self) -> DispatchConfig:
        return DispatchConfig(DispatchMode.parse(self.dispatch_mode), self.low_latency_max_tokens)

    @property
    def gpu_share(self) -> GpuShare:
        """This worker's place on a GPU other workers may share (model/kv/memory_budget.py)."""
        return GpuShare(self.gpu_workers, self.kv_share)

    @property
    def headroom_gib(self) -> float:
        """`mem_headroom_gib`, else the default for the largest batch this config captures
        (model/kv/memory_headroom.py: 2 GiB up to a graph batch of 128, in proportion above; in
        tokens: a speculative verify graph holds k + 1 per sequence)."""
        if self.mem_headroom_gib is not None:
            return self.mem_headroom_gib
        tokens = self.cuda_graph_max_batch * graph_tokens_per_sequence(self.speculative_num_steps)
        return default_headroom_gib(tokens if self.cuda_graph else 0)

    def cuda_graph_config(self) -> CudaGraphConfig:
        return CudaGraphConfig(max_batch=self.cuda_graph_max_batch, max_context=self.cuda_graph_max_context)

    def resolve_dtype(self, model_config: ModelConfig) -> torch.dtype:
        return _DTYPES[self.dtype if self.dtype != "auto" else auto_dtype(self.device, model_config)]

    def resolve_dispatcher(self) -> str:
        if self.dispatcher != "auto":
            return self.dispatcher
        if self.ep_size == 1:
            return "local"
        return "deepep" if is_cuda(self.device) and "deepep" in DISPATCHERS.names() else "all_to_all"

    def parallel_info(self, parallel: ParallelInfo | None) -> ParallelInfo:
        """The EP group this runner was handed, checked against `ep_size` (none: single process)."""
        parallel = parallel or ParallelInfo()
        if parallel.ep_size != self.ep_size:
            raise UserError(f"ep_size={self.ep_size} but the process group passed in has {parallel.ep_size} ranks")
        if parallel.tp_size != self.tp_size:
            raise UserError(f"tp_size={self.tp_size} but the TP group passed in has {parallel.tp_size} ranks")
        return parallel

    def resolve_attention_backend(self, model_config: ModelConfig) -> str:
        """`attention_backend`, with "auto" decided by `auto_attention` (and the reason logged)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        name, why = self.auto_attention(model_config)
        log.info("attention_backend auto: %r (%s)", name, why)
        return name

    def auto_attention(self, model_config: ModelConfig, host: AttentionHost | None = None) -> tuple[str, str]:
        """(what attention backend "auto" picks for this model, why) on `host` (this machine when None)."""
        return auto_attention_backend(host or attention_host(self.device),
                                      heads_per_rank=model_config.num_attention_heads // self.tp_size,
                                      widths=(model_config.kv_lora_rank, model_config.qk_rope_head_dim),
                                      dtype=_DTYPE_NAMES[self.resolve_dtype(model_config)],
                                      deterministic=self.invariant_kernels, page_size=self.page_size)

    def resolve_backend(self, name: str) -> str:
        """A MoE or norm/RoPE backend name (an attention one where "auto" is to pick no JIT backend):
        "auto" is Triton on CUDA when Triton imports, else torch."""
        if name != "auto":
            return name
        return "triton" if is_cuda(self.device) and _triton_available() else "torch"

    @property
    def invariant_kernels(self) -> bool:
        """`deterministic` on CUDA: the batch-invariant kernels. Off CUDA the runner makes every
        sequence its own forward instead (`batch_invariant.each_row_alone`), which is invariant for
        any op, so the model keeps its plain CPU kernels."""
        return self.deterministic and is_cuda(self.device)

    def kernel_backend(self, name: str) -> str:
        """An attention or MoE backend name, resolved, and with `invariant_kernels` its batch-invariant
        version (`"triton"` -> `"triton_invariant"`)."""
        name = self.resolve_backend(name)
        return f"{name}_invariant" if self.invariant_kernels and not name.endswith("_invariant") else name

    @property
    def resolved_attention_method(self) -> str:
        """`attention_method`, with "auto" pinned to "mha" under `deterministic`: MHA, and
        MHA_CHUNKED_KV for a batch with a prefix (exactly MHA for its rows without one), whatever
        the other rows' prefixes sum to."""
        return "mha" if self.deterministic and self.attention_method == "auto" else self.attention_method

    def resolve_fp8_backend(self, model_config: ModelConfig) -> str | None:
        """The FP8 GEMM backend that keeps this checkpoint's weights in FP8, or None (dequantise)."""
        if not model_config.is_fp8 or self.fp8_backend == "dequant" or self.deterministic:
            return None
        if self.fp8_backend != "auto":
            return self.fp8_backend
        return "triton" if is_cuda(self.device) and _triton_available() else None

    @property
    def builds_mtp(self) -> bool:
        """The model carries its MTP layer (model/speculative/mtp.py): speculative decoding is on."""
        return self.speculative_num_steps > 0

    def auto_choice(self, field: str, model_config: ModelConfig) -> str:
        """What "auto" resolves to for the backend field `field` (attention, MoE, norm/RoPE or FP8
        GEMM), as `resolve` decides it, with no JIT backend: the fallback of one that cannot run here."""
        if field == "fp8_backend":
            return replace(self, fp8_backend="auto").resolve_fp8_backend(model_config) or "dequant"
        if field == "attention_backend":
            host = replace(attention_host(self.device), flashinfer_blocker="FlashInfer failed its start-up check",
                           flashmla_blocker="FlashMLA failed its start-up check")
            return self.auto_attention(model_config, host)[0]
        return self.resolve_backend("auto")

    def expert_location(self, model_config: ModelConfig) -> ExpertLocation | None:
        """Redundant experts / the static placement (model/eplb/expert_location.py), the MTP layer's
        MoE included when it is built; None: identity."""
        return resolve_expert_location(model_config, self.ep_size, self.ep_num_redundant_experts,
                                       self.init_expert_location, mtp=self.builds_mtp)

    def build_options(self, model_config: ModelConfig, parallel: ParallelInfo | None = None) -> BuildOptions:
        return BuildOptions(
            dtype=self.resolve_dtype(model_config), device=self.device,
            attention_backend=self.kernel_backend(self.attention_backend),
            moe_backend=self.kernel_backend(self.moe_backend), dispatcher=self.resolve_dispatcher(),
            dispatch=self.dispatch_config(),
            num_fused_shared_experts=self.num_fused_shared_experts, prefix_chunk_size=self.prefix_chunk_size,
            parallel=self.parallel_info(parallel), enable_tbo=self.enable_tbo, tbo_rules=self.tbo_rules(),
            expert_location=self.expert_location(model_config),
            fp8_backend=self.resolve_fp8_backend(model_config),
            norm_rope_backend=self.resolve_backend(self.norm_rope_backend),
            mtp=self.builds_mtp, deterministic=self.invariant_kernels,
            small_batch_fusions=self.small_batch_fusions and self.kernel_backend(self.moe_backend) == "triton")
