"""EPLB with speculative decoding, in one process: the MTP layer's MoE has its own row in the expert
placement (redundant experts, a static placement) and in the expert-load recording.

- A placement file's MTP row is used; a file planned without speculation gives the MTP layer the
  trivial row; a worker without the MTP layer ignores the row; a wrong MTP row is a clear error.
- Speculative greedy decoding with redundant experts and a random placement (MTP row included)
  gives the plain model's greedy tokens (no speculation, no placement: the oracle).
- The recording counts every token each network forwarded (top-k choices per token, MTP row
  included), the same logical counts as without a placement (replicas change where a token is
  computed, never its experts), and a plan from it (the rebalance) serves the same tokens again.
"""
from __future__ import annotations

import json
import random

import pytest

from deepseek_pd.cli import main
from deepseek_pd.errors import UserError
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.eplb.expert_location import moe_layer_ids, resolve_expert_location
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.model.speculative.mtp_names import mtp_layer_id
from pdtest.eplb_placement import random_placement
from pdtest.speculative_runner import speculative_greedy

pytestmark = pytest.mark.timeout(300)
PAGE = 4
STEPS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("spec-eplb") / "v3", seed=random.randrange(1000), mtp_layers=1))


def _placement(path, config: ModelConfig, redundant: int, mtp: bool) -> list[list[int]]:
    """A random placement file; with `mtp`, the MTP layer's row last (as `eplb plan` writes it)."""
    layers = [*moe_layer_ids(config), *([mtp_layer_id(config)] if mtp else [])]
    rows = random_placement(random.Random(), config.n_routed_experts, redundant, len(layers))
    path.write_text(json.dumps({"physical_to_logical_map": rows, "moe_layer_ids": layers}))
    return rows


def test_the_mtp_layer_has_its_own_row_in_a_placement(tmp_path, checkpoint) -> None:
    config = ModelConfig.from_hf(checkpoint)
    main_layers, mtp = moe_layer_ids(config), mtp_layer_id(config)
    with_mtp = tmp_path / "with-mtp.json"
    rows = _placement(with_mtp, config, 2, mtp=True)
    location = resolve_expert_location(config, 2, 2, str(with_mtp), mtp=True)
    assert location.moe_layer_ids == (*main_layers, mtp) and list(location.row(mtp)) == rows[-1]
    # a worker without the MTP layer (no speculation) serves the same plan, the MTP row ignored
    assert resolve_expert_location(config, 2, 2, str(with_mtp)).moe_layer_ids == main_layers
    # a plan from dumps recorded without speculation: the MTP layer gets the trivial row
    without = tmp_path / "without-mtp.json"
    rows = _placement(without, config, 2, mtp=False)
    location = resolve_expert_location(config, 2, 2, str(without), mtp=True)
    assert [list(location.row(i)) for i in main_layers] == rows
    assert list(location.row(mtp)) == [p % config.n_routed_experts for p in range(config.n_routed_experts + 2)]
    assert resolve_expert_location(config, 2, 2, None, mtp=True).moe_layer_ids == (*main_layers, mtp)
    # a wrong MTP row is named
    data = json.loads(with_mtp.read_text())
    data["physical_to_logical_map"][-1] = data["physical_to_logical_map"][-1][:-1]
    with_mtp.write_text(json.dumps(data))
    with pytest.raises(UserError, match=f"MoE layer {mtp} has 9 physical slots"):
        resolve_expert_location(config, 2, 2, str(with_mtp), mtp=True)
    data["moe_layer_ids"] = [*main_layers, mtp + 1]
    with_mtp.write_text(json.dumps(data))
    with pytest.raises(UserError, match=rf"planned for moe_layer_ids \[.*{mtp + 1}\]"):
        resolve_expert_location(config, 2, 2, str(with_mtp), mtp=True)


def _plain_greedy(runner: ModelRunner, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    out = []
    for prompt, n in zip(prompts, max_new):
        pages = runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(prompt) + n))
        tokens = [int(runner.extend([ExtendSeq(prompt, 0, pages)]).argmax())]
        while len(tokens) < n:
            tokens.append(int(runner.decode([DecodeSeq(tokens[-1], len(prompt) + len(tokens) - 1, pages)]).argmax()))
        runner.kv_pool.free(pages)
        out.append(tokens)
    return out


def _counting(runner: ModelRunner) -> dict[str, int]:
    """Tokens each network forwards from now on (the model's and the MTP layer's forwards, wrapped)."""
    counts = {"model": 0, "mtp": 0}
    model = runner.model
    forward_hidden, forward_mtp = model.forward_hidden, model.forward_mtp

    def hidden(batch, *args, **kwargs):
        counts["model"] += batch.num_tokens
        return forward_hidden(batch, *args, **kwargs)

    def mtp(batch, *args, **kwargs):
        counts["mtp"] += batch.num_tokens
        return forward_mtp(batch, *args, **kwargs)

    model.forward_hidden, model.forward_mtp = hidden, mtp
    return counts


