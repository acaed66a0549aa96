"""Speculative decoding through PD behind the real router: `up`'s cluster (1 prefill + 1 decode,
both with `--speculative-num-steps 3`) on the tiny checkpoint with an MTP layer trained for a few
seconds, greedy `/generate` equal to the offline engine without speculation token for token (streamed
too, with logprobs, usage and finish reason as without speculation), the
decode worker's /metrics counting accepted drafts, and both KV pools empty afterwards."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import urllib.request

import pytest

from deepseek_pd.client.router_http import RouterClient
from deepseek_pd.launcher.cluster import LocalCluster
from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from pdtest.e2e_cluster import CHUNKED_PREFILL_SIZE, PAGE_SIZE, cluster_spec, wait_for_pages
from deepseek_pd.model.speculative.training import save_mtp_layer, train_mtp

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def test_speculative_pd_behind_the_router_equals_offline(tmp_path):
    seed = random.randrange(1000)
    print(f"seed={seed}")
    checkpoint = make_tiny_model(tmp_path / "tiny-mtp", seed=seed, mtp_layers=1)
    oracle = Engine(str(checkpoint), page_size=PAGE_SIZE, chunked_prefill_size=CHUNKED_PREFILL_SIZE)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, oracle.vocab_size) for _ in range(rng.randint(3, 2 * CHUNKED_PREFILL_SIZE + 5))]
               for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    expected = oracle.generate_batch(prompts, greedy)
    trainer = ModelRunner(RunnerConfig(model=str(checkpoint), page_size=PAGE_SIZE, speculative_num_steps=3))
    accuracy, steps = train_mtp(trainer, [p + r.output_ids for p, r in zip(prompts, expected)], seconds=20.0)
    print(f"MTP training: {steps} steps, accuracy {accuracy:.3f}")
    save_mtp_layer(trainer, checkpoint)

    # `up --speculative-num-steps 3`'s spec: both roles get the flag
    spec = dataclasses.replace(cluster_spec(tmp_path), model=str(checkpoint), speculative_num_steps=3)
    with LocalCluster(spec) as cluster:
        async def main():
            async with RouterClient(cluster.router_url, cluster.served_model_name) as client:
                for prompt, want in zip(prompts, expected):
                    got = await client.generate(input_ids=prompt, max_new_tokens=12, temperature=0.0,
                                                ignore_eos=True)
                    assert got.output_ids == want.output_ids
                    # streamed with logprobs, as a client sees it: several tokens may come from one
                    # step, yet the ids, logprobs, usage and finish reason are plain decoding's
                    streamed = await client.generate(input_ids=prompt, max_new_tokens=12, temperature=0.0,
                                                     ignore_eos=True, stream=True, return_logprob=True)
                    assert streamed.output_ids == want.output_ids
                    assert all(abs(a - b) < 1e-3 for a, b in zip(streamed.output_logprobs, want.output_logprobs))
                    assert len(streamed.output_logprobs) == len(want.output_logprobs)
                    assert (streamed.completion_tokens, streamed.finish_reason) == (12, "length")
                    print(f"streamed chunks of {streamed.chunk_token_counts} tokens")
            for worker in cluster.workers:
                assert await wait_for_pages(worker.address(spec.host), 0, timeout_s=10) == 0
        asyncio.run(main())
        decode = next(w for w in cluster.workers if w.role == "decode")
        text = urllib.request.urlopen(decode.metrics_url(spec.host), timeout=10).read().decode()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("deepseek_pd:spec_")}
        print({k: v for k, v in values.items() if not k.endswith("_bucket")})
        accepted = values["deepseek_pd:spec_accepted_tokens_total"]
        rows = values["deepseek_pd:spec_accept_length_count"]
        assert rows > 0 and accepted > 0
        print(f"accept length through PD and the router: {values['deepseek_pd:spec_accept_length_sum'] / rows:.2f}")
