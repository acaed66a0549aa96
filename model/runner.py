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

Attention TP: `RunnerConfig(tp_size=T)` and a `ParallelInfo` with that `tp_size` and the TP
group; the T ranks of a TP group make the same calls with the same sequences and pages (their
KV pools hold the same latent rows), and each holds 1/T of the heads (attention/tensor_parallel.py).
With a `tp_replay` (model/distributed/tp_replay.py) only the TP leader is called: it announces each forward,
and each follower runs it in `follow_one()`.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.attention.policy import AttentionPolicy
from deepseek_pd.model.batch_invariant import each_row_alone
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.cuda_graph import DecodeGraphRunner
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.extend_graph import ExtendGraphRunner
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode, checked_device_ids
from deepseek_pd.model.speculative.forwards import SpeculativeForwards
from deepseek_pd.model.speculative.graphs import SpeculativeGraphs
from deepseek_pd.model.speculative.rules import graph_draft_counts
from deepseek_pd.model.kv.pool import KVPool, bytes_per_pool_page
from deepseek_pd.model.kv.pool_sizing import GpuMemory, pages_for_gpu
from deepseek_pd.model.kv.layer_progress import LayerProgress
from deepseek_pd.model.moe.expert_load import ExpertLoadRecorder
from deepseek_pd.model.jit_backends import with_compiled_jit_backends
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.distributed.tp_replay import ForwardCall, TpReplay
from deepseek_pd.model.distributed.step_sync import ForwardKind, StepSync
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.units import GIB

