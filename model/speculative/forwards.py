"""`SpeculativeForwards`: the forwards speculative decoding runs, for one `ModelRunner`.

    extend_hidden   the model over new tokens, every token's final-normed hidden state (a verify
                    of k + 1 tokens per sequence with `force_mla`, or a prefill round's extend)
    draft           the MTP layer over a batch (decode mode when each sequence has one token: a
                    draft step; else extend: a catch-up, or the prefill's MTP pass)
    follow          (attention-TP follower) the leader's announced speculative forward, replayed

Each runs as one step of the runner's group (`step`, model/distributed/step_sync.py) of its
kind: the model's, or the MTP layer's (ForwardKind.MTP), so that in an EP group the ranks without
that forward join that network's collectives. Under attention TP the leader announces each one
(`ForwardCall.output` "hidden" or "mtp", the MTP layer's input hidden states sent with it) and
the followers replay it. With CUDA graphs (`graphs`, model/speculative/graphs.py) a verify and a
draft step try a replay first (only when no expert load is recorded, so `counted` needs no replay). `starts` (device `[B]`): each sequence's true first position when the
seqs' `prefix_len`s only bound it (a step launched before the previous one was read,
future_positions.py).

`ModelRunner.extend_hidden` / `draft` / `logits` are the entry points; this object holds what
they need, not the runner, so it imports nothing of it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, ContextManager, Protocol, Sequence

import torch

from deepseek_pd.model.attention.policy import AttentionPolicy
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.distributed.step_sync import ForwardKind
from deepseek_pd.model.distributed.tp_replay import ForwardCall, TpReplay
from deepseek_pd.model.forward_batch import AttentionMethod, ForwardBatch, ForwardMode, checked_device_ids
from deepseek_pd.model.kv.layer_progress import LayerProgress
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.speculative.future_positions import with_device_starts
from deepseek_pd.model.speculative.graphs import SpeculativeGraphs

Step = Callable[[ForwardMode, ForwardKind], ContextManager[ForwardMode]]


class Seq(Protocol):
    """A sequence's new tokens after `prefix_len` cached ones, in `pages` (`runner.ExtendSeq`)."""

    token_ids: Sequence[int]
    prefix_len: int
    pages: Sequence[int]


