"""Speculative decoding on the GPU with the Triton backends (verify = `mla_extend`, several queries
per sequence over the paged cache): fp32 greedy outputs identical to the same engine without
speculation, with the tiny MTP layer trained (on the CPU) so drafts are accepted; bf16 runs end to end.

Run on the GPU machine: `pytest -q tests/model/speculative/test_speculative_gpu.py -s`."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.model.speculative.training import train_mtp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(600)]


def test_triton_speculative_greedy_matches_plain(tmp_path):
    seed = random.randrange(1000)
    print(f"seed={seed}")
    path = str(make_tiny_model(tmp_path / "v3", seed=seed, mtp_layers=1))
    kw = dict(device="cuda", dtype="float32", attention_backend="triton", moe_backend="triton", page_size=16)
    base = Engine(path, **kw)
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, base.vocab_size) for _ in range(rng.randint(2, 40))] for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    reference = base.generate_batch(prompts, greedy)
    # Trained with the torch reference backends on the CPU (the Triton kernels have no backward),
    # then copied into the GPU engine's MTP layer.
    trainer = Engine(path, speculative_num_steps=3)
    accuracy, steps = train_mtp(trainer.runner, [p + r.output_ids for p, r in zip(prompts, reference)], seconds=30.0)
    print(f"MTP training: {steps} steps, accuracy {accuracy:.3f}")
    spec = Engine(path, speculative_num_steps=3, **kw)
    spec.runner.model.mtp.load_state_dict(trainer.runner.model.mtp.state_dict())
    got = spec.generate_batch(prompts, greedy)
    assert [r.output_ids for r in got] == [r.output_ids for r in reference]
    print(f"accept length {spec.speculative.stats.accept_length:.2f}")
    assert spec.speculative.stats.accept_length > 1.5
    bf16 = Engine(path, speculative_num_steps=3, **{**kw, "dtype": "bfloat16"})
    assert all(len(r.output_ids) == 32 for r in bf16.generate_batch(prompts, greedy))


def test_draft_step_graphs_equal_eager_at_every_bucket(tmp_path):
    """The MTP layer's draft step by CUDA-graph replay (model/speculative/draft_graph.py) against the
    eager `runner.draft`, at every captured batch size and sizes between them (padding rows): the
    same hidden states and the same draft tokens."""
    from deepseek_pd.model.graph_inputs import CudaGraphConfig
    from deepseek_pd.model.runner import ExtendSeq
    from deepseek_pd.model.speculative.draft_graph import DraftGraphRunner

    seed = random.randrange(1000)
    rng = random.Random(seed)
    path = str(make_tiny_model(tmp_path / "v3", seed=seed, mtp_layers=1))
    engine = Engine(path, device="cuda", dtype="float32", attention_backend="triton", moe_backend="triton",
                    page_size=16, speculative_num_steps=3)
    runner = engine.runner
    config = CudaGraphConfig(max_batch=12, max_context=256)
    graphs = DraftGraphRunner(runner.model, runner.kv_pool, config, runner.kv_pool.alloc(1)[0])
    hidden_size = runner.model_config.hidden_size
    for n in sorted({*config.buckets(), 3, 5, 7, 11}):
        positions = [rng.randrange(0, 200) for _ in range(n)]
        pages = [runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(p + 1)) for p in positions]
        tokens = [rng.randrange(2, engine.vocab_size) for _ in range(n)]
        hidden = torch.randn(n, hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + n))
        eager = runner.draft([ExtendSeq([t], p, pg) for t, p, pg in zip(tokens, positions, pages)], hidden)
        replayed = graphs.draft(tokens, positions, pages, hidden)
        assert replayed is not None, (seed, n)
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4, msg=f"seed {seed}, batch {n}")
        assert (runner.logits(replayed).argmax(-1) == runner.logits(eager).argmax(-1)).all(), (seed, n)
        for pg in pages:
            runner.kv_pool.free(pg)
    assert graphs.draft([1] * 13, [0] * 13, [[0]] * 13, torch.zeros(13, hidden_size, device="cuda")) is None


def test_speculative_engine_with_graphs_equals_eager(tmp_path):
    """The whole speculative decode through the runner with CUDA graphs (draft and verify replayed
    at every bucket the batches hit; model/speculative/graphs.py) against the same engine eager and
    against plain decode: identical greedy tokens, and the replays (draft, verify, padded catch-up) did happen."""
    seed = random.randrange(1000)
    print(f"seed={seed}")
    path = str(make_tiny_model(tmp_path / "v3", seed=seed, mtp_layers=1))
    kw = dict(device="cuda", dtype="float32", attention_backend="triton", moe_backend="triton", page_size=16,
              speculative_num_steps=3)
    rng = random.Random(seed)
    eager = Engine(path, **kw)
    graphs = Engine(path, cuda_graph=True, **kw)
    assert graphs.runner.spec_forwards.graphs is not None
    plain = Engine(path, **{**kw, "speculative_num_steps": 0})
    steps = 0
    for batch in (1, 2, 3, 8, 13):  # buckets and sizes between them (padding rows)
        prompts = [[rng.randrange(2, eager.vocab_size) for _ in range(rng.randint(2, 60))] for _ in range(batch)]
        # budgets of their own: rows near theirs draft fewer than their neighbours, and are padded
        greedy = [SamplingParams(temperature=0.0, max_new_tokens=rng.randint(8, 24), ignore_eos=True) for _ in prompts]
        want = [r.output_ids for r in plain.generate_batch(prompts, greedy)]
        assert [r.output_ids for r in eager.generate_batch(prompts, greedy)] == want, (seed, batch)
        assert [r.output_ids for r in graphs.generate_batch(prompts, greedy)] == want, (seed, batch)
        steps += len(graphs.last_speculative_run.lens)
    replays = graphs.runner.spec_forwards.graphs.replays
    print(f"replays {replays}, steps {steps}")
    assert replays["draft"] > 0 and replays["verify"] > 0 and replays["catch_up"] > 0, replays
    assert replays["verify"] == steps, (replays, steps)  # every step's verify replayed, the tails' too


def test_adaptive_draft_counts_replay_their_own_graphs(tmp_path):
    """With `speculative_adaptive` the verify is captured for every k in 0..N and the catch-up for 1..N
    (model/speculative/graphs.py); steps drafting a random k each, through graphs, give the plain
    greedy tokens, and every k's verify replays."""
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from pdtest.speculative_runner import speculative_greedy

    seed = random.randrange(1000)
    rng = random.Random(seed)
    path = str(make_tiny_model(tmp_path / "v3", seed=seed, mtp_layers=1))
    plain = Engine(path, device="cuda", dtype="float32", attention_backend="triton", moe_backend="triton", page_size=16)
    runner = ModelRunner(RunnerConfig(model=path, device="cuda", dtype="float32", attention_backend="triton",
                                      moe_backend="triton", page_size=16, num_pages=512, cuda_graph=True,
                                      cuda_graph_max_batch=8, speculative_num_steps=3, speculative_adaptive=True))
    graphs = runner.spec_forwards.graphs
    # k = 0 too (its catch-up is the draft graph's shape), so the start-up costs replay every k
    assert sorted(graphs.verify_graphs) == [1, 2, 3, 4] and sorted(graphs.catch_up_graphs) == [2, 3, 4]
    prompts = [[rng.randrange(2, plain.vocab_size) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    max_new = [rng.randint(6, 20) for _ in prompts]
    want = [r.output_ids for r in plain.generate_batch(
        prompts, [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in max_new])]
    got, _ = speculative_greedy(runner, prompts, max_new, 3, drafts_per_step=lambda: rng.randint(0, 3))
    assert got == want, seed
    assert graphs.replays["verify"] > 0 and graphs.replays["catch_up"] > 0, graphs.replays
    # The policy's start-up costs time every k by replay, k = 0 included (a verify of one token a
    # sequence): 2 batch sizes x 4 draft counts x (warm-up + 1 timed step).
    from deepseek_pd.model.speculative.step_costs import measure_step_costs

    before = graphs.replays["verify"]
    measure_step_costs(runner, [1, 3], 3, context=32, repeats=1)
    assert graphs.replays["verify"] - before == 2 * 4 * 2, graphs.replays


def test_speculation_with_redundant_experts_through_graphs_equals_plain(tmp_path):
    """EPLB with speculation on the GPU: redundant experts and a random placement with the MTP
    layer's row (model/eplb/expert_location.py), the draft, verify and catch-up replayed as CUDA
    graphs (the replica mapping is two gathers, so it is captured too): the plain greedy tokens."""
    import json

    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.eplb.expert_location import moe_layer_ids
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.speculative.mtp_names import mtp_layer_id
    from pdtest.eplb_placement import random_placement
    from pdtest.speculative_runner import speculative_greedy

    seed = random.randrange(1000)
    rng = random.Random(seed)
    path = str(make_tiny_model(tmp_path / "v3", seed=seed, mtp_layers=1))
    config = ModelConfig.from_hf(path)
    layers = [*moe_layer_ids(config), mtp_layer_id(config)]
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"moe_layer_ids": layers, "physical_to_logical_map": random_placement(
        rng, config.n_routed_experts, 2, len(layers))}))
    kw = dict(device="cuda", dtype="float32", attention_backend="triton", moe_backend="triton", page_size=16)
    plain = Engine(path, **kw)
    prompts = [[rng.randrange(2, plain.vocab_size) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    max_new = [rng.randint(6, 20) for _ in prompts]
    want = [r.output_ids for r in plain.generate_batch(
        prompts, [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in max_new])]
    runner = ModelRunner(RunnerConfig(model=path, num_pages=512, cuda_graph=True, cuda_graph_max_batch=8,
                                      speculative_num_steps=3, ep_num_redundant_experts=2,
                                      init_expert_location=str(placement), **kw))
    assert runner.model.mtp.layer.mlp.to_physical is not None
    got, _ = speculative_greedy(runner, prompts, max_new, 3)
    assert got == want, seed
    replays = runner.spec_forwards.graphs.replays
    assert replays["draft"] > 0 and replays["verify"] > 0, replays