def _runner(checkpoint: str, **fields) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=checkpoint, page_size=PAGE, num_pages=512, **fields))


def test_speculation_with_a_placement_equals_plain_greedy_and_records_the_mtp_layer(tmp_path, checkpoint) -> None:
    rng = random.Random()
    config = ModelConfig.from_hf(checkpoint)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 20))] for _ in range(rng.randint(3, 5))]
    max_new = [rng.randint(2, 10) for _ in prompts]
    want = _plain_greedy(_runner(checkpoint), prompts, max_new)
    redundant = 2
    placement = tmp_path / "placement.json"
    _placement(placement, config, redundant, mtp=True)
    eplb = dict(speculative_num_steps=STEPS, record_expert_load=True, ep_num_redundant_experts=redundant)
    runner = _runner(checkpoint, init_expert_location=str(placement), **eplb)
    assert runner.model.mtp.layer.mlp.to_physical is not None  # the MTP layer's MoE maps to its slots
    forwarded = _counting(runner)
    got, _ = speculative_greedy(runner, prompts, max_new, STEPS)
    assert got == want
    dump = runner.expert_load.dump()
    mtp = mtp_layer_id(config)
    assert dump.moe_layer_ids == (*moe_layer_ids(config), mtp)
    top_k = config.num_experts_per_tok
    assert [sum(row) for row in dump.logical_counts] == \
        [forwarded["model"] * top_k] * len(moe_layer_ids(config)) + [forwarded["mtp"] * top_k]
    assert forwarded["mtp"] > sum(map(len, prompts))  # drafts and catch-ups, not only the prompts
    # replicas change where a token is computed, never its experts: the counts without a placement
    plain = _runner(checkpoint, speculative_num_steps=STEPS, record_expert_load=True)
    assert speculative_greedy(plain, prompts, max_new, STEPS)[0] == want
    assert plain.expert_load.dump() == dump
    # the rebalance: plan from the recording, serve the plan (the MTP row planned too)
    dump.write(tmp_path / "load.json")
    planned = tmp_path / "planned.json"
    assert main(["eplb", "plan", "--dump", str(tmp_path / "load.json"), "--ep-size", "1",
                 "--redundant", str(redundant), "-o", str(planned)]) == 0
    assert json.loads(planned.read_text())["moe_layer_ids"][-1] == mtp
    rebalanced = _runner(checkpoint, init_expert_location=str(planned), **eplb)
    assert speculative_greedy(rebalanced, prompts, max_new, STEPS)[0] == want


def test_steps_launched_ahead_record_no_void_rows(checkpoint) -> None:
    """Steps launched before the one ahead of them is read (`SpeculativeDecoder.run(ahead=True)`):
    a row whose request ended in the step before runs once more (a void row, its one verify and
    one catch-up token), and is no request's work: the recording counts every token the two
    networks forwarded but those (prompts of random lengths and budgets, so requests end at
    different steps)."""
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
    from deepseek_pd.model.speculative.decoder import SpeculativeDecoder
    from deepseek_pd.workers.engine.extend_step import run_extend_with_mtp
    from pdtest.speculative_runner import SpecRow

    rng = random.Random()
    config = ModelConfig.from_hf(checkpoint)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 20))] for _ in range(rng.randint(3, 5))]
    max_new = [rng.randint(2, 12) for _ in prompts]
    runner = _runner(checkpoint, speculative_num_steps=STEPS, record_expert_load=True)
    pool = runner.kv_pool
    rows = [SpecRow(p, n, pool.alloc(pool.pages_for_tokens(len(p) + n))) for p, n in zip(prompts, max_new)]
    states = [SamplingState.create(SamplingParams(temperature=0.0), p, config.vocab_size) for p in prompts]
    sampled, drafts = run_extend_with_mtp(runner, Sampler(), [ExtendSeq(r.prompt_ids, 0, r.pages) for r in rows],
                                          range(len(rows)), states, prompts)
    decoder = SpeculativeDecoder(runner, STEPS)
    for row, state, token, draft in zip(rows, states, sampled.token_ids, drafts):
        row.output_ids.append(token)
        row.sampling = state
        decoder.seed(row, *draft)
    runner.expert_load.reset()
    forwarded = _counting(runner)
    void = [0]
    finish = decoder.finish

    def counting_finish(launched):
        void[0] += sum(r.finished for r in launched.requests)  # ended before this step was read
        return finish(launched)

    decoder.finish = counting_finish
    run = decoder.run(rows, ahead=True)
    assert run.launched_ahead > 0 and void[0] > 0  # the first request to end did so in a step run ahead of
    assert [len(r.output_ids) for r in rows] == max_new
    top_k = config.num_experts_per_tok
    counts = [sum(row) for row in runner.expert_load.dump().logical_counts]
    # a void row drafts nothing: one verify token, one catch-up token
    assert counts == [(forwarded["model"] - void[0]) * top_k] * len(moe_layer_ids(config)) + \
        [(forwarded["mtp"] - void[0]) * top_k], (counts, forwarded, void)
