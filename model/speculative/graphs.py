"""`SpeculativeGraphs`: the CUDA graphs of a speculative step, built with the decode graphs.

    draft    the MTP layer's draft step, every bucket (draft_graph.py)
    verify   the verify forward of k + 1 tokens per sequence, every bucket (verify_graph.py), for
             the configured k, or for every k in 0..N with the adaptive draft count (`draft_counts`,
             `rules.graph_draft_counts`); none in EP groups, where a verify runs DeepEP's normal
             mode, which does not capture
    catch_up the MTP layer over k + 1 tokens per sequence (the decoder pads the emitted tokens to
             the verify's positions when every sequence verified k + 1), as the verify for k >= 1
             (k = 0's catch-up is one token per sequence: the draft graph's shape)
All share the decode graphs' memory pool (a runner replays one graph at a time). `ModelRunner.draft`
and `extend_hidden` try a replay first and run eagerly when it returns None; `replays` counts them.
Each takes the step's device token ids (`input_ids`), copied device-to-device over the packed
host ids, so a speculative step feeds its drafts without reading them back, and likewise its
device start positions (`starts`: the host packed the bounds, future_positions.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.graph_inputs import CudaGraphConfig
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.speculative.draft_graph import DraftGraphRunner
from deepseek_pd.model.speculative.verify_graph import VerifyGraphRunner


class SpeculativeGraphs:
    def __init__(self, model: DeepseekForCausalLM, kv_pool: KVPool, config: CudaGraphConfig,
                 draft_counts: Sequence[int], scratch_page: int, pool: object | None = None) -> None:
        self.draft_graphs = DraftGraphRunner(model, kv_pool, config, scratch_page, pool)
        # The padding rows' page (garbage by design): the decoder also points a verify row's
        # positions past its own pages here when it pads the row to the step's verify length.
        self.scratch_page = scratch_page
        # By tokens per sequence (k + 1); none in EP groups.
        self.verify_graphs: dict[int, VerifyGraphRunner] = {}
        self.catch_up_graphs: dict[int, VerifyGraphRunner] = {}
        if model.options.parallel.ep_size == 1:
            for q in sorted({k + 1 for k in draft_counts}, reverse=True):
                self.verify_graphs[q] = VerifyGraphRunner(model, kv_pool, config, q, scratch_page, pool=pool)
                if q > 1:
                    self.catch_up_graphs[q] = VerifyGraphRunner(model, kv_pool, config, q, scratch_page, mtp=True,
                                                                pool=pool)
        self.replays = {"draft": 0, "verify": 0, "catch_up": 0}

    def draft(self, token_ids: Sequence[int], positions: Sequence[int], pages: Sequence[Sequence[int]],
              prev_hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
              starts: torch.Tensor | None = None) -> torch.Tensor | None:
        out = self.draft_graphs.draft(token_ids, positions, pages, prev_hidden, input_ids, starts)
        self.replays["draft"] += out is not None
        return out

    def verify(self, token_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
               pages: Sequence[Sequence[int]], input_ids: torch.Tensor | None = None,
               starts: torch.Tensor | None = None) -> torch.Tensor | None:
        graphs = self.verify_graphs.get(len(token_ids[0]) if token_ids else 0)
        out = None if graphs is None else graphs.run(token_ids, prefix_lens, pages, input_ids=input_ids, starts=starts)
        self.replays["verify"] += out is not None
        return out

    def catch_up(self, token_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
                 pages: Sequence[Sequence[int]], prev_hidden: torch.Tensor,
                 input_ids: torch.Tensor | None = None, starts: torch.Tensor | None = None) -> torch.Tensor | None:
        graphs = self.catch_up_graphs.get(len(token_ids[0]) if token_ids else 0)
        if graphs is None:
            return None
        out = graphs.run(token_ids, prefix_lens, pages, prev_hidden, input_ids, starts)
        self.replays["catch_up"] += out is not None
        return out
