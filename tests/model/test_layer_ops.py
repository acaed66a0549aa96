"""Op lists and their state: no silent overwrite, `forward()` equals the op list run by hand,
the attention policy's table, registries, and batch validation errors."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.attention import ATTENTION_BACKENDS, AttentionPolicy
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.forward_batch import AttentionMethod, ForwardBatch, ForwardMode
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.layer_ops import (DENSE_LAYER_OPS, LAYER_BOUNDARY_KEYS, MOE_LAYER_OPS, TBO_DECODE_MOE_OPS,
                                         TBO_PREFILL_MOE_OPS, OpState, without_yields)
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from pdtest.hf_oracle import TinyShape, build_hf_model, our_model

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return our_model(build_hf_model(TinyShape(arch="v3", first_k_dense_replace=1, num_layers=3),
                                    seed=random.randrange(1 << 30)))


def test_op_state_refuses_silent_overwrite():
    state = OpState(a=1)
    with pytest.raises(KeyError, match="'a' is already set"):
        state["a"] = 2
    assert state["a"] == 1 and "a" in state  # reading does not consume
    assert state.pop("a") == 1
    state["a"] = 3  # allowed once popped
    with pytest.raises(KeyError, match="'b' is not set"):
        state.pop("b")
    with pytest.raises(KeyError, match="'b' is not set"):
        _ = state["b"]
    with pytest.raises(KeyError):
        state.update(c=1, a=4)
    with pytest.raises(RuntimeError, match="expected exactly"):
        state.expect_only(frozenset({"a"}))


def test_op_lists_are_the_documented_ones(model):
    assert MOE_LAYER_OPS == ("prepare_attn", "attn_prepare", "attn_core", "prepare_mlp", "gate", "select_experts",
                             "dispatch_a", "dispatch_b", "experts", "combine_a", "shared_experts", "combine_b",
                             "output", "postprocess")
    assert [layer.op_names for layer in model.layers] == [DENSE_LAYER_OPS, MOE_LAYER_OPS, MOE_LAYER_OPS]
    for layer in model.layers:
        assert [op.__name__ for op in layer.ops] == [f"op_{name}" for name in layer.op_names]


def _batch(model, seqs, method: AttentionMethod) -> ForwardBatch:
    pool = KVPool(model.config.num_hidden_layers, 32, 4, model.config.kv_cache_dim)
    pages = [pool.alloc(pool.pages_for_tokens(len(s))) for s in seqs]
    batch = ForwardBatch.build(ForwardMode.EXTEND, seqs, [0] * len(seqs), pages, pool, model.config.vocab_size, "cpu")
    batch.attention_method = method
    return batch


@pytest.mark.parametrize("method", [AttentionMethod.MHA, AttentionMethod.MLA])
def test_forward_equals_running_the_op_list_by_hand(model, method):
    rng = random.Random()
    seqs = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    logits = model(_batch(model, seqs, method))
    batch = _batch(model, seqs, method)
    state = OpState(hidden_states=model.embed_tokens(batch.input_ids), residual=None)
    with torch.no_grad():
        for layer in model.layers:
            state.expect_only(LAYER_BOUNDARY_KEYS)
            for name in layer.op_names:
                getattr(layer, f"op_{name}")(state, batch)
        hidden = model.final_hidden(state, batch.last_token_index)
    assert torch.equal(model.compute_logits(hidden), logits)
    assert not state.keys()


def test_decode_forward_equals_the_op_list_by_hand(model):
    rng = random.Random()
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(2)]
    runner = ModelRunner.from_model(model, RunnerConfig(model="<test>", page_size=4, num_pages=16))
    pages = [runner.kv_pool.alloc(3) for _ in prompts]
    runner.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)])
    decode = [DecodeSeq(rng.randrange(vocab), len(p), pg) for p, pg in zip(prompts, pages)]
    logits = runner.decode(decode)
    batch = ForwardBatch.build(ForwardMode.DECODE, [[d.token_id] for d in decode], [d.position for d in decode],
                               pages, runner.kv_pool, vocab, "cpu")
    assert batch.attention_method is AttentionMethod.MLA
    state = OpState(hidden_states=model.embed_tokens(batch.input_ids), residual=None)
    with torch.no_grad():
        for layer in model.layers:
            for name in layer.op_names:
                getattr(layer, f"op_{name}")(state, batch)
        assert torch.equal(model.compute_logits(model.final_hidden(state, batch.last_token_index)), logits)
    with pytest.raises(UserError, match="one new token per sequence"):
        ForwardBatch.build(ForwardMode.DECODE, [[1, 2]], [0], [pages[0]], runner.kv_pool, vocab, "cpu")


def test_tbo_orders_are_the_same_ops_and_give_the_same_result(model):
    assert without_yields(TBO_PREFILL_MOE_OPS) == MOE_LAYER_OPS
    assert sorted(without_yields(TBO_DECODE_MOE_OPS)) == sorted(MOE_LAYER_OPS)
    rng = random.Random()
    seqs = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(1, 9))] for _ in range(2)]
    want = model(_batch(model, seqs, AttentionMethod.MHA))
    batch = _batch(model, seqs, AttentionMethod.MHA)
    state = model.initial_state(batch)
    with torch.no_grad():
        for layer in model.layers:
            order = without_yields(TBO_DECODE_MOE_OPS) if layer.is_moe else layer.op_names
            for name in order:
                getattr(layer, f"op_{name}")(state, batch)
        assert torch.equal(model.compute_logits(model.final_hidden(state, batch.last_token_index)), want)


def test_an_op_run_twice_is_caught(model):
    batch = _batch(model, [[1, 2, 3]], AttentionMethod.MHA)
    layer = model.layers[1]
    state = OpState(hidden_states=model.embed_tokens(batch.input_ids), residual=None)
    with torch.no_grad():
        for name in ("prepare_attn", "attn_prepare", "attn_core", "prepare_mlp", "gate"):
            getattr(layer, f"op_{name}")(state, batch)
        with pytest.raises(KeyError, match="router_logits"):
            layer.op_gate(state, batch)


@pytest.mark.parametrize("method, mode, prefixes, want", [
    ("auto", ForwardMode.DECODE, (5, 7), AttentionMethod.MLA),
    ("mha", ForwardMode.DECODE, (5,), AttentionMethod.MLA),
    ("auto", ForwardMode.EXTEND, (0, 0), AttentionMethod.MHA),
    ("auto", ForwardMode.EXTEND, (100, 0), AttentionMethod.MLA),
    ("auto", ForwardMode.EXTEND, (200, 100), AttentionMethod.MHA_CHUNKED_KV),
    ("mla", ForwardMode.EXTEND, (0,), AttentionMethod.MLA),
    ("mha", ForwardMode.EXTEND, (0,), AttentionMethod.MHA),
    ("mha", ForwardMode.EXTEND, (3,), AttentionMethod.MHA_CHUNKED_KV),
    ("mha_chunked_kv", ForwardMode.EXTEND, (0,), AttentionMethod.MHA_CHUNKED_KV),
])
def test_attention_policy(method, mode, prefixes, want):
    assert AttentionPolicy(method, chunked_kv_threshold=256).choose(mode, prefixes) is want


def test_bad_names_are_user_errors():
    with pytest.raises(UserError, match="attention_method"):
        AttentionPolicy("flash")
    with pytest.raises(UserError, match="unknown attention backend 'nope'; available: .*torch"):
        ATTENTION_BACKENDS.build("nope")
    with pytest.raises(UserError, match="attention_method"):
        RunnerConfig(attention_method="fast")
    with pytest.raises(UserError, match="dtype"):
        RunnerConfig(dtype="int4")
    with pytest.raises(UserError, match="prefix_chunk_size"):
        BuildOptions(prefix_chunk_size=0)


def test_runner_rejects_bad_sequences(model):
    runner = ModelRunner.from_model(model, RunnerConfig(model="<test>", page_size=4, num_pages=8))
    pages = runner.kv_pool.alloc(2)
    cases = [
        ([ExtendSeq([1] * 9, 0, pages)], "cannot hold 9 tokens"),
        ([ExtendSeq([model.config.vocab_size], 0, pages)], "outside the vocabulary"),
        ([ExtendSeq([-1], 0, pages)], "outside the vocabulary"),
        ([ExtendSeq([], 0, pages)], "no new tokens"),
        ([ExtendSeq([1], 0, [8])], "outside the pool"),
        ([ExtendSeq([1], -1, pages)], "prefix_len"),
        ([], "empty batch"),
    ]
    for seqs, message in cases:
        with pytest.raises(UserError, match=message):
            runner.extend(seqs)
    with pytest.raises(UserError, match="cannot hold 9 tokens"):
        runner.decode([DecodeSeq(1, 8, pages)])


def test_runner_rejects_non_integer_inputs(model):
    runner = ModelRunner.from_model(model, RunnerConfig(model="<test>", page_size=4, num_pages=8))
    pages = runner.kv_pool.alloc(2)
    for seq in (ExtendSeq([1.5], 0, pages), ExtendSeq(["a"], 0, pages), ExtendSeq([[1]], 0, pages),
                ExtendSeq([1], 0, [0.5])):
        with pytest.raises(UserError, match="must be a sequence of integers"):
            runner.extend([seq])
    import numpy as np
    assert runner.extend([ExtendSeq(np.array([1, 2]), 0, torch.tensor(pages))]).shape == (1, model.config.vocab_size)
