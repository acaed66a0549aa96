"""The tiny checkpoint: deterministic, loads unchanged in HF transformers, tokenizer round-trips,
greedy output is not degenerate, and the cached "tiny" appears atomically under concurrency."""
from __future__ import annotations

import json
import multiprocessing
import random
import string

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.checkpoint import tiny
from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir as resolve_model_path
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.model.checkpoint.tokenizer_builder import BOS_TOKEN, EOS_TOKEN

pytestmark = pytest.mark.timeout(180)

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ("v3", "v2")}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_dirs, tmp_path):
    again = make_tiny_model(tmp_path / "again", arch="v3", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_dirs["v3"] / name).read_bytes(), name
    other = make_tiny_model(tmp_path / "other", arch="v3", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ["v3", "v2"])
def test_loads_in_hf_transformers_with_every_weight(tiny_dirs, arch):
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    path = tiny_dirs[arch]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    config = json.loads((path / "config.json").read_text())
    assert type(model).__name__ == config["architectures"][0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config["vocab_size"] == model.config.vocab_size
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == (BOS_TOKEN, config["bos_token_id"])
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == (EOS_TOKEN, config["eos_token_id"])
    # Greedy output of random weights must wander, not repeat one token (else parity tests prove little).
    prompt = tokenizer("The robot looked at the sky", return_tensors="pt").input_ids
    assert prompt[0, 0].item() == config["bos_token_id"]
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    new = out[0, prompt.shape[1]:].tolist()
    assert len(set(new)) >= 8, new
    logits = model(prompt).logits[0, -1]
    assert logits.std() > 0.5, "logits too flat: greedy choices would be near-ties"


def test_chat_template_renders_deepseek_layout(tiny_dirs):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs["v3"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (f"{BOS_TOKEN}Be brief.<｜User｜>Hi<｜Assistant｜>Hello{EOS_TOKEN}"
                    "<｜User｜>Again<｜Assistant｜>")
    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_chat_template_renders_in_minijinja_like_the_router(tiny_dirs):
    """The router (sgl-model-gateway) renders chat templates with minijinja, not jinja2."""
    minijinja = pytest.importorskip("minijinja")
    transformers = pytest.importorskip("transformers")
    config = json.loads((tiny_dirs["v3"] / "tokenizer_config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs["v3"])
    rng = random.Random()
    for _ in range(5):
        roles = ["system"] * rng.randint(0, 1) + [rng.choice(["user", "assistant"]) for _ in range(rng.randint(1, 4))]
        messages = [{"role": role, "content": "".join(rng.choice(string.ascii_letters + " ") for _ in range(8))}
                    for role in roles]
        for add_generation_prompt in (True, False):
            rendered = minijinja.Environment().render_str(
                config["chat_template"], messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=config["bos_token"], eos_token=config["eos_token"])
            assert rendered == tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                             tokenize=False)


def test_tokenizer_round_trips_random_text(tiny_dirs):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_dirs["v3"] / "tokenizer.json"))
    rng = random.Random()
    alphabet = string.printable + "äöüßéñ你好世界🙂—"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        ids = tokenizer.encode(text).ids
        assert ids[0] == 0 and all(0 <= i < tokenizer.get_vocab_size() for i in ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # merges were learned: ordinary English is far fewer tokens than bytes
    english = "The model has attention layers and the weather is nice."
    assert len(tokenizer.encode(english).ids) < len(english) / 2


def test_config_parses_with_model_config(tiny_dirs):
    config_module = pytest.importorskip("deepseek_pd.model.config")
    for arch, path in tiny_dirs.items():
        config = config_module.ModelConfig.from_hf(path / "config.json")
        assert config.num_hidden_layers == 4 and config.max_position_embeddings >= 4096
        assert (config.q_lora_rank is None) == (arch == "v2")


def _resolve_in_child(cache: str, queue) -> None:
    import os
    os.environ["DEEPSEEK_PD_CACHE"] = cache
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir as resolve
    queue.put(str(resolve("tiny")))


def test_resolve_tiny_is_atomic_and_cached(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_resolve_in_child, args=(str(cache), queue)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    results = {queue.get(timeout=5) for _ in workers}
    assert results == {str(cache / "tiny-v3")}
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-v3"], "temp dirs left behind"
    for name in FILES:
        assert (cache / "tiny-v3" / name).is_file()

    monkeypatch.setenv("DEEPSEEK_PD_CACHE", str(cache))
    before = (cache / "tiny-v3" / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("tiny") == cache / "tiny-v3"
    assert (cache / "tiny-v3" / "model.safetensors").stat().st_mtime_ns == before  # not regenerated
    # A stale generation is replaced.
    (cache / "tiny-v3" / tiny.STAMP_FILE).write_text(json.dumps({"generator_version": -1}))
    assert resolve_model_path("tiny") == cache / "tiny-v3"
    assert json.loads((cache / "tiny-v3" / tiny.STAMP_FILE).read_text())["generator_version"] == tiny.GENERATOR_VERSION
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-v3"]


def test_fp8_variant_is_block_scaled_tiny(tiny_dirs, tmp_path):
    from safetensors.torch import load_file

    from deepseek_pd.cli import main
    from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig, dequantize_block_fp8

    assert main(["make-tiny-model", str(tmp_path / "fp8"), "--fp8"]) == 0
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    fp8 = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    plain = load_file(str(tiny_dirs["v3"] / "model.safetensors"))
    scales = [n for n in fp8 if n.endswith("_scale_inv")]
    assert scales and all(fp8[n[: -len("_scale_inv")]].dtype == torch.float8_e4m3fn for n in scales)
    assert fp8["lm_head.weight"].dtype == torch.float32 and fp8["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    for scale in scales:
        name = scale[: -len("_scale_inv")]
        restored = dequantize_block_fp8(fp8[name], fp8[scale], Fp8BlockQuantConfig(), dtype=torch.float32)
        torch.testing.assert_close(restored, plain[name], rtol=0.07, atol=plain[name].abs().max().item() / 256)


def test_resolve_and_make_reject_bad_input(tmp_path):
    with pytest.raises(UserError, match="neither 'tiny' nor an existing directory"):
        resolve_model_path(tmp_path / "missing")
    with pytest.raises(UserError, match="has no config.json"):
        resolve_model_path(tmp_path)
    with pytest.raises(UserError, match="unknown tiny architecture 'v4'"):
        make_tiny_model(tmp_path / "x", arch="v4")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="not a directory"):
        make_tiny_model(tmp_path / "file")
