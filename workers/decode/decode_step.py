"""The model-thread side of one decode step: launch it, and later collect its tokens.

A step is launched without waiting for anything on the GPU: the inputs are packed on the host
(positions and page tables are host knowledge), the input token of a row that decoded in the
previous step is taken from that step's sampled tokens ON THE DEVICE (so step N+1 can be queued
before step N's tokens reach the host), the forward runs (CUDA-graph replay when it fits), the
whole batch is sampled on the device, and the token ids with their logprobs (and the top
logprobs of the rows that ask, `model/sampling/sampled_host.py`) start their one device-to-host copy.
`collect` waits for that copy only.

    step N   : launch ─────────────► GPU runs N ──► copy ──► collect(N) on the host
    step N+1 :          launch (input ids = N's tokens, gathered on the device) ─► GPU runs N+1

The sampling state of the rows lives in one `SamplingBatch` whose row order is the step's row
order; `launch` brings its membership up to date (rows that left are dropped, new rows appended).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from deepseek_pd.model.host_copy import HostCopy, upload
from deepseek_pd.model.runner import DecodeSeq, ModelRunner
from deepseek_pd.model.sampling.sampled_host import SampledTokens, pack, unpack
from deepseek_pd.model.sampling.batch import SamplingBatch
from deepseek_pd.model.sampling.state import SamplingState


@dataclass(frozen=True)
class DecodeRow:
    """One row's inputs. `prev_row >= 0`: the input token is the previous step's sample at that row;
    otherwise `token_id` (host-known: the first token, or one already collected)."""

    token_id: int
    prev_row: int
    position: int
    pages: Sequence[int]
    sampling: SamplingState


@dataclass
class LaunchedStep:
    owners: list  # the engine's request objects, in row order
    token_ids: torch.Tensor  # [B] long, on the device: the next step's input ids
    host: HostCopy  # [B, 2 + 2K] float64: token ids, logprobs, top logprobs (sampled_host.pack)
    top_counts: tuple[int, ...]  # each row's top_logprobs_num

    def collect(self) -> SampledTokens:
        return unpack(self.host.wait(), self.top_counts)


class DecodeStepper:
    """Owns the batched sampling state; every method runs in the model thread."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = torch.device(runner.model.options.device)
        self.sampling = SamplingBatch(runner.model_config.vocab_size, self.device)

    def launch(self, owners: list, rows: Sequence[DecodeRow], prev: LaunchedStep | None) -> LaunchedStep:
        self._sync_rows([row.sampling for row in rows])
        host_ids = [row.token_id if row.prev_row < 0 else 0 for row in rows]
        seqs = [DecodeSeq(token, row.position, row.pages) for token, row in zip(host_ids, rows)]
        input_ids = None
        if prev is not None and any(row.prev_row >= 0 for row in rows):
            prev_rows = torch.tensor([max(row.prev_row, 0) for row in rows], dtype=torch.long)
            from_prev = torch.tensor([row.prev_row >= 0 for row in rows])
            ids = torch.tensor(host_ids, dtype=torch.long)
            packed = upload(torch.stack([prev_rows, from_prev.long(), ids]), self.device)  # pinned, no wait
            input_ids = torch.where(packed[1].bool(), prev.token_ids[packed[0]], packed[2])
        logits = self.runner.decode(seqs, input_ids=input_ids)
        out = self.sampling.sample(logits)
        return LaunchedStep(owners, out.token_ids, HostCopy(pack(out)), out.top_counts)

    def reset(self) -> None:
        """After a failed step: the device-side sampling state can no longer be trusted."""
        self.sampling = SamplingBatch(self.runner.model_config.vocab_size, self.device)

    def _sync_rows(self, states: list[SamplingState]) -> None:
        wanted = {id(s) for s in states}
        gone = [s for s in self.sampling.states if id(s) not in wanted]
        if gone:
            self.sampling.remove(gone)
        have = {id(s) for s in self.sampling.states}
        for state in states:
            if id(state) not in have:
                self.sampling.add(state)
        if [id(s) for s in self.sampling.states] != [id(s) for s in states]:
            raise RuntimeError("decode rows are out of order with the sampling batch")
