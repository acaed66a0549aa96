"""On CUDA, `run_extend` waits for the GPU once per round: the forward and the first-token sample
are queued back to back, and the one copy of the sampled tokens to the host is the wait.

Its contract stays: when it returns, every kernel it queued, the KV writes included, has run
(the transport reads the pages next, outside the stream's order). Before, an explicit stream sync
between the forward and the sample left the GPU idle while the host launched the sampling kernels.
"""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from deepseek_pd.model.runner import ExtendSeq
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.workers.engine.extend_step import run_extend
from pdtest.pd_engine_harness import runner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_sampling_round_waits_once_and_returns_with_the_stream_idle(monkeypatch) -> None:
    rng = random.Random()
    model = runner(device="cuda")
    prompts = [[rng.randrange(2, model.model_config.vocab_size) for _ in range(rng.randint(3, 40))]
               for _ in range(rng.randint(1, 3))]
    seqs = [ExtendSeq(p, 0, model.kv_pool.alloc(model.kv_pool.pages_for_tokens(len(p)))) for p in prompts]
    rows = sorted(rng.sample(range(len(seqs)), rng.randint(1, len(seqs))))
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    states = [SamplingState.create(params, prompts[r], model.model_config.vocab_size, device="cuda") for r in rows]
    run_extend(model, Sampler(), seqs, rows, states)  # kernels loaded, allocator warm
    states = [SamplingState.create(params, prompts[r], model.model_config.vocab_size, device="cuda") for r in rows]
    waits: list[str] = []
    stream_sync, device_sync = torch.cuda.Stream.synchronize, torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda s: waits.append("stream") or stream_sync(s))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append("device") or device_sync(*a))
    torch.cuda._sleep(10 ** 8)  # the GPU is busy when the round is queued: a wait must really wait
    sampled = run_extend(model, Sampler(), seqs, rows, states)
    assert torch.cuda.current_stream().query(), "run_extend returned before its kernels (the KV writes) ran"
    assert waits == [], f"explicit waits besides the sampled tokens' copy: {waits}"
    assert len(sampled.token_ids) == len(rows)


def test_after_the_forward_the_one_host_wait_is_the_tokens_copy(monkeypatch) -> None:
    """torch's sync-debug mode sees every synchronizing op (the synchronous copies a Python-level
    count of synchronize calls misses): once the forward is queued, the first-token part of the
    round may wait only for its tokens' copy to the host. The rows' index, built with a synchronous
    copy, waited for the whole forward before the sampling kernels were queued."""
    rng = random.Random()
    model = runner(device="cuda")
    prompts = [[rng.randrange(2, model.model_config.vocab_size) for _ in range(rng.randint(3, 40))]
               for _ in range(rng.randint(1, 3))]
    rows = sorted(rng.sample(range(len(prompts)), rng.randint(1, len(prompts))))
    params = SamplingParams(temperature=0.0, max_new_tokens=1)

    def round_once(debug: bool):
        seqs = [ExtendSeq(p, 0, model.kv_pool.alloc(model.kv_pool.pages_for_tokens(len(p)))) for p in prompts]
        states = [SamplingState.create(params, prompts[r], model.model_config.vocab_size, device="cuda") for r in rows]
        extend = model.extend

        def extend_then_watch(*args, **kwargs):
            logits = extend(*args, **kwargs)  # the runner's own waits are not the round's
            if debug:
                torch.cuda.set_sync_debug_mode("warn")
            return logits
        monkeypatch.setattr(model, "extend", extend_then_watch)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                sampled = run_extend(model, Sampler(), seqs, rows, states)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            monkeypatch.setattr(model, "extend", extend)
            for seq in seqs:
                model.kv_pool.free(list(seq.pages))
        return sampled, [str(w.message) for w in seen if "synchroniz" in str(w.message)]

    round_once(False)  # kernels loaded, allocators warm
    sampled, syncs = round_once(True)
    assert len(sampled.token_ids) == len(rows)
    assert len(syncs) == 1, f"synchronizing ops after the forward besides the tokens' copy: {syncs}"
