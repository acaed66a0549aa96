"""The one prefill round (workers/engine/prefill_round.py) against a single-forward torch oracle.

Seeded random mixes of prompts, some over a cached prefix (its KV computed beforehand, as the
prefix cache holds it), prefilled in rounds of a random chunk budget: every page's latent KV (the
MTP layer's too, with it), every first token, its logprob and, with the MTP layer, the first draft
equal what one plain extend of each whole prompt alone gives (`runner.extend`, `Sampler.sample`,
`run_extend_with_mtp`), under both attention paths over a prefix (MHA_CHUNKED_KV, MLA). Then the
page holding: an owner that ends during the forward is handed back once and hears nothing else; a
failed forward lets go of every page and tells the role; a prompt its pages cannot hold is refused.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest
import torch

from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.sampled_host import pack, unpack
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.workers.engine.extend_step import run_extend_with_mtp
from deepseek_pd.workers.engine.prefill_round import FirstToken, PrefillRounds, RoundHooks

pytestmark = pytest.mark.timeout(300)
PAGE = 4

torch.set_num_threads(1)  # as the engine harness: a 2-core machine shared by several test runs


@dataclass(eq=False)
class Prompt:
    token_ids: list[int]
    sampling: SamplingState
    ended: bool = False
    in_flight: int = 0
    firsts: list[FirstToken] = field(default_factory=list)


class Recorder(RoundHooks[Prompt]):
    def __init__(self) -> None:
        self.released: list[Prompt] = []
        self.failures: list[tuple[list[Prompt], Exception]] = []
        self.chunks: list[list[Prompt]] = []

    def chunk_done(self, owners) -> None:
        self.chunks.append(list(owners))

    def first_token(self, owner: Prompt, first: FirstToken) -> None:
        owner.firsts.append(first)

    def release(self, owner: Prompt) -> None:
        self.released.append(owner)

    def failed(self, owners, error: Exception) -> None:
        self.failures.append((list(owners), error))


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("round") / "v3", seed=random.randrange(1000), mtp_layers=1))


def build_runner(threshold: int, model: str = "tiny", mtp: bool = False) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=model, page_size=PAGE, num_pages=512, mha_chunked_kv_threshold=threshold,
                                    speculative_num_steps=1 if mtp else 0))


def params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.5:
        return SamplingParams(temperature=0.0, max_new_tokens=4, top_logprobs_num=rng.choice([0, 3]))
    return SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 20), max_new_tokens=4)


def oracle_first(runner: ModelRunner, ids: list[int], p: SamplingParams, mtp: bool):
    """Each prompt alone, in one extend from position 0, into pages of its own: (first token, its
    logprob, top logprobs, first draft or None, the pages)."""
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    pages = pool.alloc(pool.pages_for_tokens(len(ids)))
    state = SamplingState.create(p, ids, vocab)
    if mtp:
        sampled, drafts = run_extend_with_mtp(runner, Sampler(), [ExtendSeq(ids, 0, pages)], [0], [state], [ids])
        return sampled.token_ids[0], sampled.logprobs[0], sampled.top[0], drafts[0], pages
    out = Sampler().sample(runner.extend([ExtendSeq(ids, 0, pages)]), [state])
    sampled = unpack(pack(out).cpu(), out.top_counts)
    return sampled.token_ids[0], sampled.logprobs[0], sampled.top[0], None, pages


def page_kv(runner: ModelRunner, pages: list[int], tokens: int) -> list[torch.Tensor]:
    return [buffer[pages].reshape(-1, buffer.shape[-1])[:tokens] for buffer in runner.kv_pool.buffers]


def random_mix(rng: random.Random, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, cached prefix tokens): lengths 1..40, a whole-page prefix on about half of them."""
    mix = []
    for _ in range(rng.randint(1, 5)):
        ids = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 40))]
        cached = PAGE * rng.randint(0, (len(ids) - 1) // PAGE) if rng.random() < 0.5 else 0
        mix.append((ids, cached))
    return mix


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
@pytest.mark.parametrize("threshold", [1, 10 ** 6], ids=["mha_chunked_kv", "mla_over_prefix"])
def test_rounds_equal_one_forward_per_prompt(threshold, mtp, mtp_model):
    rng = random.Random()
    runner = build_runner(threshold, mtp_model if mtp else "tiny", mtp)
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    for trial in range(3):
        mix, budget = random_mix(rng, vocab), rng.randint(1, 48)
        hooks = Recorder()
        rounds = PrefillRounds(runner, Sampler(), budget, hooks)
        assert rounds.with_mtp is mtp
        queue, owners, sampling = [], [], []
        for ids, cached in mix:
            p = params(rng)
            pages = pool.alloc(pool.pages_for_tokens(len(ids)))
            if cached and mtp:  # the prefix cache's pages: computed by an earlier forward of the prefix
                run_extend_with_mtp(runner, Sampler(), [ExtendSeq(ids[:cached], 0, pages)], [], [], [ids])
            elif cached:
                runner.extend([ExtendSeq(ids[:cached], 0, pages)])
            owner = Prompt(ids, SamplingState.create(p, ids, vocab))
            owners.append(owner)
            sampling.append(p)
            queue.append(rounds.start(owner, ids, pages, cached))
        pending, planned = list(queue), 0
        while pending:
            plan = rounds.run(pending)
            assert plan.items and sum(len(s.token_ids) for s in plan.seqs) <= budget
            planned += 1
            pending = [item for item in pending if item.remaining > 0]
        assert planned >= -(-sum(len(ids) - cached for ids, cached in mix) // budget)
        assert all(o.in_flight == 0 for o in owners) and not hooks.released and not hooks.failures
        for owner, item, p in zip(owners, queue, sampling):
            token, logprob, top, draft, pages = oracle_first(runner, owner.token_ids, p, mtp)
            where = f"trial {trial}, budget {budget}, prompt of {len(owner.token_ids)} ({item.computed})"
            assert len(owner.firsts) == 1, where
            first = owner.firsts[0]
            assert first.token_id == token, where
            assert first.logprob == pytest.approx(logprob, abs=1e-4), where
            assert (first.top is None) == (top is None), where
            if top is not None:
                assert first.top.token_ids == top.token_ids, where
            if mtp:
                assert first.draft[0] == draft[0], where
                torch.testing.assert_close(first.draft[1], draft[1], atol=1e-4, rtol=1e-4)
            else:
                assert first.draft is None
            for got, want in zip(page_kv(runner, item.pages, len(owner.token_ids)),
                                 page_kv(runner, pages, len(owner.token_ids))):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=where)
            pool.free(pages)
            pool.free(item.pages)
    assert pool.num_used_pages == 0


class _Thread:
    """A model thread whose forward sees `during` happen first (an abort arriving mid-forward), or fails."""

    def __init__(self, during=None, error: Exception | None = None) -> None:
        self.during, self.error = during, error

    async def run(self, fn, *args):
        if self.during is not None:
            self.during()
        if self.error is not None:
            raise self.error
        return fn(*args)


def _queue(rng: random.Random, runner: ModelRunner, rounds: PrefillRounds, n: int):
    vocab, pool = runner.model_config.vocab_size, runner.kv_pool
    owners, queue = [], []
    for _ in range(n):
        ids = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 12))]
        owner = Prompt(ids, SamplingState.create(SamplingParams(temperature=0.0), ids, vocab))
        owners.append(owner)
        queue.append(rounds.start(owner, ids, pool.alloc(pool.pages_for_tokens(len(ids)))))
    return owners, queue


