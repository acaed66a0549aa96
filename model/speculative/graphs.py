"""`SpeculativeGraphs`: the CUDA graphs of a speculative step, built with the decode graphs.

    draft    the MTP layer's draft step, every bucket (draft_graph.py)
    verify   the verify forward of k + 1 tokens per sequence, every bucket (verify_graph.py);
             None in EP groups, where a verify runs DeepEP's normal mode, which does not capture
    catch_up the MTP layer over k + 1 tokens per sequence (the decoder pads the emitted tokens to
             the verify's positions when every sequence verified k + 1), every bucket; None in EP
             groups, as the verify `ModelRunner.draft`
and `extend_hidden` try a replay first and run eagerly when it returns None; `replays` counts them.
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
    def __init__(self, model: DeepseekForCausalLM, kv_pool: KVPool, config: CudaGraphConfig, num_steps: int,
                 scratch_page: int) -> None:
        self.draft_graphs = DraftGraphRunner(model, kv_pool, config, scratch_page)
        self.verify_graphs = self.catch_up_graphs = None
        if model.options.parallel.ep_size == 1:
            self.verify_graphs = VerifyGraphRunner(model, kv_pool, config, num_steps + 1, scratch_page)
            self.catch_up_graphs = VerifyGraphRunner(model, kv_pool, config, num_steps + 1, scratch_page, mtp=True)
        self.replays = {"draft": 0, "verify": 0, "catch_up": 0}

    def draft(self, token_ids: Sequence[int], positions: Sequence[int], pages: Sequence[Sequence[int]],
              prev_hidden: torch.Tensor) -> torch.Tensor | None:
        out = self.draft_graphs.draft(token_ids, positions, pages, prev_hidden)
        self.replays["draft"] += out is not None
        return out

    def verify(self, token_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
               pages: Sequence[Sequence[int]]) -> torch.Tensor | None:
        out = None if self.verify_graphs is None else self.verify_graphs.run(token_ids, prefix_lens, pages)
        self.replays["verify"] += out is not None
        return out

    def catch_up(self, token_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
                 pages: Sequence[Sequence[int]], prev_hidden: torch.Tensor) -> torch.Tensor | None:
        if self.catch_up_graphs is None:
            return None
        out = self.catch_up_graphs.run(token_ids, prefix_lens, pages, prev_hidden)
        self.replays["catch_up"] += out is not None
        return out
