"""`DecodeGraphRunner`: the decode forward captured as one CUDA graph per batch-size bucket.

Eager decode on a DeepSeek-V2-Lite shape spends most of a step in Python dispatch (~80 ops x 27
layers) and in `ForwardBatch.build`; a replayed graph launches the same kernels with no Python in
between. Per step: pick the smallest bucket >= the batch, pack the inputs on the host into one
tensor, copy it to the bucket's static buffer (one upload; `graph_inputs.py`), replay, and return
the real rows of the static logits. Batches the graphs cannot take — more sequences than the
largest bucket, or a context longer than the captured page-table width — return None and the
caller runs them eagerly.

Capturable only when nothing in the decode forward syncs with the host or branches on device
data: every attention backend, MoE kernel and EP dispatcher must declare `cuda_graph_safe = True`
(the Triton attention, Triton/grouped MoE and the local dispatcher do; the torch references sync
or materialise the whole captured context and do not). Checked once, at build time.

One page of the KV pool is taken for the padding rows' writes (`scratch_page`) for the runner's
lifetime.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence, TypeVar

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.graph_inputs import CudaGraphConfig, StaticDecodeInputs, bucket_for
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.distributed.dispatch_mode import decode_capturable

log = logging.getLogger(__name__)
_WARMUP_RUNS = 2  # compile Triton kernels and settle cuBLAS/allocator state before capturing
T = TypeVar("T")


@torch.no_grad()
def capture_per_bucket(buckets: Sequence[int], load_padding: Callable[[int], None], forward: Callable[[int], T],
                       pool: object | None = None) -> tuple[dict[int, "torch.cuda.CUDAGraph"], dict[int, T]]:
    """Captures `forward(bucket)` once per bucket (its static inputs filled by `load_padding(bucket)`
    first): a few warm-up runs on a side stream, then the capture. Largest bucket first: its
    intermediates size the memory pool the smaller graphs share. Returns the graphs and their
    static outputs, by bucket (decode here; the speculative draft and verify, model/speculative/).

    `pool`: a memory pool other graphs were captured in (`DecodeGraphRunner.pool`). Graphs that
    never replay at once may share one (a runner replays one at a time); their static outputs stay
    allocated, so a replay of one never overwrites another's."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, T] = {}
    for bucket in sorted(buckets, reverse=True):
        load_padding(bucket)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_RUNS):
                forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[bucket] = forward(bucket)
        graphs[bucket] = graph
    torch.cuda.synchronize()
    return graphs, outputs


def check_capturable(model: DeepseekForCausalLM) -> None:
    """Raises UserError naming the first part of `model` that rules out CUDA graphs."""
    options = model.options
    if torch.device(options.device).type != "cuda":
        raise UserError(f"cuda_graph needs a CUDA device, the model is on {options.device!r}; "
                        f"set cuda_graph=False")
    if options.enable_tbo:
        raise UserError("cuda_graph cannot capture two-batch overlap (enable_tbo); turn one of them off")
    if not decode_capturable(model.dispatcher, options.dispatch):
        raise UserError(f"cuda_graph: EP dispatcher {options.dispatcher!r} is not capturable in the "
                        f"{options.dispatch.mode.value!r} dispatch mode (decode must run the low-latency layout)")
    for layer in model.layers:
        if not getattr(layer.self_attn.backend, "cuda_graph_safe", False):
            raise UserError(f"cuda_graph: attention backend {options.attention_backend!r} is not capturable "
                            f"(the torch reference); use attention_backend='triton'")
        if layer.is_moe and not getattr(layer.mlp.experts.kernel, "cuda_graph_safe", False):
            raise UserError(f"cuda_graph: MoE backend {options.moe_backend!r} syncs with the host; "
                            f"use moe_backend='triton' or 'grouped'")

class DecodeGraphRunner:
    def __init__(self, model: DeepseekForCausalLM, kv_pool: KVPool, config: CudaGraphConfig) -> None:
        check_capturable(model)
        self.model = model
        self.kv_pool = kv_pool
        self.config = config
        self.buckets = config.buckets()
        self.table_width = config.table_width(kv_pool.page_size)
        self.scratch_page = kv_pool.alloc(1)[0]
        vocab = model.config.vocab_size
        self._inputs = {b: StaticDecodeInputs(b, self.table_width, kv_pool, self.scratch_page, vocab)
                        for b in self.buckets}
        # Backends that plan on the host per batch (FlashInfer): re-planned before every replay.
        self._planning = list({id(b): b for b in (layer.self_attn.backend for layer in model.layers)
                               if hasattr(b, "prepare_replay")}.values())
        # The memory pool of its graphs, which the speculative graphs share (model/speculative/graphs.py).
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs, self._logits = capture_per_bucket(
            self.buckets, lambda b: self._inputs[b].load(self._inputs[b].pack_padding_only()),
            lambda b: self.model(self._inputs[b].forward_batch()), self.pool)
        log.info("CUDA graphs: captured decode for batch sizes %s, contexts up to %d tokens (%d pages)",
                 list(self.buckets), self.table_width * self.kv_pool.page_size, self.table_width)

    def decode(self, token_ids: Sequence[int], positions: Sequence[int], pages: Sequence[Sequence[int]],
               input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """fp32 logits `[n, vocab]` by graph replay, or None when this batch must run eagerly.

        `input_ids` (device, [n] long) overrides `token_ids` with a device-to-device copy into the
        static buffer, queued behind the upload (see `ModelRunner.decode`)."""
        bucket = bucket_for(self.buckets, len(token_ids))
        if bucket is None:
            return None
        inputs = self._inputs[bucket]
        if not inputs.fits(positions):
            return None
        inputs.load(inputs.pack(token_ids, positions, pages))
        if input_ids is not None:
            inputs.input_ids[:len(token_ids)].copy_(input_ids)
        if self._planning:
            lengths, page_lists = inputs.replay_layout(positions, pages)
            for backend in self._planning:
                backend.prepare_replay(bucket, lengths, page_lists)
        self.model.dispatcher.prepare_step(ForwardMode.DECODE)  # what the replay's dispatches skip (DeepEP)
        self._graphs[bucket].replay()
        # A copy: the static logits are overwritten by the next replay, and callers keep logits.
        return self._logits[bucket][:len(token_ids)].clone()
