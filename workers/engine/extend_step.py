"""One extend forward plus the first token of every prompt it completes (prefill and colocated)."""
from __future__ import annotations

from typing import Sequence

import torch

from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.kv.layer_progress import LayerProgress
from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.sampling.sampled_host import SampledTokens, pack, unpack
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.workers.engine.round_clock import RoundClock, timed_progress


def run_extend(runner: ModelRunner, sampler: Sampler, seqs: Sequence[ExtendSeq], rows: Sequence[int],
               states: Sequence[SamplingState], progress: LayerProgress | None = None,
               clock: RoundClock | None = None) -> SampledTokens:
    """Extends all `seqs`; samples one token for each of `rows` (with `states[i]` for rows[i]).

    Runs in the model thread. The sampler advances the states by the sampled token; one host copy
    at the end (tokens, logprobs and any top logprobs together). `progress` hears of each layer's
    KV write during the forward (layer-wise transfer). `clock`, if given, gets the phases of the
    round's model-thread part (round_clock.py), from host timestamps only.
    """
    logits = runner.extend(list(seqs), progress=timed_progress(clock, progress))
    _mark(clock, "launch")
    if not rows:
        if logits.is_cuda:
            # The KV written by this forward is read next by the transport (copies or one-sided RDMA
            # writes) outside this stream's order: make it complete first.
            torch.cuda.current_stream(logits.device).synchronize()
        _mark(clock, "gpu_wait")
        return SampledTokens([], [], [])
    # Pinned and asynchronous: `torch.tensor(rows, device=...)` is a synchronous copy, which waited
    # for the whole forward before a sampling kernel was queued (a second, hidden wait).
    index = upload(torch.tensor(list(rows), dtype=torch.int64), logits.device)
    out = sampler.sample(logits[index], list(states))
    packed = pack(out)
    _mark(clock, "sample")
    # The one wait: the copy to the host waits for everything queued on this stream before it, the
    # KV writes included, so the pages are complete on return as after the sync above; and the
    # sampling kernels are queued while the forward still runs (a sync before them left the GPU
    # idle while the host launched them).
    on_host = packed.cpu()
    _mark(clock, "gpu_wait")
    return unpack(on_host, out.top_counts)


def _mark(clock: RoundClock | None, phase: str) -> None:
    if clock is not None:
        clock.mark(phase)


def run_extend_with_mtp(runner: ModelRunner, sampler: Sampler, seqs: Sequence[ExtendSeq], rows: Sequence[int],
                        states: Sequence[SamplingState], prompts: Sequence[Sequence[int]],
                        progress: LayerProgress | None = None,
                        clock: RoundClock | None = None) -> tuple[SampledTokens, list]:
    """`run_extend` for a runner with its MTP layer (speculative decoding): the same forward and
    first tokens, then the MTP layer over the round's tokens (`model.speculative.mtp_over_extend`),
    so the pages sent or decoded from hold the MTP layer's KV too. `prompts[i]` is sequence i's
    whole prompt. Also returns each of `rows`' first draft and MTP hidden state. `clock`: as in
    `run_extend`, with the MTP pass as its own phase."""
    from deepseek_pd.model.speculative.decoder import mtp_over_extend

    hidden = runner.extend_hidden(list(seqs), progress=timed_progress(clock, progress))
    _mark(clock, "launch")
    sampled = SampledTokens([], [], [])
    if rows:
        ends = torch.tensor([len(s.token_ids) for s in seqs]).cumsum(0) - 1
        index = upload(ends[torch.tensor(list(rows))], hidden.device)  # no wait (run_extend's index)
        out = sampler.sample(runner.logits(hidden[index]), list(states))
        packed = pack(out)
        _mark(clock, "sample")
        on_host = packed.cpu()
        _mark(clock, "gpu_wait")
        sampled = unpack(on_host, out.top_counts)
    drafts = mtp_over_extend(runner, seqs, hidden, prompts, dict(zip(rows, sampled.token_ids)))
    _mark(clock, "mtp")
    if hidden.is_cuda:  # as run_extend: the transport reads these pages outside this stream's order
        torch.cuda.current_stream(hidden.device).synchronize()
    _mark(clock, "gpu_wait")
    return sampled, drafts
