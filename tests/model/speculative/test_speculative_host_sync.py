"""A speculative step reads nothing back to the host but its one result (model/speculative/decoder.py),
and the next step is launched before that result is read (future_positions.py).

Every speculative launch of the offline engine runs under `HostReads` (pdtest/host_reads.py: every
`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, value-sized op): the draft chain, the verify's input
ids, acceptance, the sampling state's advance, the catch-up and the next drafts must read nothing,
and so must the model's forwards (`extend_hidden`, `draft`: the eager "torch" MoE keeps its expert
counts on the device on the CPU, model/moe/experts.py; the GPU test test_speculative_sync_gpu.py
runs the whole step, graphed, under CUDA's sync debug mode). `finish`, the step's one read, runs
outside; a launch over the same rows as the step in flight must come before that step's `finish`
(step N+1's positions and KV slots come from step N's counts on the device). Over a batch mix that
exercises every sampling feature (greedy, seeded and unseeded sampling, top-k/top-p/min-p,
penalties, top logprobs), whose greedy and seeded outputs (and logprobs) are those of the same model
without speculation and of the steps launched in order.
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
    launch, finish = decoder.launch, decoder.finish
    events: list[tuple[str, int, tuple[int, ...]]] = []  # (launch | finish, step id, its rows)
    reads, launched_steps = [], []
    active: list[HostReads | None] = [None]  # the guard of the launch running now (prefill runs unguarded)

    def guarded_launch(*args, **kwargs):
        with HostReads() as guard:
            reads.append(guard)
            active[0] = guard
            try:
                launched = launch(*args, **kwargs)
            finally:
                active[0] = None
        if launched is not None:
            launched_steps.append(launched)
            events.append(("launch", id(launched), tuple(id(r) for r in launched.requests)))
        return launched

    def counted_finish(launched):
        events.append(("finish", id(launched), tuple(id(r) for r in launched.requests)))
        return finish(launched)

    decoder.launch, decoder.finish = guarded_launch, counted_finish
    prompts = [[rng.randrange(2, spec.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    params = [_params(rng) for _ in prompts]
    got = spec.generate_batch(prompts, params)

    launches = [e for e in events if e[0] == "launch"]
    assert launches
    seen = [read for guard in reads for read in guard.seen]
    assert seen == [], f"host reads inside speculative launches (what, where): {seen[:10]}"
    assert sorted(e[1] for e in events if e[0] == "finish") == sorted(e[1] for e in launches)  # one read each
    # The launch path never waits for the step before it: a launch over the same rows as the step in
    # flight comes before that step is read (its positions and slots from the device's counts).
    unread: dict[int, tuple[int, ...]] = {}
    waited = []
    last_launch = None
    for kind, step, rows in events:
        if kind == "launch":
            if last_launch is not None and last_launch[1] == rows and last_launch[0] not in unread:
                waited.append(len(waited))
            unread[step] = rows
            last_launch = (step, rows)
        else:
            unread.pop(step)
    ahead = sum(1 for kind, step, rows in events if kind == "launch") - 1 - len(waited)
    assert not waited, f"{len(waited)} launches waited for the step before them ({ahead} did not)"
    assert ahead > 0
    # Launching ahead of a step whose rows are not the next step's (a request left) is refused.
    with pytest.raises(ValueError, match="rows of the step before"):
        launch(launched_steps[0].requests[1:], after=launched_steps[0])

    base = Engine(str(tiny_mtp_checkpoint), page_size=4)
    in_order = Engine(str(tiny_mtp_checkpoint), page_size=4, speculative_num_steps=3, speculative_overlap=False)
    for a, b, c, p in zip(got, base.generate_batch(prompts, params), in_order.generate_batch(prompts, params),
                          params):
        if p.greedy or p.seed is not None:
            assert a.output_ids == b.output_ids == c.output_ids, (module_seed, p)
            assert a.output_logprobs == pytest.approx(c.output_logprobs, abs=1e-5), (module_seed, p)
