"""Two-batch overlap (TBO): one forward batch as two micro-batches whose layer ops interleave, so
one micro-batch's EP dispatch/combine is in flight while the other computes (SGLang's scheme).

The schedule is data: the whole model's op list (each MoE layer's `TBO_PREFILL_MOE_OPS` or
`TBO_DECODE_MOE_OPS`, each dense layer's plain list) is cut at its YIELD points into stages, and
the two micro-batches run the stages in this order (A = first micro-batch, B = second):

    A's first `delta` stages; then (A stage delta+i, B stage i) for every i; then B's last `delta`.
    delta is 0 for extend and 2 for decode. E.g. 4 stages, delta 2:  A0 A1 | A2 B0 | A3 B1 | B2 B3

The ops are the very methods `forward()` runs, and each micro-batch has its own `OpState`, so
the overlapped and the plain path cannot drift, and cross-talk between micro-batches raises.

Splitting (model/distributed/tbo_rules.py): a batch is cut at one token index, decode in half, extend where
the token sums balance (between sequences, or inside one sequence that dominates: the two-chunk
split). With EP every rank must take the same path, since the all-to-alls pair up in order, so
each forward starts with one all-reduce, the vote (SGLang's `TboDPAttentionPreparer`): every rank
sends its mode (an idle rank: none) and token count; the group overlaps when all ranks with tokens
run the same mode and the busiest one has enough tokens (`TboRules.pays`). A rank whose own cut
leaves a micro-batch empty (one decode sequence, one extend token) or that has no tokens at all
(`forward_idle`) still takes part: an empty micro-batch runs only the MoE ops that hold the
collectives (`LayerStack.empty_op`), on zero rows, in the same interleaved order. Otherwise every
rank runs the plain path.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepseek_pd.model.attention.policy import method_with_prefix
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.layer_ops import (LAYER_BOUNDARY_KEYS, TBO_DECODE_MOE_OPS, TBO_PREFILL_MOE_OPS, YIELD,
                                         EmptyBatch, LayerStack, Op, OpState, op_method)
from deepseek_pd.model.kv.layer_progress import KV_WRITE_OP
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.distributed.tbo_rules import TboRules

if TYPE_CHECKING:
    from deepseek_pd.model.kv.layer_progress import LayerProgress

TBO_MOE_OPS: dict[ForwardMode, tuple[str, ...]] = {
    ForwardMode.EXTEND: TBO_PREFILL_MOE_OPS,
    ForwardMode.DECODE: TBO_DECODE_MOE_OPS,
}
DELTA_STAGES: dict[ForwardMode, int] = {ForwardMode.EXTEND: 0, ForwardMode.DECODE: 2}
# The vote's mode codes; an idle rank sends (len, -1), which no MIN/MAX of real codes is moved by.
_MODES: tuple[ForwardMode, ...] = (ForwardMode.EXTEND, ForwardMode.DECODE)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageOp:
    layer_id: int
    name: str
    run: Op
    run_empty: Op | None  # what an empty micro-batch runs instead (LayerStack.empty_op)


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
                current.append(StageOp(layer.layer_id, name, op_method(layer, name), model.empty_op(layer, name)))
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


@dataclass
class MicroBatch:
    """Tokens [t0, t1) of a batch as a batch of its own, and how many of its sequences end inside it
    (the first `complete`; a last sequence cut at t1 has no output row here)."""

    batch: ForwardBatch
    complete: int

    @property
    def output_rows(self) -> torch.Tensor:
        return self.batch.last_token_index[:self.complete]


def micro_batch(batch: ForwardBatch, t0: int, t1: int) -> MicroBatch | None:
    """Tokens [t0, t1) of `batch` (None if empty). A sequence cut at t0 continues after a prefix
    that now includes its tokens before t0; one cut at t1 ends there. Same KV pool, pages, mode."""
    if t1 <= t0:
        return None
    offsets = batch.qo_offsets
    first = bisect.bisect_right(offsets, t0) - 1  # the sequence holding token t0
    last = bisect.bisect_left(offsets, t1) - 1  # the sequence holding token t1 - 1
    head, tail = t0 - offsets[first], offsets[last + 1] - t1  # tokens cut off the first / last sequence
    prefix_lens = list(batch.prefix_lens[first:last + 1])
    extend_lens = list(batch.extend_lens[first:last + 1])
    prefix_lens[0] += head
    extend_lens[0] -= head
    extend_lens[-1] -= tail
    seq_lens = batch.seq_lens_t[first:last + 1]
    if tail:
        seq_lens = seq_lens.clone()
        seq_lens[-1] -= tail
    method = method_with_prefix(batch.attention_method, any(prefix_lens))
    part = dataclasses.replace(
        batch, input_ids=batch.input_ids[t0:t1], positions=batch.positions[t0:t1],
        out_slots=batch.out_slots[t0:t1], token_seq=batch.token_seq[t0:t1] - first,
        qo_indptr=batch.qo_indptr[first:last + 2].clamp(t0, t1) - t0, page_table=batch.page_table[first:last + 1],
        seq_lens_t=seq_lens, prefix_lens=tuple(prefix_lens), extend_lens=tuple(extend_lens),
        page_lists=batch.page_lists[first:last + 1], attention_method=method, derived={},
        counted_tokens=None if batch.counted_tokens is None else batch.counted_tokens[t0:t1])
    return MicroBatch(part, len(extend_lens) - (1 if tail else 0))


class TwoBatchOverlap:
    """Runs a model's layers over two interleaved micro-batches; built once per model.

    Needs only the `LayerStack` interface of the model (layers, initial/final state, the plain loop
    for the fallback, the ops of an empty micro-batch), not the model class. `stats` counts this
    rank's forwards by path ("overlapped", "plain"; idle ones included) and the non-empty
    micro-batches it ran ("micro_batches").
    """

    def __init__(self, model: LayerStack, parallel: ParallelInfo, rules: TboRules = TboRules()) -> None:
        self.model = model
        self.parallel = parallel
        self.rules = rules
        self.stages = {mode: build_stages(model, mode) for mode in ForwardMode}
        self.stats = {"overlapped": 0, "plain": 0, "micro_batches": 0}
        self._split_logged = False

    def vote(self, mode: ForwardMode | None, num_tokens: int, device: torch.device | str) -> ForwardMode | None:
        """The group's decision for this forward (every rank calls it once, `mode` None when idle):
        the mode all ranks overlap in, or None (all run the plain path). One all-reduce."""
        low, high = (_MODES.index(mode),) * 2 if mode is not None else (len(_MODES), -1)
        low, neg_high, neg_busiest = self.parallel.min_over_ranks([low, -high, -num_tokens], device)
        if low != -neg_high:  # ranks with tokens run different modes, or none has tokens
            return None
        agreed = _MODES[low]
        return agreed if self.rules.pays(agreed, -neg_busiest) else None

    def final_hidden(self, batch: ForwardBatch, trace: list[TraceEntry] | None = None,
                     progress: "LayerProgress | None" = None, every_token: bool = False) -> torch.Tensor:
        """Final-normed hidden states of each sequence's last new token `[B, H]`, as the plain
        path returns them; with `every_token`, of every new token `[T, H]` in order (a speculative
        verify reads them all). `trace`, if given, receives every op run, in order. `progress`
        hears of a layer's KV write once both micro-batches have written it."""
        model = self.model
        if self.vote(batch.mode, batch.num_tokens, batch.input_ids.device) is None:
            self.stats["plain"] += 1
            rows = None if every_token else batch.last_token_index
            return model.final_hidden(model.run_layers(batch, progress), rows)
        cut = self.rules.split_token(batch.mode, batch.extend_lens)
        if not self._split_logged:  # once: that the overlapped path runs here at all (logs, tests)
            self._split_logged = True
            log.info("two-batch overlap: split a %s batch of %d sequences, %d tokens, at token %d",
                     batch.mode.name.lower(), batch.batch_size, batch.num_tokens, cut)
        parts = (micro_batch(batch, 0, cut), micro_batch(batch, cut, batch.num_tokens))
        states = self._run(batch.mode, parts, trace, progress)
        outputs = []
        for part, state in zip(parts, states):
            if part is None:
                state.expect_only(frozenset())
            elif every_token:  # the micro-batches hold tokens [0, cut) and [cut, T): in order
                outputs.append(model.final_hidden(state))
            elif part.complete:
                outputs.append(model.final_hidden(state, part.output_rows))
            else:  # only the first chunk of a sequence: its last row is no sequence's last token
                state.expect_only(LAYER_BOUNDARY_KEYS)
        return torch.cat(outputs)

    def idle(self, mode: ForwardMode, device: torch.device | str) -> bool:
        """This rank has no tokens this step: votes as idle and, if the group overlaps, runs the
        schedule with two empty micro-batches. False: the caller runs the plain idle forward in `mode`."""
        agreed = self.vote(None, 0, device)
        if agreed is None:
            self.stats["plain"] += 1
            return False
        self._run(agreed, (None, None))
        return True

    def _run(self, mode: ForwardMode, parts: tuple["MicroBatch | None", ...], trace: list[TraceEntry] | None = None,
             progress: "LayerProgress | None" = None) -> list[OpState]:
        """The interleaved schedule of `mode` over `parts` (None: an empty micro-batch)."""
        writers = sum(part is not None for part in parts)  # non-empty micro-batches: they write KV
        self.stats["overlapped"] += 1
        self.stats["micro_batches"] += writers
        model, stand_in = self.model, EmptyBatch(mode)
        states = [OpState() if part is None else model.initial_state(part.batch) for part in parts]
        stages = self.stages[mode]
        written: dict[int, int] = {}  # layer id -> micro-batches whose KV write has run
        for micro, index in interleaved_order(len(stages), DELTA_STAGES[mode]):
            part = parts[micro]
            for op in stages[index]:
                if part is not None:
                    op.run(states[micro], part.batch)
                elif op.run_empty is not None:
                    op.run_empty(states[micro], stand_in)
                else:
                    continue
                if trace is not None:
                    trace.append((micro, op.layer_id, op.name))
                if progress is not None and part is not None and op.name == KV_WRITE_OP:
                    written[op.layer_id] = written.get(op.layer_id, 0) + 1
                    if written[op.layer_id] == writers:
                        progress.kv_written(op.layer_id)
        return states
