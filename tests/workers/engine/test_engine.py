"""The offline engine against HF transformers `generate` (greedy, fp32, CPU) on the tiny V2 and V3
checkpoints, with chunked prefill under every attention method; batching, seeds, FP8 checkpoints,
KV pages freed, and bad input as one-line UserErrors."""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.checkpoint_utils import make_fp8_tiny
from deepseek_pd.errors import UserError
from deepseek_pd.model.attention.policy import AttentionPolicy
from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.forward_batch import AttentionMethod
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.checkpoint.tiny import make_tiny_model

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ("v3", "v2")}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    models = {}
    for arch, path in checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # run the full budget: longer comparisons
        models[arch] = model
    return models


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def random_prompt(length: int, vocab: int) -> list[int]:
    rng = random.Random()
    return [0] + [rng.randrange(4, vocab) for _ in range(length - 1)]  # BOS, then no special tokens


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture
def methods_used(monkeypatch):
    used: list[AttentionMethod] = []
    original = AttentionPolicy.choose

    def recording(self, mode, prefix_lens):
        method = original(self, mode, prefix_lens)
        used.append(method)
        return method

    monkeypatch.setattr(AttentionPolicy, "choose", recording)
    return used


@pytest.mark.parametrize("arch", ["v3", "v2"])
@pytest.mark.parametrize("method,chunk,prompt_len,expect", [
    ("auto", 2048, 37, {AttentionMethod.MHA}),
    ("mha", 7, 37, {AttentionMethod.MHA, AttentionMethod.MHA_CHUNKED_KV}),
    ("mha_chunked_kv", 5, 23, {AttentionMethod.MHA_CHUNKED_KV}),
    ("mla", 16, 37, {AttentionMethod.MLA}),
    ("auto", 128, 300, {AttentionMethod.MHA, AttentionMethod.MLA, AttentionMethod.MHA_CHUNKED_KV}),
])
def test_greedy_equals_hf_generate(checkpoints, hf_models, methods_used, arch, method, chunk, prompt_len, expect):
    engine = Engine(str(checkpoints[arch]), attention_method=method, chunked_prefill_size=chunk)
    prompt = random_prompt(prompt_len, engine.vocab_size)
    result = engine.generate(prompt, GREEDY)
    assert result.output_ids == hf_greedy(hf_models[arch], prompt)
    assert result.finish_reason == "length" and result.prompt_tokens == prompt_len
    num_chunks = -(-prompt_len // chunk)
    prefill_methods = methods_used[:num_chunks]
    assert set(prefill_methods) == expect, prefill_methods
    assert set(methods_used[num_chunks:]) == {AttentionMethod.MLA}  # decode is always absorbed MLA
    assert engine.runner.kv_pool.num_used_pages == 0


def test_batch_equals_single_requests(checkpoints, hf_models):
    engine = Engine(str(checkpoints["v3"]), chunked_prefill_size=16)
    prompts = [random_prompt(n, engine.vocab_size) for n in (5, 33, 18)]
    params = [GREEDY, SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True), GREEDY]
    batch = engine.generate_batch(prompts, params)
    for prompt, p, result in zip(prompts, params, batch):
        assert result.output_ids == hf_greedy(hf_models["v3"], prompt, p.max_new_tokens)
    assert engine.runner.kv_pool.num_used_pages == 0


def test_batch_larger_than_the_pool_runs_in_waves(checkpoints, hf_models, monkeypatch):
    engine = Engine(str(checkpoints["v3"]), max_total_tokens=96, page_size=16)  # 6 pages
    # prompt + 19 cached new tokens: 4, 2, 4, 2, 3 pages -> waves {30, 12}, {40, 7}, {25}
    prompts = [random_prompt(n, engine.vocab_size) for n in (30, 12, 40, 7, 25)]
    peak = {"used": 0}
    real_decode = engine.runner.decode

    def watching_decode(seqs):
        peak["used"] = max(peak["used"], engine.runner.kv_pool.num_used_pages)
        return real_decode(seqs)

    monkeypatch.setattr(engine.runner, "decode", watching_decode)
    results = engine.generate_batch(prompts, GREEDY)
    assert peak["used"] == 6
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(hf_models["v3"], prompt)
    assert engine.runner.kv_pool.num_used_pages == 0


def test_seeded_sampling_reproducible_in_any_batch(checkpoints):
    engine = Engine(str(checkpoints["v3"]))
    seed = random.randrange(2**31)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=seed, ignore_eos=True)
    prompt = random_prompt(9, engine.vocab_size)
    alone = engine.generate(prompt, params).output_ids
    noisy = SamplingParams(temperature=1.2, max_new_tokens=5, ignore_eos=True)
    batch = engine.generate_batch([random_prompt(4, engine.vocab_size), prompt], [noisy, params])
    assert batch[1].output_ids == alone
    other = engine.generate(prompt, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12,
                                                   seed=seed + 1, ignore_eos=True)).output_ids
    assert other != alone


def test_text_prompt_stop_string_and_stop_token(checkpoints):
    engine = Engine(str(checkpoints["v3"]))
    rng = random.Random()
    prompt = " ".join(rng.choice(["the", "robot", "sky", "blue", "model", "token", "Hello"]) for _ in range(6))
    run = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    free_run = engine.generate(prompt, run)
    assert free_run.prompt_tokens == len(engine.encode(prompt))
    assert engine.generate(engine.encode(prompt), run).output_ids == free_run.output_ids
    text = free_run.text.rstrip("\ufffd")
    assert len(text) > 4
    start = rng.randrange(0, len(text) - 2)
    stop = text[start:start + 2]
    stopped = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True,
                                                     stop=(stop,)))
    assert (stopped.finish_reason, stopped.matched_stop) == ("stop", stop)
    assert stopped.text == text[:text.find(stop)]
    assert stopped.output_ids == free_run.output_ids[:len(stopped.output_ids)]
    # a stop token id: the output ends with it (included, as SGLang does)
    token = free_run.output_ids[rng.randrange(len(free_run.output_ids))]
    # ignore_eos as in the free run: else an eos sampled before `token` ends it first (was flaky)
    cut = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True,
                                                 stop_token_ids=(token,)))
    assert (cut.finish_reason, cut.matched_stop) == ("stop", token)
    assert cut.output_ids == free_run.output_ids[:free_run.output_ids.index(token) + 1]


