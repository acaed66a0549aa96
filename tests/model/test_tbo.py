"""Two-batch overlap in one process: equals the plain forward (prefill, prefill with a cached
prefix, paged decode), splits where the tokens balance, and really interleaves per the rule."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.kv_pool import KVPool
from deepseek_pd.model.layer_ops import TBO_DECODE_MOE_OPS, TBO_PREFILL_MOE_OPS, YIELD, OpState
from deepseek_pd.model.parallel import ParallelInfo
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner, RunnerConfig
from deepseek_pd.model.tbo import TwoBatchOverlap, interleaved_order, split_point, sub_batch
from hf_oracle import TinyShape, build_hf_model, our_model

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


def test_split_balances_tokens_and_sub_batches_are_consistent(models):
    plain, _ = models
    rng = random.Random()
    lengths = [rng.randint(1, 20) for _ in range(rng.randint(2, 7))]
    batch = _batch(plain, ForwardMode.EXTEND, lengths)
    cut = split_point(batch)
    imbalance = [abs(sum(lengths[:c]) - sum(lengths[c:])) for c in range(1, len(lengths))]
    assert abs(sum(lengths[:cut]) - sum(lengths[cut:])) == min(imbalance)
    first, second = sub_batch(batch, 0, cut), sub_batch(batch, cut, len(lengths))
    assert first.extend_lens + second.extend_lens == batch.extend_lens
    assert torch.equal(torch.cat([first.input_ids, second.input_ids]), batch.input_ids)
    assert torch.equal(torch.cat([first.out_slots, second.out_slots]), batch.out_slots)
    for half in (first, second):
        assert half.qo_indptr.tolist() == list(half.qo_offsets)
        assert half.token_seq.tolist() == [i for i, n in enumerate(half.extend_lens) for _ in range(n)]
    decode = _batch(plain, ForwardMode.DECODE, [1] * 7, prefix=5)
    assert split_point(decode) == 3
    assert split_point(_batch(plain, ForwardMode.EXTEND, [9])) is None


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
        TwoBatchOverlap(tbo, ParallelInfo()).final_hidden(batch, trace)
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
    halves = (sub_batch(batch, 0, 1), sub_batch(batch, 1, 2))
    executor = TwoBatchOverlap(tbo, ParallelInfo())
    stages = executor.stages[ForwardMode.EXTEND]
    state = OpState(hidden_states=tbo.embed_tokens(batch.input_ids[:3]), residual=None)
    with torch.no_grad(), pytest.raises(KeyError, match="already set|not set"):
        for micro, index in interleaved_order(len(stages), 0):
            for op in stages[index]:
                op.run(state, halves[micro])