class SpeculativeForwards:
    def __init__(self, model: DeepseekForCausalLM, kv_pool: KVPool, policy: AttentionPolicy, step: Step,
                 tp_replay: TpReplay | None, graphs: SpeculativeGraphs | None) -> None:
        self.model, self.kv_pool, self.policy = model, kv_pool, policy
        self.step, self.tp_replay, self.graphs = step, tp_replay, graphs

    def extend_hidden(self, seqs: Sequence[Seq], force_mla: bool = False,
                      progress: LayerProgress | None = None, input_ids: torch.Tensor | None = None,
                      starts: torch.Tensor | None = None, counted: torch.Tensor | None = None) -> torch.Tensor:
        with self.step(ForwardMode.EXTEND, ForwardKind.MODEL) as group_mode:
            if force_mla and progress is None and self.graphs is not None:  # graphs: no TP, no TBO
                hidden = self.graphs.verify([s.token_ids for s in seqs], [s.prefix_len for s in seqs],
                                            [s.pages for s in seqs], input_ids, starts)
                if hidden is not None:
                    return hidden
            self._lead(ForwardCall(ForwardMode.EXTEND, output="hidden", force_mla=force_mla), seqs, group_mode,
                       input_ids=input_ids, starts=starts)
            batch = self._batch(ForwardMode.EXTEND, seqs, group_mode, force_mla, input_ids, starts)
            batch.counted_tokens = counted
            return self.model.forward_hidden(batch, progress)

    def draft(self, seqs: Sequence[Seq], prev_hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
              starts: torch.Tensor | None = None, counted: torch.Tensor | None = None) -> torch.Tensor:
        mode = ForwardMode.DECODE if all(len(s.token_ids) == 1 for s in seqs) else ForwardMode.EXTEND
        with self.step(mode, ForwardKind.MTP) as group_mode:
            if self.graphs is not None and mode is group_mode:
                lists = [s.token_ids for s in seqs], [s.prefix_len for s in seqs], [s.pages for s in seqs]
                out = (self.graphs.draft([t[0] for t in lists[0]], *lists[1:], prev_hidden, input_ids, starts)
                       if mode is ForwardMode.DECODE else self.graphs.catch_up(*lists, prev_hidden, input_ids, starts))
                if out is not None:
                    return out
            self._lead(ForwardCall(mode, output="mtp"), seqs, group_mode, prev_hidden, input_ids, starts)
            batch = self._batch(mode, seqs, group_mode, input_ids=input_ids, starts=starts)
            batch.counted_tokens = counted
            return self.model.forward_mtp(batch, prev_hidden)

    @property
    def needs_host_lengths(self) -> bool:
        """Whether a forward needs its exact lengths on the host (attention TP announces host
        lengths to its followers; an attention backend without `device_lengths`, FlashInfer, plans
        from them): then `starts` cannot be used."""
        layers = [*self.model.layers, *(() if self.model.mtp is None else (self.model.mtp.layer,))]
        return self.tp_replay is not None or not all(getattr(layer.self_attn.backend, "device_lengths", False)
                                                     for layer in layers)

    def follow(self, call: ForwardCall, hidden: torch.Tensor | None, input_ids: torch.Tensor | None = None) -> None:
        """(attention-TP follower) Replays the leader's "hidden" or "mtp" call (with the leader's
        device input ids when it sent them); drops its output."""
        seqs = [_Seq(list(t), p, list(pg)) for t, p, pg in zip(call.token_ids, call.prefix_lens, call.pages)]
        batch = self._batch(call.mode, seqs, call.group_mode, call.force_mla, input_ids)
        if call.output == "mtp":
            self.model.forward_mtp(batch, hidden)
        else:
            self.model.forward_hidden(batch)

    def _lead(self, call: ForwardCall, seqs: Sequence[Seq], group_mode: ForwardMode,
              hidden: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
              starts: torch.Tensor | None = None) -> None:
        """(attention-TP leader) Announces a speculative forward to the followers (`follow`)."""
        if self.tp_replay is not None and self.tp_replay.is_leader:
            if starts is not None:
                raise ValueError("device start positions cannot be announced to attention-TP followers")
            call = replace(call, token_ids=tuple(tuple(s.token_ids) for s in seqs),
                           prefix_lens=tuple(s.prefix_len for s in seqs), pages=tuple(tuple(s.pages) for s in seqs),
                           group_mode=group_mode)
            self.tp_replay.lead(call, input_ids, self.kv_pool, hidden)

    def _batch(self, mode: ForwardMode, seqs: Sequence[Seq], group_mode: ForwardMode | None,
               force_mla: bool = False, input_ids: torch.Tensor | None = None,
               starts: torch.Tensor | None = None) -> ForwardBatch:
        batch = ForwardBatch.build(mode, [s.token_ids for s in seqs], [s.prefix_len for s in seqs],
                                   [s.pages for s in seqs], self.kv_pool, self.model.config.vocab_size,
                                   self.model.options.device)
        if input_ids is not None:  # the step's device tokens; the seqs' ids were placeholders
            batch.input_ids = checked_device_ids(input_ids, batch.num_tokens)
        if starts is not None:  # the seqs' prefix lengths bound the true ones (future_positions.py)
            with_device_starts(batch, starts)
        batch.group_mode = group_mode
        # Only absorbed MLA reads every length from the device; the other methods chunk by host lengths.
        mla = force_mla or starts is not None
        batch.attention_method = AttentionMethod.MLA if mla else self.policy.choose(mode, batch.prefix_lens)
        return batch


class _Seq:
    """A replayed call's sequence."""

    def __init__(self, token_ids: list[int], prefix_len: int, pages: list[int]) -> None:
        self.token_ids, self.prefix_len, self.pages = token_ids, prefix_len, pages
