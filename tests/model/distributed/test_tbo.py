"""Two-batch overlap in one process: equals the plain forward (prefill, prefill with a cached
prefix, paged decode, one long prompt cut in two chunks, batches either side of the thresholds),
splits where SGLang's rules say, and really interleaves per the rule."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.layer_ops import TBO_DECODE_MOE_OPS, TBO_PREFILL_MOE_OPS, YIELD, OpState
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.distributed.tbo import TwoBatchOverlap, interleaved_order, micro_batch
from deepseek_pd.model.distributed.tbo_rules import TboRules
from pdtest.hf_oracle import TinyShape, build_hf_model, our_model

pytestmark = pytest.mark.timeout(90)
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    hf = build_hf_model(TinyShape(arch="v3", num_layers=4, first_k_dense_replace=1), seed=random.randrange(1 << 30))
    return our_model(hf), our_model(hf, BuildOptions(enable_tbo=True, prefix_chunk_size=4))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_tbo_equals_plain_forward(models):
    plain, tbo = models
    rng = random.Random()
    vocab = plain.config.vocab_size
    config = RunnerConfig(model="<in-memory>", page_size=4, num_pages=128, mha_chunked_kv_threshold=1)
    runners = [ModelRunner.from_model(m, config) for m in (plain, tbo)]
    num_seqs = rng.randint(2, 5)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(num_seqs)]
    more = [[rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in range(num_seqs)]
    pages = [runners[0].kv_pool.alloc(runners[0].kv_pool.pages_for_tokens(len(p) + len(m) + 4))
             for p, m in zip(prompts, more)]
    assert [runners[1].kv_pool.alloc(len(p)) for p in pages] == pages  # same layout in both pools

    def both(call) -> list[torch.Tensor]:
        return [call(r) for r in runners]

    outputs = {"extend": both(lambda r: r.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)])),
               "extend_prefix": both(lambda r: r.extend([ExtendSeq(m, len(p), pg)
                                                          for p, m, pg in zip(prompts, more, pages)]))}
    lengths = [len(p) + len(m) for p, m in zip(prompts, more)]
    next_ids = outputs["extend_prefix"][0].argmax(-1).tolist()
    for step in range(3):
        seqs = [DecodeSeq(t, n + step, pg) for t, n, pg in zip(next_ids, lengths, pages)]
        outputs[f"decode{step}"] = both(lambda r: r.decode(seqs))
        next_ids = outputs[f"decode{step}"][0].argmax(-1).tolist()
    outputs["single_seq_fallback"] = both(lambda r: r.decode([DecodeSeq(next_ids[0], lengths[0] + 3, pages[0])]))
    for case, (want, got) in outputs.items():
        assert got.shape == want.shape
        assert _rel_err(got, want) <= REL_TOL, case
    for runner in runners:  # the latent KV both wrote must agree too, to fp32 rounding of half-batch GEMMs
        for layer in range(plain.config.num_hidden_layers):
            got, want = runner.kv_pool.buffers[layer], runners[0].kv_pool.buffers[layer]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _batch(model, mode: ForwardMode, lengths: list[int], prefix: int = 0) -> ForwardBatch:
    rng = random.Random()
    pool = KVPool(model.config.num_hidden_layers, 64, 4, model.config.kv_cache_dim)
    pages = [pool.alloc(pool.pages_for_tokens(prefix + n)) for n in lengths]
    ids = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in lengths]
    return ForwardBatch.build(mode, ids, [prefix] * len(lengths), pages, pool, model.config.vocab_size, "cpu")


def test_split_balances_tokens_and_micro_batches_are_consistent(models):
    plain, _ = models
    rng = random.Random()
    lengths = [rng.randint(1, 20) for _ in range(rng.randint(2, 7))]
    batch = _batch(plain, ForwardMode.EXTEND, lengths)
    cut = TboRules(token_distribution_threshold=0).split_token(batch.mode, batch.extend_lens)  # no two-chunk
    imbalance = {abs(2 * sum(lengths[:c]) - sum(lengths)) for c in range(1, len(lengths))}
    assert cut in {sum(lengths[:c]) for c in range(1, len(lengths))}
    assert abs(2 * cut - sum(lengths)) == min(imbalance)
    # Any token index (inside a sequence too) gives two batches that together are the batch.
    for t in (cut, rng.randint(1, sum(lengths) - 1)):
        first, second = micro_batch(batch, 0, t), micro_batch(batch, t, batch.num_tokens)
        assert torch.equal(torch.cat([first.batch.input_ids, second.batch.input_ids]), batch.input_ids)
        assert torch.equal(torch.cat([first.batch.out_slots, second.batch.out_slots]), batch.out_slots)
        assert torch.equal(torch.cat([first.batch.positions, second.batch.positions]), batch.positions)
        seq = next(i for i in range(len(lengths)) if sum(lengths[:i + 1]) >= t)  # holds token t - 1
        inside = sum(lengths[:seq + 1]) != t
        assert first.complete + second.complete == len(lengths)
        assert first.complete == seq + (not inside)
        for part in (first, second):
            half = part.batch
            assert half.qo_indptr.tolist() == list(half.qo_offsets)
            assert half.token_seq.tolist() == [i for i, n in enumerate(half.extend_lens) for _ in range(n)]
            assert half.seq_lens_t.tolist() == list(half.seq_lens)
            # each token's position is its sequence's prefix plus its index in the chunk
            assert half.positions.tolist() == [p + j for p, n in zip(half.prefix_lens, half.extend_lens)
                                               for j in range(n)]
    assert micro_batch(batch, 0, 0) is None
    decode = _batch(plain, ForwardMode.DECODE, [1] * 7, prefix=5)
    assert TboRules().split_token(decode.mode, decode.extend_lens) == 3


def _expected_trace(model, mode: ForwardMode, delta: int) -> list[tuple[int, int, str]]:
    """The rule written out independently: cut the model's op list at YIELDs, then A's first
    `delta` stages, alternate A/B, finish B."""
    moe_ops = TBO_PREFILL_MOE_OPS if mode is ForwardMode.EXTEND else TBO_DECODE_MOE_OPS
    stages: list[list[tuple[int, str]]] = [[]]
    for layer in model.layers:
        for name in (moe_ops if layer.is_moe else layer.op_names):
            if name == YIELD:
                stages.append([])
            else:
                stages[-1].append((layer.layer_id, name))
    stages = [s for s in stages if s]
    a = [[(0, lid, name) for lid, name in s] for s in stages]
    b = [[(1, lid, name) for lid, name in s] for s in stages]
    order = sum(a[:delta], [])
    for i in range(len(stages) - delta):
        order += a[delta + i] + b[i]
    return order + sum(b[len(stages) - delta:], [])


@pytest.mark.parametrize("mode, delta", [(ForwardMode.EXTEND, 0), (ForwardMode.DECODE, 2)])
def test_executor_interleaves_by_the_rule(models, mode, delta):
    _, tbo = models
    lengths = [random.randint(1, 6) for _ in range(4)] if mode is ForwardMode.EXTEND else [1] * 5
    batch = _batch(tbo, mode, lengths, prefix=0 if mode is ForwardMode.EXTEND else 3)
    trace: list[tuple[int, int, str]] = []
    with torch.no_grad():
        TwoBatchOverlap(tbo, ParallelInfo(), TboRules(token_distribution_threshold=0)).final_hidden(batch, trace)
    assert trace == _expected_trace(tbo, mode, delta)
    # Overlap really happens: between A's dispatch_a and dispatch_b of every MoE layer B runs ops.
    for layer in tbo.layers:
        if layer.is_moe:
            start = trace.index((0, layer.layer_id, "dispatch_a"))
            end = trace.index((0, layer.layer_id, "dispatch_b"))
            assert any(micro == 1 for micro, _, _ in trace[start:end]), layer.layer_id
    assert interleaved_order(4, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (0, 3), (1, 1), (1, 2), (1, 3)]


def test_shared_state_between_micro_batches_raises(models):
    """Why each micro-batch has its own OpState: sharing one makes the interleaving collide."""
    _, tbo = models
    batch = _batch(tbo, ForwardMode.EXTEND, [3, 4])
    halves = (micro_batch(batch, 0, 3).batch, micro_batch(batch, 3, 7).batch)
    executor = TwoBatchOverlap(tbo, ParallelInfo())
    stages = executor.stages[ForwardMode.EXTEND]
    state = OpState(hidden_states=tbo.embed_tokens(batch.input_ids[:3]), residual=None)
    with torch.no_grad(), pytest.raises(KeyError, match="already set|not set"):
        for micro, index in interleaved_order(len(stages), 0):
            for op in stages[index]:
                op.run(state, halves[micro])


def _paths(model) -> dict[str, int]:
    return dict(model.tbo.stats)


def _delta(after: dict[str, int], before: dict[str, int]) -> tuple[int, int, int]:
    return tuple(after[k] - before[k] for k in ("overlapped", "plain", "micro_batches"))


@pytest.mark.parametrize("attention_method", ["auto", "mla"])
def test_one_long_prompt_splits_in_two_chunks_and_equals_plain(models, attention_method):
    """SGLang's two-chunk split: one prompt (then its next chunk, after a cached prefix, beside a
    short one) is cut inside the sequence; the second micro-batch attends to the first's KV. Then
    decode batches of 2 (split) and 1 (below the floor: plain). Logits and greedy tokens equal."""
    plain, tbo = models
    rng = random.Random()
    vocab = plain.config.vocab_size
    config = RunnerConfig(model="<in-memory>", page_size=4, num_pages=128, mha_chunked_kv_threshold=1,
                          attention_method=attention_method)
    runners = [ModelRunner.from_model(m, config) for m in (plain, tbo)]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(30, 40))]
    chunk = rng.randint(3, 12)  # the rest (>= 18 tokens) dominates a short prompt of 1-2 tokens
    short = [rng.randrange(vocab) for _ in range(rng.randint(1, 2))]
    pages = [runners[0].kv_pool.alloc(runners[0].kv_pool.pages_for_tokens(len(prompt) + 4)),
             runners[0].kv_pool.alloc(runners[0].kv_pool.pages_for_tokens(len(short) + 4))]
    assert [runners[1].kv_pool.alloc(len(p)) for p in pages] == pages
    before = _paths(tbo)
    outputs = {"first_chunk": [r.extend([ExtendSeq(prompt[:chunk], 0, pages[0])]) for r in runners],
               "second_chunk": [r.extend([ExtendSeq(prompt[chunk:], chunk, pages[0]), ExtendSeq(short, 0, pages[1])])
                                for r in runners]}
    assert _delta(_paths(tbo), before) == (2, 0, 4)  # both prefills split
    next_ids = outputs["second_chunk"][0].argmax(-1).tolist()
    lengths = [len(prompt), len(short)]
    for step in range(3):
        seqs = [DecodeSeq(t, n + step, pg) for t, n, pg in zip(next_ids, lengths, pages)]
        outputs[f"decode2_{step}"] = [r.decode(seqs) for r in runners]
        next_ids = outputs[f"decode2_{step}"][0].argmax(-1).tolist()
    assert _delta(_paths(tbo), before) == (5, 0, 10)  # a decode batch of 2 splits 1 | 1
    outputs["decode1"] = [r.decode([DecodeSeq(next_ids[0], lengths[0] + 3, pages[0])]) for r in runners]
    assert _delta(_paths(tbo), before) == (5, 1, 10)  # a decode batch of 1 runs plain
    for case, (want, got) in outputs.items():
        assert got.shape == want.shape, case
        assert _rel_err(got, want) <= REL_TOL, case
        assert torch.equal(got.argmax(-1), want.argmax(-1)), case  # greedy tokens
    for layer in range(plain.config.num_hidden_layers):  # the KV both wrote, chunks included
        # As the logits: relative to the layer's whole KV (element-wise, one small latent computed in
        # another GEMM shape once missed atol 1e-5 by 2x; a wrong slot is off by O(1)).
        assert _rel_err(runners[1].kv_pool.buffers[layer], runners[0].kv_pool.buffers[layer]) <= REL_TOL, layer


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_batches_just_below_and_above_the_floor(models, mode):
    """A configured floor: one token fewer runs plain, the floor itself splits; both equal plain."""
    plain, tbo = models
    rng = random.Random()
    floor = rng.randint(3, 9)
    rules = TboRules(min_decode_tokens=floor, min_extend_tokens=floor)
    executor = TwoBatchOverlap(tbo, ParallelInfo(), rules)
    for tokens, overlapped in ((floor - 1, 0), (floor, 1)):
        if mode is ForwardMode.DECODE:
            lengths = [1] * tokens
        else:  # random sequence lengths summing to `tokens`
            cuts = sorted(rng.sample(range(1, tokens), rng.randint(0, tokens - 1)))
            lengths = [b - a for a, b in zip([0] + cuts, cuts + [tokens])]
        batch = _batch(tbo, mode, lengths, prefix=rng.randint(0, 5))
        with torch.no_grad():
            want = plain.compute_logits(plain.final_hidden(plain.run_layers(batch), batch.last_token_index))
            before = dict(executor.stats)
            got = tbo.compute_logits(executor.final_hidden(batch))
        assert executor.stats["overlapped"] - before["overlapped"] == overlapped, (tokens, lengths)
        assert executor.stats["plain"] - before["plain"] == 1 - overlapped, (tokens, lengths)
        assert _rel_err(got, want) <= REL_TOL, (tokens, lengths)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