def test_an_owner_that_ends_during_the_forward_is_released_once_and_hears_nothing_more():
    rng = random.Random()
    runner, hooks = build_runner(256), Recorder()
    rounds = PrefillRounds(runner, Sampler(), 64, hooks)
    owners, queue = _queue(rng, runner, rounds, 4)
    victim = rng.randrange(4)

    def abort():
        assert all(o.in_flight == 1 for o in owners), "the round holds its owners' pages"
        owners[victim].ended = True

    asyncio.run(rounds.run_in(_Thread(during=abort), queue))
    assert hooks.released == [owners[victim]] and owners[victim].firsts == []
    assert queue[victim].computed == 0  # the role frees (or caches) what it owns: nothing claims it computed
    assert hooks.chunks == [[o for i, o in enumerate(owners) if i != victim]]
    for i, (owner, item) in enumerate(zip(owners, queue)):
        assert owner.in_flight == 0
        if i != victim:
            assert len(owner.firsts) == 1 and item.remaining == 0


def test_a_failed_forward_lets_go_of_the_pages_and_tells_the_role():
    rng = random.Random()
    runner, hooks = build_runner(256), Recorder()
    rounds = PrefillRounds(runner, Sampler(), 64, hooks)
    owners, queue = _queue(rng, runner, rounds, 3)
    error = RuntimeError("the device fell over")

    def abort():
        owners[0].ended = True

    asyncio.run(rounds.run_in(_Thread(during=abort, error=error), queue))
    assert hooks.failures == [(owners[1:], error)] and hooks.released == [owners[0]]
    assert all(o.in_flight == 0 and not o.firsts for o in owners)
    assert all(item.computed == 0 for item in queue) and not hooks.chunks


def test_the_offline_default_re_raises_a_failed_forward(monkeypatch):
    rng = random.Random()
    runner = build_runner(256)

    rounds = PrefillRounds(runner, Sampler(), 64, RoundHooks())
    owners, queue = _queue(rng, runner, rounds, 2)
    error = RuntimeError("the device fell over")

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(runner, "extend", fail)
    with pytest.raises(RuntimeError) as raised:
        rounds.run(queue)
    assert raised.value is error
    assert all(o.in_flight == 0 for o in owners)


def test_start_refuses_pages_or_a_prefix_that_do_not_fit():
    runner = build_runner(256)
    rounds = PrefillRounds(runner, Sampler(), 8, Recorder())
    ids = list(range(2, 12))  # 10 tokens: 3 pages of 4
    owner = Prompt(ids, SamplingState.create(SamplingParams(), ids, runner.model_config.vocab_size))
    with pytest.raises(ValueError, match="cannot hold"):
        rounds.start(owner, ids, [0, 1])
    for cached in (2, 12, -4):  # not whole pages; not short of the prompt
        with pytest.raises(ValueError, match="cached prefix"):
            rounds.start(owner, ids, [0, 1, 2], cached)
    assert rounds.start(owner, ids, [0, 1, 2], 8).remaining == 2
    with pytest.raises(ValueError, match="chunk_budget"):
        PrefillRounds(runner, Sampler(), 0, Recorder())
