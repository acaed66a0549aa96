"""Checkpoint reading: single vs sharded, FP8 block-scaled vs its dequantised twin, MTP skipping,
and every broken-checkpoint case as a one-line UserError naming the culprit."""
from __future__ import annotations

import json

import pytest
import torch

from pdtest.checkpoint_utils import fp8_twins, write_checkpoint
from deepseek_pd.errors import CheckpointError, UserError
from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
from deepseek_pd.model.checkpoint.loader import iter_checkpoint_tensors, read_hf_config

pytestmark = pytest.mark.timeout(120)

NUM_LAYERS = 2
CONFIG = {"num_hidden_layers": NUM_LAYERS, "model_type": "deepseek_v3"}


def _random_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Odd shapes (not multiples of 128) in the places DeepSeek has linear weights."""
    gen = torch.Generator().manual_seed(seed)

    def dim() -> int:
        return int(torch.randint(3, 300, (1,), generator=gen))

    tensors = {"model.embed_tokens.weight": torch.randn(50, 24, generator=gen),
               "lm_head.weight": torch.randn(50, 24, generator=gen)}
    for layer in range(NUM_LAYERS + 1):  # the last one is an MTP layer
        p = f"model.layers.{layer}"
        tensors[f"{p}.self_attn.q_a_proj.weight"] = torch.randn(dim(), dim(), generator=gen)
        tensors[f"{p}.mlp.experts.0.down_proj.weight"] = torch.randn(dim(), dim(), generator=gen)
        tensors[f"{p}.mlp.gate.weight"] = torch.randn(8, 24, generator=gen)
        tensors[f"{p}.input_layernorm.weight"] = torch.randn(24, generator=gen)
    return tensors


def _load(path, **kwargs) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in iter_checkpoint_tensors(path, **kwargs):
        assert name not in out, f"{name} yielded twice"
        out[name] = tensor
    return out


def _without_mtp(tensors):
    return {n: t for n, t in tensors.items() if not n.startswith(f"model.layers.{NUM_LAYERS}.")}


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


@pytest.fixture
def seed():
    return int(torch.randint(0, 2**31 - 1, (1,)))


def test_sharded_with_index_equals_single_file(tmp_path, seed):
    tensors = _random_tensors(seed)
    single = write_checkpoint(tmp_path / "single", tensors, CONFIG)
    sharded = write_checkpoint(tmp_path / "sharded", tensors, CONFIG, num_shards=3, seed=seed)
    assert len(list(sharded.glob("*.safetensors"))) >= 2
    _assert_same(_load(sharded, progress=False), _load(single, progress=False))
    _assert_same(_load(single, progress=False), _without_mtp(tensors))


def test_mtp_layers_skipped_unless_kept(tmp_path, seed):
    tensors = _random_tensors(seed)
    path = write_checkpoint(tmp_path / "ckpt", tensors, CONFIG)
    skipped = _load(path, progress=False)
    assert not any(n.startswith(f"model.layers.{NUM_LAYERS}.") for n in skipped)
    _assert_same(_load(path, progress=False, keep_mtp_layers=True), tensors)


@pytest.mark.parametrize("block", [(128, 128), (32, 16)])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_fp8_block_scaled_matches_dequantised_twin(tmp_path, seed, block, num_shards):
    tensors = _random_tensors(seed)
    quantised, twin = fp8_twins(tensors, Fp8BlockQuantConfig(*block))
    assert any(t.dtype == torch.float8_e4m3fn for t in quantised.values())
    config = {**CONFIG, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                "weight_block_size": list(block)}}
    path = write_checkpoint(tmp_path / "fp8", quantised, config, num_shards=num_shards, seed=seed)
    got = _load(path, progress=False, fp8_dtype=torch.float32)
    assert not any(n.endswith("_scale_inv") for n in got)
    _assert_same(got, _without_mtp(twin))
    # The twin really differs from the original weights (quantisation happened), within fp8 error.
    name = "model.layers.0.self_attn.q_a_proj.weight"
    assert not torch.equal(got[name], tensors[name])
    torch.testing.assert_close(got[name], tensors[name], rtol=0.07, atol=tensors[name].abs().max().item() / 256)
    bf16 = _load(path, progress=False, fp8_dtype=torch.bfloat16)
    assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], got[name].to(torch.bfloat16))


def test_progress_bar_silent_when_not_a_tty(tmp_path, seed, capsys):
    path = write_checkpoint(tmp_path / "ckpt", _random_tensors(seed), CONFIG)
    _load(path, progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


# ---- broken checkpoints ----------------------------------------------------------------------

def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(UserError, match="does not exist") as exc:
        _load(tmp_path / "nope")
    _one_line(exc)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json not found"):
        _load(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_hf_config(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"num_hidden_layers": "four"}))
    with pytest.raises(UserError, match="num_hidden_layers='four'"):
        _load(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(UserError, match="no model.safetensors"):
        _load(tmp_path / "empty")


def test_index_naming_missing_shard_or_tensor(tmp_path, seed):
    tensors = _random_tensors(seed)
    path = write_checkpoint(tmp_path / "ckpt", tensors, CONFIG, num_shards=3, seed=seed)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).rename(path / "moved.bin")
    with pytest.raises(UserError, match=f"shard files that do not exist: {shard}") as exc:
        _load(path)
    _one_line(exc)
    (path / "moved.bin").rename(path / shard)

    index["weight_map"]["model.layers.0.self_attn.kv_b_proj.weight"] = shard
    index["weight_map"]["model.layers.1.self_attn.o_proj.weight"] = shard
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        _load(path)
    assert exc.value.missing == ["model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.o_proj.weight"]
    assert "missing tensors (2)" in _one_line(exc)

    index_file.write_text('{"weight_map": [1, 2]}')
    with pytest.raises(UserError, match="malformed index"):
        _load(path)


def test_corrupt_file(tmp_path, seed):
    path = write_checkpoint(tmp_path / "ckpt", _random_tensors(seed), CONFIG)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="model.safetensors") as exc:
        _load(path)
    _one_line(exc)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(UserError, match="corrupt"):
        _load(path)


def test_fp8_inconsistencies(tmp_path, seed):
    tensors = _random_tensors(seed)
    quantised, _ = fp8_twins(tensors, Fp8BlockQuantConfig(128, 128))
    quant_cfg = {**CONFIG, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    scale = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"

    no_scale = {n: t for n, t in quantised.items() if n != scale}
    with pytest.raises(CheckpointError, match="has no scale") as exc:
        _load(write_checkpoint(tmp_path / "a", no_scale, quant_cfg))
    assert exc.value.missing == [scale]

    orphan = {**tensors, "model.layers.1.mlp.ghost.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(CheckpointError) as exc:
        _load(write_checkpoint(tmp_path / "b", orphan, quant_cfg))
    assert exc.value.unexpected == ["model.layers.1.mlp.ghost.weight_scale_inv"]

    with pytest.raises(UserError, match="no quantization_config"):
        _load(write_checkpoint(tmp_path / "c", quantised, CONFIG))

    wrong_shape = {**quantised, scale: torch.ones(7, 7)}
    with pytest.raises(UserError, match=r"weight_scale_inv has shape \(7, 7\)"):
        _load(write_checkpoint(tmp_path / "d", wrong_shape, quant_cfg))


def test_keep_fp8_yields_weight_then_scale(tmp_path, seed):
    tensors = _random_tensors(seed)
    quantised, _ = fp8_twins(tensors, Fp8BlockQuantConfig(128, 128))
    config = {**CONFIG, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    path = write_checkpoint(tmp_path / "fp8", quantised, config, num_shards=2, seed=seed)
    items = list(iter_checkpoint_tensors(path, progress=False, keep_fp8=True))
    got = dict(items)
    _assert_same(got, _without_mtp(quantised))
    names = [n for n, _ in items]
    for i, name in enumerate(names):
        if name.endswith("_scale_inv"):
            assert names[i - 1] == name[: -len("_scale_inv")]  # the scale follows its weight


def test_load_model_matches_hf_logits(tmp_path):
    """load_model builds the model from a checkpoint and its logits are HF's (guards the wiring)."""
    transformers = pytest.importorskip("transformers")
    from deepseek_pd.model.checkpoint.loader import load_model
    from deepseek_pd.model.runner import ExtendSeq, ModelRunner
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    torch.set_num_threads(1)
    path = make_tiny_model(tmp_path / "tiny", arch="v3", seed=int(torch.randint(0, 1000, (1,))))
    runner = ModelRunner.from_model(load_model(path, progress=False))
    prompt = torch.randint(4, runner.model_config.vocab_size, (13,)).tolist()
    pages = runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(prompt)))
    logits = runner.extend([ExtendSeq(prompt, prefix_len=0, pages=pages)])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_progress_bar_shown_on_a_terminal(tmp_path, seed, monkeypatch):
    """stderr that is a terminal gets the bar; progress=False silences it even there."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    path = write_checkpoint(tmp_path / "ckpt", _random_tensors(seed), CONFIG)
    for progress in (True, False):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert len(_load(path, progress=progress)) == len(_without_mtp(_random_tensors(seed)))
        monkeypatch.undo()
        assert ("Loading ckpt" in terminal.getvalue()) == progress, terminal.getvalue()