@pytest.mark.parametrize("block", [(16, 32), (128, 128)])
def test_fp8_checkpoint_matches_dequantised_twin(checkpoints, tmp_path, block):
    fp8_dir, twin_dir = make_fp8_tiny(checkpoints["v3"], tmp_path / "fp8", block=block)
    fp8_engine, twin_engine = Engine(str(fp8_dir)), Engine(str(twin_dir))
    prompt = random_prompt(21, fp8_engine.vocab_size)
    assert fp8_engine.generate(prompt, GREEDY).output_ids == twin_engine.generate(prompt, GREEDY).output_ids
    for name, param in fp8_engine.runner.model.state_dict().items():
        assert torch.equal(param, twin_engine.runner.model.state_dict()[name]), name
    hf_twin = transformers.AutoModelForCausalLM.from_pretrained(twin_dir, dtype=torch.float32).eval()
    hf_twin.generation_config.eos_token_id = None
    assert fp8_engine.generate(prompt, GREEDY).output_ids == hf_greedy(hf_twin, prompt)


def test_bad_input_is_one_line_user_error(checkpoints):
    engine = Engine(str(checkpoints["v3"]), max_total_tokens=256)
    vocab, context = engine.vocab_size, engine.max_context
    cases = [
        ([], "prompt is empty"),
        ("", "prompt is empty"),
        ([0, vocab], f"token ids \\[{vocab}\\] are outside the vocabulary \\[0, {vocab}\\)"),
        ([0, -3], "outside the vocabulary"),
        ([5] * context, f"prompt has {context} tokens but the model's maximum context is {context}"),
    ]
    for prompt, match in cases:
        with pytest.raises(UserError, match=match) as exc:
            engine.generate(prompt, GREEDY)
        assert "\n" not in str(exc.value)
    with pytest.raises(UserError, match="temperature=-1"):
        engine.generate([0, 5], SamplingParams(temperature=-1))
    with pytest.raises(UserError, match="prompt 1: prompt is empty"):
        engine.generate_batch([[0, 5], []], GREEDY)
    with pytest.raises(UserError, match=r"token ids \[1.5\]"):
        engine.generate([0, 1.5], GREEDY)
    import numpy as np
    assert engine.generate(np.array([0, 5, 6]), GREEDY).output_ids == engine.generate([0, 5, 6], GREEDY).output_ids
    with pytest.raises(UserError, match="no prompts"):
        engine.generate_batch([])
    # one request larger than the whole pool: refused before anything runs, nothing leaks
    with pytest.raises(UserError, match="need 18 KV pages but the pool has 16 free of 16"):
        engine.generate_batch([[0, 5, 6], [0, 7]], SamplingParams(max_new_tokens=280, temperature=0.0))
    assert engine.runner.kv_pool.num_used_pages == 0
    assert len(engine.generate([0, 5, 6], GREEDY).output_ids) == NEW_TOKENS
    with pytest.raises(UserError, match="chunked_prefill_size"):
        Engine(str(checkpoints["v3"]), chunked_prefill_size=0)


def test_pages_freed_when_the_model_fails_mid_decode(checkpoints, monkeypatch):
    engine = Engine(str(checkpoints["v3"]), chunked_prefill_size=8)
    calls = {"n": 0}
    real_decode = engine.runner.decode

    def failing_decode(seqs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device failure")
        return real_decode(seqs)

    monkeypatch.setattr(engine.runner, "decode", failing_decode)
    prompts = [random_prompt(n, engine.vocab_size) for n in (11, 20)]
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate_batch(prompts, GREEDY)
    assert engine.runner.kv_pool.num_used_pages == 0
    monkeypatch.undo()
    assert len(engine.generate(prompts[0], GREEDY).output_ids) == NEW_TOKENS


def test_prompt_near_context_is_capped(checkpoints, tmp_path):
    """max_new_tokens is cut so prompt + output never pass max_position_embeddings (shrunk to 64 here)."""
    import json
    import shutil

    short = shutil.copytree(checkpoints["v2"], tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    engine = Engine(str(short), chunked_prefill_size=16)
    assert engine.max_context == 64
    prompt = random_prompt(62, engine.vocab_size)
    result = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True))
    assert len(result.output_ids) == 2 and result.finish_reason == "length"
    with pytest.raises(UserError, match="prompt has 64 tokens but the model's maximum context is 64"):
        engine.generate(random_prompt(64, engine.vocab_size), GREEDY)


def test_bench_model_cpu_runs(checkpoints):
    """The benchmark must not rot: one tiny run, output parsed (figures are not asserted)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[3] / "bench" / "model_cpu.py"
    proc = subprocess.run([sys.executable, str(bench), "--model", str(checkpoints["v2"]), "--batch", "2",
                           "--prompt-len", "8", "--decode-steps", "2", "--repeats", "1", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["prefill_tok_s"] > 0 and figures["decode_tok_s"] > 0
    assert "prefill:" in proc.stdout and "decode:" in proc.stdout
