"""`ModelRunner`: the one object workers and the offline engine call to run the model.

It owns the model, the paged latent `KVPool` and the `AttentionPolicy`; callers own page
allocation (through `runner.kv_pool.alloc/free`) and pass each request's page list in.

    runner = ModelRunner(RunnerConfig(model="/models/DeepSeek-V2-Lite", dtype="bfloat16", device="cuda"))
    pages = runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(prompt) + max_new))
    logits = runner.extend([ExtendSeq(prompt, prefix_len=0, pages=pages)])      # [1, vocab] fp32
    logits = runner.decode([DecodeSeq(next_id, position=len(prompt), pages=pages)])

Expert parallelism: each rank builds its runner with the same `RunnerConfig(ep_size=W)` and its
own `parallel=ParallelInfo.from_group(group)` after `torch.distributed.init_process_group`; each
rank then runs its own requests (data-parallel attention), and every rank must call
extend/decode the same number of times (the MoE all-to-alls pair up across ranks).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.attention.policy import AttentionPolicy
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.cuda_graph import DecodeGraphRunner
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.graph_inputs import CudaGraphConfig
from deepseek_pd.model.kv_pool import KVPool
from deepseek_pd.model.moe.dispatcher import DISPATCHERS
from deepseek_pd.model.parallel import ParallelInfo

log = logging.getLogger(__name__)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401  (only whether it imports matters)
    except ImportError:
        return False
    return True


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    """How to run a model. `dtype="auto"` takes the checkpoint's dtype (fp32 on CPU)."""

    model: str = "tiny"
    dtype: str = "auto"
    device: str = "cpu"
    page_size: int = 16
    num_pages: int = 1024
    attention_method: str = "auto"  # auto | mha | mha_chunked_kv | mla
    mha_chunked_kv_threshold: int = 256
    prefix_chunk_size: int = 8192
    num_fused_shared_experts: int = 0
    # auto: the Triton kernels on CUDA when Triton imports, else the plain-torch reference.
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    dispatcher: str = "auto"  # auto: local for ep_size 1, else deepep (when importable on CUDA) or all_to_all
    ep_size: int = 1  # the process group handed to ModelRunner(parallel=...) must have this size
    enable_tbo: bool = False  # two-batch overlap (model/tbo.py)
    # Decode by CUDA-graph replay (model/cuda_graph.py) for batches up to cuda_graph_max_batch
    # sequences and contexts up to cuda_graph_max_context tokens; larger ones run eagerly. Needs
    # CUDA and capturable backends (attention "triton", MoE "triton"/"grouped"); takes one KV page.
    cuda_graph: bool = False
    cuda_graph_max_batch: int = 128
    cuda_graph_max_context: int = 4096

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise UserError(f"dtype {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        if self.page_size < 1 or self.num_pages < 1:
            raise UserError(f"page_size and num_pages must be >= 1, got {self.page_size}, {self.num_pages}")
        AttentionPolicy(self.attention_method, self.mha_chunked_kv_threshold)  # validates both
        if self.ep_size < 1:
            raise UserError(f"ep_size must be >= 1, got {self.ep_size}")
        self.cuda_graph_config()  # validates the limits even when graphs are off

    def cuda_graph_config(self) -> CudaGraphConfig:
        return CudaGraphConfig(max_batch=self.cuda_graph_max_batch, max_context=self.cuda_graph_max_context)

    def resolve_dtype(self, model_config: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        return torch.float32 if self.device == "cpu" else _DTYPES[model_config.torch_dtype]

    def resolve_dispatcher(self) -> str:
        if self.dispatcher != "auto":
            return self.dispatcher
        if self.ep_size == 1:
            return "local"
        return "deepep" if self.device.startswith("cuda") and "deepep" in DISPATCHERS.names() else "all_to_all"

    def parallel_info(self, parallel: ParallelInfo | None) -> ParallelInfo:
        """The EP group this runner was handed, checked against `ep_size` (none: single process)."""
        parallel = parallel or ParallelInfo()
        if parallel.ep_size != self.ep_size:
            raise UserError(f"ep_size={self.ep_size} but the process group passed in has {parallel.ep_size} ranks")
        return parallel

    def resolve_backend(self, name: str) -> str:
        if name != "auto":
            return name
        return "triton" if self.device.startswith("cuda") and _triton_available() else "torch"

    def build_options(self, model_config: ModelConfig, parallel: ParallelInfo | None = None) -> BuildOptions:
        return BuildOptions(
            dtype=self.resolve_dtype(model_config), device=self.device,
            attention_backend=self.resolve_backend(self.attention_backend),
            moe_backend=self.resolve_backend(self.moe_backend), dispatcher=self.resolve_dispatcher(),
            num_fused_shared_experts=self.num_fused_shared_experts, prefix_chunk_size=self.prefix_chunk_size,
            parallel=self.parallel_info(parallel), enable_tbo=self.enable_tbo)


@dataclass(frozen=True)
class ExtendSeq:
    """New tokens at positions prefix_len..prefix_len+len-1; the prefix's KV is already in `pages`."""

    token_ids: Sequence[int]
    prefix_len: int
    pages: Sequence[int]


@dataclass(frozen=True)
class DecodeSeq:
    """One new token at `position` (= number of tokens already cached)."""

    token_id: int
    position: int
    pages: Sequence[int]


@dataclass
class ModelRunner:
    config: RunnerConfig
    model: DeepseekForCausalLM | None = None
    # This rank's EP size/rank and process group (see model/parallel.py); None: one process.
    parallel: ParallelInfo | None = None
    kv_pool: KVPool = field(init=False)
    policy: AttentionPolicy = field(init=False)
    # The CUDA-graph decode path, when `config.cuda_graph` (built, and captured, once here).
    graphs: DecodeGraphRunner | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = _load_model(self.config, self.parallel)
        model_config = self.model.config
        options = self.model.options
        self.policy = AttentionPolicy(self.config.attention_method, self.config.mha_chunked_kv_threshold)
        self.kv_pool = KVPool(model_config.num_hidden_layers, self.config.num_pages, self.config.page_size,
                              model_config.kv_cache_dim, dtype=options.dtype, device=options.device)
        log.info("KV pool: %d pages x %d tokens, %d bytes/token (%d layers x %d x %d)", self.config.num_pages,
                 self.config.page_size, self.kv_pool.bytes_per_token, model_config.num_hidden_layers,
                 model_config.kv_cache_dim, self.kv_pool.buffers[0].element_size())
        if self.config.cuda_graph:
            self.graphs = DecodeGraphRunner(self.model, self.kv_pool, self.config.cuda_graph_config())

    @classmethod
    def from_model(cls, model: DeepseekForCausalLM, config: RunnerConfig | None = None) -> "ModelRunner":
        """A runner around an in-memory model (tests, tools); `config.model`/`dtype`/`device` are ignored."""
        return cls(config or RunnerConfig(model="<in-memory>"), model)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    def _run(self, mode: ForwardMode, token_ids: list[Sequence[int]], prefix_lens: list[int],
             pages: list[Sequence[int]]) -> torch.Tensor:
        batch = ForwardBatch.build(mode, token_ids, prefix_lens, pages, self.kv_pool,
                                   self.model_config.vocab_size, self.model.options.device)
        batch.attention_method = self.policy.choose(mode, batch.prefix_lens)
        return self.model(batch)

    def extend(self, seqs: Sequence[ExtendSeq]) -> torch.Tensor:
        """fp32 logits `[len(seqs), vocab]` of each sequence's last new token."""
        return self._run(ForwardMode.EXTEND, [s.token_ids for s in seqs], [s.prefix_len for s in seqs],
                         [s.pages for s in seqs])

    def idle(self, mode: ForwardMode = ForwardMode.DECODE) -> None:
        """With EP: this rank has no requests this step but must join the other ranks' MoE
        all-to-alls (call it where the others call extend/decode). A no-op work-wise at ep_size 1."""
        self.model.forward_idle(mode)

    def decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """fp32 logits `[len(seqs), vocab]` for one new token per sequence (graph replay when it fits)."""
        if self.graphs is not None:
            logits = self.graphs.decode([s.token_id for s in seqs], [s.position for s in seqs],
                                        [s.pages for s in seqs])
            if logits is not None:
                return logits
        return self.decode_eager(seqs)

    def decode_eager(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """`decode` without CUDA graphs (the fallback, and the oracle the graphs are tested against)."""
        return self._run(ForwardMode.DECODE, [[s.token_id] for s in seqs], [s.position for s in seqs],
                         [s.pages for s in seqs])


def _load_model(config: RunnerConfig, parallel: ParallelInfo | None) -> DeepseekForCausalLM:
    from deepseek_pd.model.loader import iter_checkpoint_tensors
    from deepseek_pd.model.tiny import resolve_model_path

    directory = resolve_model_path(config.model)  # "tiny" → the generated, cached checkpoint
    model_config = ModelConfig.from_hf(directory)
    options = config.build_options(model_config, parallel)
    model = DeepseekForCausalLM(model_config, options)
    model.load_weights(iter_checkpoint_tensors(directory, model_config, fp8_dtype=options.dtype))
    return model.eval()
