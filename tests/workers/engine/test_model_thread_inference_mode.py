"""Every call a worker's model thread makes runs under inference mode (workers/engine/model_thread.py).

The model's own `no_grad` leaves autograd's per-op bookkeeping on; the runner benches time the
runner under inference mode, so a worker's forward held against them must run the same way. A call
through the model thread, and a prefill worker's round, see inference mode on and make inference
tensors; the round's logits equal, bit for bit, the same extend run without it.
"""
from __future__ import annotations

import asyncio
import random

import torch

from deepseek_pd.model.runner import ExtendSeq
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.model_thread import ModelThread
from pdtest.pd_engine_harness import CHUNK, PDPair, oracle, runner


def test_the_model_thread_runs_each_call_in_inference_mode() -> None:
    thread = ModelThread("test-model")
    try:
        seen = asyncio.run(thread.run(lambda: (torch.is_inference_mode_enabled(), torch.ones(2).is_inference())))
    finally:
        thread.close()
    assert seen == (True, True)


def test_a_prefill_round_runs_in_inference_mode_with_the_same_logits() -> None:
    rng = random.Random()
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randint(2, CHUNK))]  # one round
    reference = runner()
    pages = reference.kv_pool.alloc(reference.kv_pool.pages_for_tokens(len(prompt)))
    expected = reference.extend([ExtendSeq(prompt, 0, pages)])  # the model's no_grad alone
    assert not expected.is_inference()
    seen: list[tuple[bool, torch.Tensor]] = []

    async def run():
        async with PDPair("grpc") as pair:
            extend = pair.prefill.runner.extend

            def traced(seqs, progress=None, **kwargs):
                logits = extend(seqs, progress=progress, **kwargs)
                seen.append((torch.is_inference_mode_enabled(), logits))
                return logits
            pair.prefill.runner.extend = traced
            outcome = await pair.run(prompt, SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True), "im")
            await pair.wait_pools_clean()
            return outcome

    prefill, decode = asyncio.run(run())
    assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
    assert seen and all(mode and logits.is_inference() for mode, logits in seen)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0][1], expected, rtol=0, atol=0)
