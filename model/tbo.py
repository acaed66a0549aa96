"""Two-batch overlap (TBO): one forward batch as two micro-batches whose layer ops interleave, so
one micro-batch's EP dispatch/combine is in flight while the other computes (SGLang's scheme).

The schedule is data: the whole model's op list (each MoE layer's `TBO_PREFILL_MOE_OPS` or
`TBO_DECODE_MOE_OPS`, each dense layer's plain list) is cut at its YIELD points into stages, and
the two micro-batches run the stages in this order (A = first micro-batch, B = second):

    A's first `delta` stages; then (A stage delta+i, B stage i) for every i; then B's last `delta`.
    delta is 0 for extend and 2 for decode. E.g. 4 stages, delta 2:  A0 A1 | A2 B0 | A3 B1 | B2 B3

The ops are the very methods `forward()` runs, and each micro-batch has its own `OpState`, so
the overlapped and the plain path cannot drift, and cross-talk between micro-batches raises.

Splitting: extend batches are cut between sequences where the two token counts balance best;
decode batches (one token per sequence) in half. A batch of one sequence is not split. With EP,
every rank must make the same choice (the all-to-alls pair up in order), so the ranks agree with
one all-reduce and all fall back to the plain path if any rank cannot split.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.layer_ops import (TBO_DECODE_MOE_OPS, TBO_PREFILL_MOE_OPS, YIELD, LayerStack, Op, OpState,
                                         op_method)
from deepseek_pd.model.layer_progress import KV_WRITE_OP
from deepseek_pd.model.parallel import ParallelInfo

if TYPE_CHECKING:
    from deepseek_pd.model.layer_progress import LayerProgress

TBO_MOE_OPS: dict[ForwardMode, tuple[str, ...]] = {
    ForwardMode.EXTEND: TBO_PREFILL_MOE_OPS,
    ForwardMode.DECODE: TBO_DECODE_MOE_OPS,
}
DELTA_STAGES: dict[ForwardMode, int] = {ForwardMode.EXTEND: 0, ForwardMode.DECODE: 2}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageOp:
    layer_id: int
    name: str
    run: Op


Stage = tuple[StageOp, ...]
TraceEntry = tuple[int, int, str]  # (micro-batch 0/1, layer id, op name)


def build_stages(model: LayerStack, mode: ForwardMode) -> tuple[Stage, ...]:
    """The whole model's ops for `mode`, cut at YIELD points (a stage may span a layer boundary)."""
    stages: list[Stage] = []
    current: list[StageOp] = []
    for layer in model.layers:
        names = TBO_MOE_OPS[mode] if layer.is_moe else layer.op_names
        for name in names:
            if name == YIELD:
                stages.append(tuple(current))
                current = []
            else:
                current.append(StageOp(layer.layer_id, name, op_method(layer, name)))
    stages.append(tuple(current))
    return tuple(stage for stage in stages if stage)


def interleaved_order(num_stages: int, delta: int) -> list[tuple[int, int]]:
    """(micro-batch, stage index) in execution order; see the module docstring."""
    delta = min(delta, num_stages)
    order = [(0, i) for i in range(delta)]
    for i in range(num_stages - delta):
        order += [(0, delta + i), (1, i)]
    order += [(1, num_stages - delta + i) for i in range(delta)]
    return order


def split_point(batch: ForwardBatch) -> int | None:
    """Index of the first sequence of the second micro-batch, or None if the batch cannot split."""
    num_seqs = batch.batch_size
    if num_seqs < 2:
        return None
    if batch.mode is ForwardMode.DECODE:
        return num_seqs // 2
    offsets = batch.qo_offsets
    total = offsets[-1]
    return min(range(1, num_seqs), key=lambda cut: abs(2 * offsets[cut] - total))


def sub_batch(batch: ForwardBatch, first: int, end: int) -> ForwardBatch:
    """Sequences [first, end) of `batch` as a batch of their own (same KV pool, same method)."""
    offsets = batch.qo_offsets
    t0, t1 = offsets[first], offsets[end]
    return dataclasses.replace(
        batch, input_ids=batch.input_ids[t0:t1], positions=batch.positions[t0:t1],
        out_slots=batch.out_slots[t0:t1], token_seq=batch.token_seq[t0:t1] - first,
        qo_indptr=batch.qo_indptr[first:end + 1] - t0, page_table=batch.page_table[first:end],
        seq_lens_t=batch.seq_lens_t[first:end], prefix_lens=batch.prefix_lens[first:end],
        extend_lens=batch.extend_lens[first:end], page_lists=batch.page_lists[first:end], derived={})


class TwoBatchOverlap:
    """Runs a model's layers over two interleaved micro-batches; built once per model.

    Needs only the `LayerStack` interface of the model (layers, initial/final state, the plain loop
    for the fallback), not the model class.
    """

    def __init__(self, model: LayerStack, parallel: ParallelInfo) -> None:
        self.model = model
        self.parallel = parallel
        self.stages = {mode: build_stages(model, mode) for mode in ForwardMode}
        self._split_logged = False

    def final_hidden(self, batch: ForwardBatch, trace: list[TraceEntry] | None = None,
                     progress: "LayerProgress | None" = None) -> torch.Tensor:
        """Final-normed hidden states of each sequence's last new token `[B, H]`, as the plain
        path returns them. `trace`, if given, receives every op run, in order. `progress` hears
        of a layer's KV write once both micro-batches have written it."""
        model = self.model
        cut = split_point(batch)
        # Every rank splits, or none: a rank whose own mode is not the group's (it decodes while
        # another extends) has the other schedule, so it votes no, as SGLang does for mixed modes.
        if not self.parallel.all_agree(cut is not None and batch.ep_mode is batch.mode, batch.input_ids.device):
            return model.final_hidden(model.run_layers(batch, progress), batch.last_token_index)
        if not self._split_logged:  # once: that the overlapped path runs here at all (logs, tests)
            self._split_logged = True
            log.info("two-batch overlap: split a %s batch of %d sequences at %d", batch.mode.name.lower(),
                     batch.batch_size, cut)
        halves = (sub_batch(batch, 0, cut), sub_batch(batch, cut, batch.batch_size))
        states = [model.initial_state(half) for half in halves]
        stages = self.stages[batch.mode]
        written: dict[int, int] = {}  # layer id -> micro-batches whose KV write has run
        for micro, index in interleaved_order(len(stages), DELTA_STAGES[batch.mode]):
            for op in stages[index]:
                op.run(states[micro], halves[micro])
                if trace is not None:
                    trace.append((micro, op.layer_id, op.name))
                if progress is not None and op.name == KV_WRITE_OP:
                    written[op.layer_id] = written.get(op.layer_id, 0) + 1
                    if written[op.layer_id] == len(halves):
                        progress.kv_written(op.layer_id)
        return torch.cat([model.final_hidden(state, half.last_token_index) for state, half in zip(states, halves)])
