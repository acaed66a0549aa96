"""The model warm-up both roles run before serving (workers/engine/model_warm_up.py).

On CUDA a kernel's first launch loads its module, which may wait for the whole device, other
threads' copies included; the prefill worker ran its first prefix extend cold. Here, on the CPU
(where the rule leaves the warm-up off; the tests call it, or force the rule): it runs each kind of
extend a prefill round runs (MHA, MLA over a cached prefix, MHA over prefix chunks), with and
without the MTP layer; it hands back every page in the order the pool had them; and with it on,
a PD pair's tokens are the offline engine's (greedy and seeded), and its pools end clean.

The ladders (fresh prompts of every power of two up to the chunk, MLA extends over every
power-of-two prefix below the threshold and of every power of two over the longest) failed before
they were added (session 13): the rows seen were the four kinds' only.

Failed before: there was no warm-up (model_warm_up.py did not exist; the engines' `start` ran no
forward).
"""
from __future__ import annotations

import asyncio
import random

import pytest

from deepseek_pd.model.attention.policy import AttentionPolicy
from deepseek_pd.model.forward_batch import AttentionMethod
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.sampler import Sampler
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine import model_warm_up, request_lifecycle
from deepseek_pd.workers.engine.prefill_round import PrefillRounds
from pdtest.pd_engine_harness import CHUNK, PAGE_SIZE, PDPair, oracle, runner

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rounds(model: ModelRunner) -> PrefillRounds:
    return PrefillRounds(model, Sampler(), CHUNK, hooks=None)  # `forward` calls no hook


def _ladder(top: int) -> list[int]:
    """Every power of two below `top`, and `top`."""
    return sorted({1 << i for i in range(top.bit_length()) if 1 << i < top} | {top})


def _free_order(pool) -> list[int]:
    """The pages the pool would hand out next, in order (it is left as it was)."""
    pages = pool.alloc(pool.num_free_pages)
    pool.free(pages[::-1])
    return pages


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_the_warm_up_runs_each_extend_kind_and_leaves_the_pool_as_it_was(mtp, tmp_path, monkeypatch) -> None:
    if mtp:
        from deepseek_pd.model.checkpoint.tiny import make_tiny_model

        path = make_tiny_model(tmp_path / "v3", seed=random.randrange(1000), mtp_layers=1)
        model = ModelRunner(RunnerConfig(model=str(path), page_size=PAGE_SIZE, num_pages=128,
                                         speculative_num_steps=1))
    else:
        model = runner(num_pages=128)
    assert not model_warm_up.wants_warm_up(model)  # the CPU loads no kernel lazily
    methods: list[AttentionMethod] = []
    choose = AttentionPolicy.choose
    monkeypatch.setattr(AttentionPolicy, "choose",
                        lambda self, mode, prefix_lens: methods.append(choose(self, mode, prefix_lens)) or methods[-1])
    before = _free_order(model.kv_pool)
    rounds = _rounds(model)
    rows: list[tuple[int, int]] = []  # (prefix, new tokens) of each single-row forward
    forward = rounds.forward
    monkeypatch.setattr(rounds, "forward", lambda plan, states: (rows.extend(
        (s.prefix_len, len(s.token_ids)) for s in plan.seqs if len(plan.seqs) == 1), forward(plan, states))[1])
    ran = model_warm_up.warm_up(rounds)
    assert _free_order(model.kv_pool) == before
    assert {AttentionMethod.MHA, AttentionMethod.MLA, AttentionMethod.MHA_CHUNKED_KV} <= set(methods)
    # The size ladders (kernels' tile classes): fresh prompts of every power of two up to the chunk,
    # and one-token extends over every power-of-two prefix below the chunked-KV threshold.
    threshold = model.policy.chunked_kv_threshold
    # Over the longest MLA prefix: 1, 2, 4, ... new tokens, up to the chunk (and the one token past it).
    over_longest = {(threshold - 1, n) for n in _ladder(CHUNK + 1)}
    assert {(0, n) for n in _ladder(CHUNK)} | {(p, 1) for p in _ladder(threshold - 1)} | over_longest <= set(rows)
    assert ran == 4 + len(_ladder(threshold - 1)) + len(_ladder(CHUNK + 1)) + len(_ladder(CHUNK))


def test_without_room_for_a_long_prefix_it_skips_that_and_without_room_at_all_everything() -> None:
    model = runner(num_pages=12)  # the two short prompts fit (4 + 4 pages of 4), a 257-token prefix does not
    before = _free_order(model.kv_pool)
    room = model.kv_pool.page_size * (model.kv_pool.num_free_pages - 8)  # tokens the size ladder may take
    assert model_warm_up.warm_up(_rounds(model)) == 2 + len(_ladder(min(CHUNK, room)))
    held = model.kv_pool.alloc(model.kv_pool.num_free_pages - 5)
    assert model_warm_up.warm_up(_rounds(model)) == 0
    model.kv_pool.free(held[::-1])
    assert _free_order(model.kv_pool) == before


def test_a_warmed_pd_pair_serves_the_offline_engines_tokens(monkeypatch) -> None:
    rng = random.Random()
    vocab = oracle().vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(2, 2 * CHUNK))] for _ in range(2)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(1 << 20), max_new_tokens=4,
                             ignore_eos=True)]
    expected = [r.output_ids for r in oracle().generate_batch(prompts, params)]
    warmed: list[int] = []
    monkeypatch.setattr(request_lifecycle, "wants_warm_up", lambda runner: True)
    monkeypatch.setattr(request_lifecycle, "warm_up",
                        lambda rounds: warmed.append(model_warm_up.warm_up(rounds)))

    async def run():
        async with PDPair("grpc") as pair:
            assert pair.prefill.pool.num_free_pages == pair.prefill.usable_pages
            outcomes = [await pair.run(p, q, f"w{i}") for i, (p, q) in enumerate(zip(prompts, params))]
            await pair.wait_pools_clean()
            return outcomes

    outcomes = asyncio.run(run())
    threshold = runner().policy.chunked_kv_threshold  # the pair's runners are the harness's
    # The prefill engine's, then the decode engine's: 4 extend kinds and both ladders.
    assert warmed == [4 + len(_ladder(threshold - 1)) + len(_ladder(CHUNK + 1)) + len(_ladder(CHUNK))] * 2
    for (prefill, decode), want in zip(outcomes, expected):
        assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
        assert decode.tokens == want
