"""`ExtendGraphRunner`: extend (prefill) as piecewise CUDA graphs, one set per token-count bucket.

An eager extend of one 789-token prompt on the V2-Lite shape spends ~34 ms of host time on
~12-15 ms of GPU work: about a thousand Python-dispatched launches (27 layers x ~40 ops). As SGLang
and vLLM do for prefill, everything between the attention cores is captured, per bucket of token
counts, and the ragged attention cores run eagerly between the replays, over the real sequences
(model/extend_graph_pieces.py says where the cuts are; model/extend_graph_inputs.py the buckets,
the padding and the static seams). Per extend of n tokens:

    load the padded inputs (device copies)         bucket N = smallest >= n
    replay piece 0                                  -> progress: layer 0's KV written
    core 0 eagerly on the n real rows -> written into attn_output[:n]
    replay piece 1                                  -> progress: layer 1's KV written
    ...
    replay piece L; final norm and logits of each sequence's last token, eagerly (the rows follow
    the sequences, not the bucket)

An extend of more tokens than the largest bucket returns None: the caller runs it eagerly.
`ModelRunner` builds one only when `RunnerConfig.extend_cuda_graph` passes
`RunnerConfig.extend_graph_blocker` (the one rule on what cannot be captured).

With `capture=False` the same pieces run as plain calls over the same padded static rows: the CPU
path that the tests hold to the plain extend (no CUDA here), and what a capture records.

Memory: the graphs of every bucket share one pool, the decode graphs' when given (one runner
replays one graph at a time). A piece's intermediates may reuse memory an earlier captured graph
used, which is safe because graphs replay in the order they were captured within a forward and no
other replay comes between a piece and the next; only the last piece's outputs (its hidden states
and residual, per bucket) are kept, read right after the replay.
"""
from __future__ import annotations

import logging

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.cuda_graph import check_capturable
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.extend_graph_inputs import StaticExtendInputs, extend_graph_buckets
from deepseek_pd.model.extend_graph_pieces import ExtendPieces
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.graph_inputs import bucket_for
from deepseek_pd.model.kv.layer_progress import LayerProgress
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.layer_ops import LAYER_BOUNDARY_KEYS, OpState

log = logging.getLogger(__name__)
_WARMUP_RUNS = 2  # compile Triton kernels and settle cuBLAS/allocator state before capturing


def check_extend_capturable(model: DeepseekForCausalLM) -> None:
    """Raises UserError naming what in the built `model` rules out extend graphs (the decode rule,
    `cuda_graph.check_capturable`, plus what only extend needs: one rank, the local dispatcher)."""
    check_capturable(model)
    parallel = model.options.parallel
    if parallel.tp_size > 1 or parallel.ep_size > 1:
        raise UserError("extend_cuda_graph: not captured with attention TP or EP (tp_size, ep_size > 1)")
    if model.options.dispatcher != "local":
        raise UserError(f"extend_cuda_graph: captures only the local MoE dispatcher, not {model.options.dispatcher!r}")
    if any(getattr(layer.mlp, "load_recorder", None) is not None for layer in model.layers if layer.is_moe):
        raise UserError("extend_cuda_graph: expert-load recording is not counted in graph replays")


class ExtendGraphRunner:
    def __init__(self, model: DeepseekForCausalLM, kv_pool: KVPool, max_tokens: int, scratch_page: int,
                 pool: object | None = None, capture: bool = True) -> None:
        if capture:
            check_extend_capturable(model)
        self.model = model
        self.pieces = ExtendPieces(model)
        self.buckets = extend_graph_buckets(max_tokens)
        attn = model.layers[0].self_attn
        self.inputs = StaticExtendInputs(
            max_tokens, kv_pool, scratch_page, heads=attn.num_heads, nope_dim=attn.nope_dim,
            rope_dim=attn.rope_dim, kv_lora_rank=attn.kv_lora_rank, hidden_size=model.config.hidden_size,
            dtype=model.options.dtype)
        self._batches = {b: self.inputs.piece_batch(b) for b in self.buckets}
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] | None = None
        self._finals: dict[int, dict[str, torch.Tensor]] = {}
        if capture:
            self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
            self._graphs = self._capture_all()
            log.info("CUDA graphs: captured extend in %d pieces for token counts %s",
                     self.pieces.num_pieces, list(self.buckets))

    # ---- one piece over the static rows: what is captured, or run as a plain call ----------------
    def _run_piece(self, index: int, bucket: int, io: dict[str, torch.Tensor]) -> None:
        """Piece `index` over `bucket`'s static rows: it takes the residual from `io` and attn_output
        from the static buffer; it leaves its attention intermediate in the core's static inputs and
        its residual in `io` (the last piece: hidden_states and residual in `io`)."""
        batch = self._batches[bucket]
        state = OpState()
        if index > 0:
            state.update(attn_output=self.inputs.attn_output[:bucket], residual=io.pop("residual"))
        state = self.pieces.run_piece(index, state, batch)
        if index < self.pieces.num_layers:
            self.inputs.store_core_inputs(state.pop("attn_intermediate"))
            io["residual"] = state.pop("residual")
            state.expect_only(frozenset())
        else:
            state.expect_only(LAYER_BOUNDARY_KEYS)
            io.update(hidden_states=state.pop("hidden_states"), residual=state.pop("residual"))

    @torch.no_grad()
    def _capture_all(self) -> dict[int, list[torch.cuda.CUDAGraph]]:
        """Every bucket's pieces, largest bucket first (its intermediates size the shared pool), each
        after warm-up runs of its whole padded piece chain on a side stream (no cores: their inputs'
        values do not matter to what is recorded)."""
        graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        for bucket in sorted(self.buckets, reverse=True):
            self.inputs.load_padding(bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(_WARMUP_RUNS):
                    io: dict[str, torch.Tensor] = {}
                    for index in range(self.pieces.num_pieces):
                        self._run_piece(index, bucket, io)
            torch.cuda.current_stream().wait_stream(side)
            io, graphs[bucket] = {}, []
            for index in range(self.pieces.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._run_piece(index, bucket, io)
                graphs[bucket].append(graph)
            self._finals[bucket] = io
        torch.cuda.synchronize()
        return graphs

    # ---- a forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, batch: ForwardBatch, progress: LayerProgress | None = None) -> torch.Tensor | None:
        """fp32 logits `[batch_size, vocab]` of each sequence's last new token, or None when the batch
        has more tokens than the largest bucket (run it eagerly). `batch` is the real, built batch
        with its attention method chosen; `progress` hears of each layer's KV write after the piece
        that wrote it."""
        n = batch.num_tokens
        bucket = bucket_for(self.buckets, n)
        if bucket is None:
            return None
        self.inputs.load(batch, bucket)
        io: dict[str, torch.Tensor] = {}
        for index in range(self.pieces.num_pieces):
            if self._graphs is not None:
                self._graphs[bucket][index].replay()
            else:
                self._run_piece(index, bucket, io)
            if index == self.pieces.num_layers:
                break
            if progress is not None:
                progress.kv_written(self.model.layers[index].layer_id)
            state = OpState(attn_intermediate=self.inputs.core_inputs(n))
            self.pieces.run_core(index, state, batch, out=self.inputs.attn_output[:n])
        final = self._finals[bucket] if self._graphs is not None else io
        state = OpState(hidden_states=final["hidden_states"], residual=final["residual"])
        return self.model.compute_logits(self.model.final_hidden(state, batch.last_token_index))
