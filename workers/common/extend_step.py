"""One extend forward plus the first token of every prompt it completes (prefill and colocated)."""
from __future__ import annotations

from typing import Sequence

import torch

from deepseek_pd.model.layer_progress import LayerProgress
from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.sampled_host import SampledTokens, pack, unpack
from deepseek_pd.model.sampling import Sampler, SamplingState


def run_extend(runner: ModelRunner, sampler: Sampler, seqs: Sequence[ExtendSeq], rows: Sequence[int],
               states: Sequence[SamplingState], progress: LayerProgress | None = None) -> SampledTokens:
    """Extends all `seqs`; samples one token for each of `rows` (with `states[i]` for rows[i]).

    Runs in the model thread. The sampler advances the states by the sampled token; one host copy
    at the end (tokens, logprobs and any top logprobs together). `progress` hears of each layer's
    KV write during the forward (layer-wise transfer).
    """
    logits = runner.extend(list(seqs), progress=progress)
    if logits.is_cuda:
        # The KV written by this forward is read next by the transport (copies or one-sided RDMA
        # writes) outside this stream's order: make it complete first.
        torch.cuda.current_stream(logits.device).synchronize()
    if not rows:
        return SampledTokens([], [], [])
    index = torch.tensor(list(rows), device=logits.device)
    out = sampler.sample(logits[index], list(states))
    return unpack(pack(out).cpu(), out.top_counts)
