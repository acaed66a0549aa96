"""`run_extend` takes the rows it samples to the device through `upload` (pinned, asynchronous):
a synchronous copy there (`torch.tensor(rows, device=...)`) waited for the whole forward before a
sampling kernel was queued. On CUDA, test_extend_step_cuda.py counts the waits themselves; here,
on the CPU, the index's way up and the tokens it picks (against sampling the rows' logits directly).
"""
from __future__ import annotations

import random

from deepseek_pd.model.runner import ExtendSeq
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.workers.engine import extend_step
from pdtest.pd_engine_harness import runner


def test_the_rows_go_up_through_upload_and_pick_their_logits(monkeypatch) -> None:
    rng = random.Random()
    model = runner()
    vocab = model.model_config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(3, 24))] for _ in range(rng.randint(2, 4))]
    rows = sorted(rng.sample(range(len(prompts)), rng.randint(1, len(prompts))))
    params = SamplingParams(temperature=0.0, max_new_tokens=1)

    def seqs() -> list[ExtendSeq]:
        return [ExtendSeq(p, 0, model.kv_pool.alloc(model.kv_pool.pages_for_tokens(len(p)))) for p in prompts]

    expected = model.extend(seqs())[rows].argmax(dim=-1).tolist()  # one row of logits per prompt: its last token's
    uploads: list[list[int]] = []
    real = extend_step.upload
    monkeypatch.setattr(extend_step, "upload", lambda host, device: uploads.append(host.tolist()) or real(host, device))
    states = [SamplingState.create(params, prompts[r], vocab) for r in rows]
    sampled = extend_step.run_extend(model, Sampler(), seqs(), rows, states)
    assert uploads == [rows]
    assert sampled.token_ids == expected