log = logging.getLogger(__name__)


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
    # This rank's EP size/rank and process group (see model/distributed/parallel.py); None: one process.
    parallel: ParallelInfo | None = None
    kv_pool: KVPool = field(init=False)
    policy: AttentionPolicy = field(init=False)
    # One rank of a group: every forward is announced to the group first (model/distributed/step_sync.py).
    step_sync: StepSync | None = None
    # Attention TP in a worker: the leader announces its forwards, followers replay them (model/distributed/tp_replay.py).
    tp_replay: TpReplay | None = None
    # The CUDA-graph decode path, when `config.cuda_graph` (built, and captured, once here).
    graphs: DecodeGraphRunner | None = field(init=False, default=None, repr=False)
    # Decode steps so far by how they ran (read by the workers' metrics at scrape time).
    decode_paths: dict[str, int] = field(init=False, repr=False,
                                         default_factory=lambda: {"cuda_graph": 0, "eager": 0})
    # Extend as piecewise CUDA graphs, when `config.extend_cuda_graph` (model/extend_graph.py), and
    # `extend` calls so far by how they ran.
    extend_graphs: ExtendGraphRunner | None = field(init=False, default=None, repr=False)
    extend_paths: dict[str, int] = field(init=False, repr=False,
                                         default_factory=lambda: {"cuda_graph": 0, "eager": 0})
    # Speculative decoding's forwards (model/speculative/forwards.py), with their CUDA graphs when
    # the MTP layer is built and `config.cuda_graph` (`spec_forwards.graphs`).
    spec_forwards: SpeculativeForwards = field(init=False, repr=False)
    # Tokens per expert since start, when `config.record_expert_load` (model/moe/expert_load.py).
    expert_load: ExpertLoadRecorder | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.model is None:
            self.config, self.model = _load_model(self.config, self.parallel)
        model_config = self.model.config
        options = self.model.options
        self.policy = AttentionPolicy(self.config.resolved_attention_method, self.config.mha_chunked_kv_threshold)
        num_pages = self.config.num_pages
        if num_pages is None:  # sized from the GPU memory budget, now that the weights are resident
            per_page = bytes_per_pool_page(self.model.num_kv_layers, self.config.page_size,
                                           model_config.kv_cache_dim, options.dtype)
            num_pages = pages_for_gpu(GpuMemory.measure(options.device), self.config.mem_fraction_static,
                                      int(self.config.headroom_gib * GIB), per_page,
                                      # + the graphs' scratch page
                                      min_pages=2 if self.config.cuda_graph or self.config.extend_cuda_graph else 1,
                                      share=self.config.gpu_share, reserve_bytes=self.config.mem_reserve_bytes)
        self.kv_pool = KVPool(self.model.num_kv_layers, num_pages, self.config.page_size,
                              model_config.kv_cache_dim, dtype=options.dtype, device=options.device)
        log.info("KV pool: %s, %d bytes/token (%d layers x %d x %d)", self.kv_pool.describe(),
                 self.kv_pool.bytes_per_token, self.model.num_kv_layers, model_config.kv_cache_dim,
                 self.kv_pool.buffers[0].element_size())
        if self.config.record_expert_load:
            self.expert_load = self.record_expert_load()  # before graphs: record_expert_load refuses after
        spec_graphs = None
        if self.config.cuda_graph:
            self.graphs = DecodeGraphRunner(self.model, self.kv_pool, self.config.cuda_graph_config())
            if self.model.mtp is not None:
                steps = self.config.speculative_num_steps
                counts = graph_draft_counts(steps, self.config.speculative_adaptive)
                spec_graphs = SpeculativeGraphs(self.model, self.kv_pool, self.config.cuda_graph_config(), counts,
                                                self.graphs.scratch_page, self.graphs.pool)
        if self.config.extend_cuda_graph:
            if (blocker := self.config.extend_graph_blocker()) is not None:
                raise UserError(f"extend_cuda_graph=true: {blocker}")
            # After the decode graphs: their pool and scratch page are shared (only one graph replays at a time).
            self.extend_graphs = ExtendGraphRunner(
                self.model, self.kv_pool, self.config.extend_graph_max_tokens,
                self.graphs.scratch_page if self.graphs is not None else self.kv_pool.alloc(1)[0],
                self.graphs.pool if self.graphs is not None else None)
        self.spec_forwards = SpeculativeForwards(self.model, self.kv_pool, self.policy, self._step, self.tp_replay,
                                                 spec_graphs)

    @classmethod
    def from_model(cls, model: DeepseekForCausalLM, config: RunnerConfig | None = None) -> "ModelRunner":
        """A runner around an in-memory model (tests, tools); `config.model`/`dtype`/`device` are ignored."""
        return cls(config or RunnerConfig(model="<in-memory>"), model)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    def _run(self, mode: ForwardMode, token_ids: list[Sequence[int]], prefix_lens: list[int],
             pages: list[Sequence[int]], input_ids: torch.Tensor | None = None,
             progress: LayerProgress | None = None, group_mode: ForwardMode | None = None) -> torch.Tensor:
        if self.config.deterministic and not self.config.invariant_kernels and len(token_ids) > 1:
            return each_row_alone(
                lambda rows: self._run(mode, token_ids[rows], prefix_lens[rows], pages[rows],
                                       None if input_ids is None else input_ids[rows], None, group_mode),
                len(token_ids), progress, len(self.model.layers))
        if self.tp_replay is not None and self.tp_replay.is_leader:
            self.tp_replay.lead(ForwardCall(mode, False, tuple(map(tuple, token_ids)), tuple(prefix_lens),
                                            tuple(map(tuple, pages)), group_mode), input_ids, self.kv_pool)
        batch = ForwardBatch.build(mode, token_ids, prefix_lens, pages, self.kv_pool,
                                   self.model_config.vocab_size, self.model.options.device)
        batch.group_mode = group_mode
        if input_ids is not None:
            batch.input_ids = checked_device_ids(input_ids, batch.num_tokens)
        batch.attention_method = self.policy.choose(mode, batch.prefix_lens)
        if mode is ForwardMode.EXTEND and self.extend_graphs is not None and group_mode in (None, mode):
            logits = self.extend_graphs.extend(batch, progress)
            self.extend_paths["eager" if logits is None else "cuda_graph"] += 1
            if logits is not None:
                return logits
        return self.model(batch, progress)

    def extend(self, seqs: Sequence[ExtendSeq], progress: LayerProgress | None = None) -> torch.Tensor:
        """fp32 logits `[len(seqs), vocab]` of each sequence's last new token.

        `progress`, if given, is told as each layer's KV of the whole batch is written
        (`model/kv/layer_progress.py`), while the forward goes on."""
        with self._step(ForwardMode.EXTEND) as group_mode:
            return self._run(ForwardMode.EXTEND, [s.token_ids for s in seqs], [s.prefix_len for s in seqs],
                             [s.pages for s in seqs], progress=progress, group_mode=group_mode)

    def record_expert_load(self) -> ExpertLoadRecorder:
        """Starts counting this rank's tokens per routed expert and MoE layer (model/moe/expert_load.py)."""
        if self.graphs is not None or self.extend_graphs is not None:
            raise UserError("expert-load recording must start before CUDA graphs are captured "
                            "(their replays would not record): run with cuda_graph=false and extend_cuda_graph=false")
        # The MTP layer's MoE is counted as its own row (layer id num_hidden_layers), planned like the
        # others (model/eplb/expert_location.py).
        layers = [*self.model.layers, *(() if self.model.mtp is None else (self.model.mtp.layer,))]
        moe_layers = [layer for layer in layers if layer.is_moe]
        recorder = ExpertLoadRecorder(tuple(layer.layer_id for layer in moe_layers),
                                      self.model_config.n_routed_experts, self.model.options.device)
        for row, layer in enumerate(moe_layers):
            layer.mlp.load_recorder = (recorder, row)
        return recorder

    def _step(self, mode: ForwardMode, kind: ForwardKind = ForwardKind.MODEL):
        """The group's forward step of `kind` (model/distributed/step_sync.py); yields the group's
        mode (alone: `mode`)."""
        if self.step_sync is None:
            return contextlib.nullcontext(mode)
        return self.step_sync.forward(mode, kind)

    def idle(self, mode: ForwardMode = ForwardMode.DECODE, kind: ForwardKind = ForwardKind.MODEL) -> None:
        """With EP: this rank has no requests this step but must join the other ranks' MoE
        all-to-alls (call it where the others call extend/decode; `kind` MTP: where they run the
        MTP layer, `draft`). A no-op work-wise at ep_size 1."""
        mtp = kind is ForwardKind.MTP
        if self.tp_replay is not None and self.tp_replay.is_leader:
            self.tp_replay.lead(ForwardCall(mode, idle=True, output="mtp" if mtp else "logits"), None, self.kv_pool)
        if mtp:
            self.model.forward_mtp_idle(mode)
        else:
            self.model.forward_idle(mode)

    def kv_written_externally(self, pages: Sequence[int]) -> None:
        """KV landed in these pages outside a forward (a PD transfer): under attention TP the
        leader sends it to its followers before its next forward (a no-op otherwise)."""
        if self.tp_replay is not None and self.tp_replay.is_leader:
            self.tp_replay.note_external_kv(pages)

    def follow_one(self) -> None:
        """(attention-TP follower) Runs the leader's next forward on this rank (model/distributed/tp_replay.py);
        its logits are dropped (the leader samples)."""
        call, input_ids, hidden = self.tp_replay.receive(self.kv_pool)
        if call.idle:
            self.idle(call.mode, ForwardKind.MTP if call.output == "mtp" else ForwardKind.MODEL)
            return
        if call.output != "logits":  # speculative decoding's forwards
            self.spec_forwards.follow(call, hidden, input_ids)
            return
        self._run(call.mode, [list(t) for t in call.token_ids], list(call.prefix_lens),
                  [list(p) for p in call.pages], input_ids, group_mode=call.group_mode)

    def decode(self, seqs: Sequence[DecodeSeq], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits `[len(seqs), vocab]` for one new token per sequence (graph replay when it fits).

        `input_ids` ([len(seqs)] long, on the model's device), when given, replaces the seqs'
        `token_id`s: the overlap scheduler feeds the previous step's samples without reading them
        back to the host. The caller guarantees they are in the vocabulary (the sampler's output is).
        """
        with self._step(ForwardMode.DECODE) as group_mode:
            if self.graphs is not None and group_mode is ForwardMode.DECODE:  # graphs hold decode's collectives
                logits = self.graphs.decode([s.token_id for s in seqs], [s.position for s in seqs],
                                            [s.pages for s in seqs], input_ids=input_ids)
                if logits is not None:
                    self.decode_paths["cuda_graph"] += 1
                    return logits
            self.decode_paths["eager"] += 1
            return self.decode_eager(seqs, input_ids, group_mode)

    # ---- speculative decoding: model/speculative/forwards.py ------------------------------------------
    def extend_hidden(self, seqs: Sequence[ExtendSeq], force_mla: bool = False,
                      progress: LayerProgress | None = None, input_ids: torch.Tensor | None = None,
                      starts: torch.Tensor | None = None, counted: torch.Tensor | None = None) -> torch.Tensor:
        """An extend forward returning the final-normed hidden states of every new token `[T, H]`
        (their logits: `logits`). `force_mla`: absorbed MLA over the paged cache whatever the policy
        says (speculative verify: several queries per sequence, causal among themselves).
        `progress` hears of each decoder layer's KV write, as in `extend`. `input_ids` (`[T]` long
        on the device), when given, replaces the seqs' token ids (then only their lengths count):
        the speculative step feeds its drafts without reading them back, as `decode` does. `starts`
        (`[len(seqs)]` long on the device), when given, are the seqs' true prefix lengths, which
        their `prefix_len`s only bound (model/speculative/future_positions.py). `counted` (`[T]` long
        on the device): which tokens count in the expert load (`ForwardBatch.counted_tokens`)."""
        return self.spec_forwards.extend_hidden(seqs, force_mla, progress, input_ids, starts, counted)

    def draft(self, seqs: Sequence[ExtendSeq], prev_hidden: torch.Tensor,
              input_ids: torch.Tensor | None = None, starts: torch.Tensor | None = None,
              counted: torch.Tensor | None = None) -> torch.Tensor:
        """The MTP layer over `seqs` (decode mode when each has one token) `[T, H]`; its latent KV
        goes into the pool's MTP layer at the same positions and pages. `input_ids`, `starts`,
        `counted`: as in `extend_hidden`."""
        return self.spec_forwards.draft(seqs, prev_hidden, input_ids, starts, counted)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden states from `extend_hidden` or `draft`."""
        return self.model.compute_logits(hidden)

    def decode_eager(self, seqs: Sequence[DecodeSeq], input_ids: torch.Tensor | None = None,
                     group_mode: ForwardMode | None = None) -> torch.Tensor:
        """`decode` without CUDA graphs (the fallback, and the oracle the graphs are tested against)."""
        return self._run(ForwardMode.DECODE, [[s.token_id] for s in seqs], [s.position for s in seqs],
                         [s.pages for s in seqs], input_ids, group_mode=group_mode)


def _load_model(config: RunnerConfig, parallel: ParallelInfo | None) -> tuple[RunnerConfig, DeepseekForCausalLM]:
    """The model, and `config` with any JIT backend that cannot compile here replaced by its
    "auto" choice (model/jit_backends.py)."""
    from deepseek_pd.model.checkpoint.loader import load_model
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir

    directory = resolve_model_dir(config.model)
    # The options depend on the model's config (dtype "auto", backends, expert placement).
    model_config = ModelConfig.from_hf(directory)
    config = with_compiled_jit_backends(config, model_config)
    return config, load_model(directory, config.build_options(model_config, parallel), config=model_config)
