"""A speculative step on the GPU queues everything without waiting for the device
(model/speculative/decoder.py `launch`): every step whose rows all verify k + 1 tokens (so its
draft steps, verify and catch-up replay CUDA graphs) runs under CUDA's sync debug mode set to
"error", which raises at any synchronising call (`.item()`, `.tolist()`, a blocking copy, a
value-sized op), including the steps launched before the step before them is read (positions and
KV slots filled in on the device, future_positions.py). Only `finish`, the step's one read, waits.
Outputs equal the engine without speculation (greedy and seeded sampling with penalties and top
logprobs).

Run on the GPU machine: `pytest -q -s tests/model/speculative/test_speculative_sync_gpu.py`."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.offline import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(600)]
STEPS = 3


def test_a_graphed_speculative_step_never_waits_for_the_device(tmp_path):
    seed = random.randrange(1000)
    print(f"seed={seed}")
    rng = random.Random(seed)
    path = str(make_tiny_model(tmp_path / "v3", seed=seed, mtp_layers=1))
    kw = dict(device="cuda", dtype="float32", attention_backend="triton", moe_backend="triton", page_size=16)
    spec = Engine(path, speculative_num_steps=STEPS, cuda_graph=True, **kw)
    decoder = spec.speculative
    launch, guarded, ahead = decoder.launch, [0], [0]

    def checked_launch(requests, num_steps=None, after=None):
        # Rows that all draft k (room left, a draft from the last step) verify through the graphs; a
        # launch ahead of an unread step drafts for the most that step may have emitted.
        room = STEPS + 1 if after is None else 2 * (STEPS + 1)
        full = all(r.finished or (id(r) in decoder._drafts and r.max_new - len(r.output_ids) > room)
                   for r in requests)
        if not full:
            return launch(requests, num_steps, after)
        guarded[0] += 1
        ahead[0] += after is not None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(requests, num_steps, after)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    decoder.launch = checked_launch
    prompts = [[rng.randrange(2, spec.vocab_size) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, top_logprobs_num=rng.choice([0, 2]),
                             frequency_penalty=rng.choice([0.0, 0.5]),
                             **(dict(temperature=0.0) if n % 2 else
                                dict(temperature=0.8, top_k=20, top_p=0.9, seed=rng.randrange(1 << 30))))
              for n in range(len(prompts))]
    got = spec.generate_batch(prompts, params)
    assert guarded[0] > 0 and ahead[0] > 0
    replays = spec.runner.spec_forwards.graphs.replays
    print(f"guarded steps {guarded[0]} ({ahead[0]} launched before the step before was read), replays {replays}")
    assert replays["verify"] > 0 and replays["catch_up"] > 0 and replays["draft"] > 0, replays
    want = Engine(path, **kw).generate_batch(prompts, params)
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids, seed
