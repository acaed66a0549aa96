"""A speculative step reads nothing back to the host but its one result (model/speculative/decoder.py).

Every speculative step of the offline engine runs under `HostReads` (pdtest/host_reads.py: every
`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, value-sized op): the draft chain, the verify's input
ids, acceptance, the sampling state's advance, the catch-up and the next drafts must read nothing,
and so must the model's forwards (`extend_hidden`, `draft`: the eager "torch" MoE keeps its expert
counts on the device on the CPU, model/moe/experts.py; the GPU test test_speculative_sync_gpu.py
runs the whole step, graphed, under CUDA's sync debug mode). Allowed, and counted apart: `finish`,
the step's one read. Over a batch mix that exercises every sampling feature (greedy, seeded and
unseeded sampling, top-k/top-p/min-p, penalties, top logprobs), whose greedy and seeded outputs the
same model without speculation gives too.
"""
from __future__ import annotations

import random

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.offline import Engine
from pdtest.host_reads import HostReads

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


def _params(rng: random.Random) -> SamplingParams:
    sampled = rng.random() < 0.6
    return SamplingParams(
        temperature=rng.choice([0.7, 1.0, 1.3]) if sampled else 0.0, top_k=rng.choice([-1, 5]),
        top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.05]), seed=rng.randrange(1 << 30) if sampled else None,
        frequency_penalty=rng.choice([0.0, 0.4]), presence_penalty=rng.choice([0.0, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.2]), top_logprobs_num=rng.choice([0, 2]),
        max_new_tokens=rng.randint(2, 14), ignore_eos=True)


def test_a_speculative_step_reads_back_only_its_result(tiny_mtp_checkpoint, module_seed):
    rng = random.Random(module_seed)
    spec = Engine(str(tiny_mtp_checkpoint), page_size=4, speculative_num_steps=3)
    decoder = spec.speculative
    step, finish = decoder.step, getattr(decoder, "finish", None)
    steps, finishes, reads = [0], [0], []
    active: list[HostReads | None] = [None]  # the guard of the step running now (prefill runs unguarded)

    def allowed(fn, count=None):
        def run(*args, **kwargs):
            if active[0] is None:
                return fn(*args, **kwargs)
            if count is not None:
                count[0] += 1
            with active[0].allowed():
                return fn(*args, **kwargs)
        return run

    def guarded_step(*args, **kwargs):
        steps[0] += 1
        with HostReads() as guard:
            reads.append(guard)
            active[0] = guard
            try:
                return step(*args, **kwargs)
            finally:
                active[0] = None

    if finish is not None:
        decoder.finish = allowed(finish, finishes)
    decoder.step = guarded_step
    prompts = [[rng.randrange(2, spec.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    params = [_params(rng) for _ in prompts]
    got = spec.generate_batch(prompts, params)

    assert steps[0] > 0
    seen = [read for guard in reads for read in guard.seen]
    assert seen == [], f"host reads inside speculative steps (what, where): {seen[:10]}"
    assert finishes[0] == steps[0]  # one result read per step
    base = Engine(str(tiny_mtp_checkpoint), page_size=4)
    for a, b, p in zip(got, base.generate_batch(prompts, params), params):
        if p.greedy or p.seed is not None:
            assert a.output_ids == b.output_ids, (module_seed, p)
