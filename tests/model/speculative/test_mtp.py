"""The MTP layer: the tiny generator writes one without changing the other weights, the loader
builds it only when speculation is asked for (FP8 kept FP8), and bad set-ups are clear errors:
a checkpoint without an MTP layer, `--speculative-num-steps` out of range."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepseek_pd.errors import UserError
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.workers.engine.offline import Engine, EngineConfig
from deepseek_pd.model.quant.fp8_linear import Fp8Linear
from deepseek_pd.model.checkpoint.loader import load_model
from deepseek_pd.model.speculative.rules import MAX_SPECULATIVE_NUM_STEPS, resolve_speculative_num_steps
from deepseek_pd.model.checkpoint.tiny import make_tiny_model

pytestmark = pytest.mark.timeout(300)


def test_tiny_mtp_layer_leaves_the_other_weights_alone(tmp_path, tiny_mtp_checkpoint, module_seed):
    plain = make_tiny_model(tmp_path / "plain", seed=module_seed)
    a, b = load_file(str(tiny_mtp_checkpoint / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    assert all(torch.equal(a[name], b[name]) for name in b)
    extra = sorted(set(a) - set(b))
    assert all(name.startswith("model.layers.4.") for name in extra)
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_b_proj.weight", "mlp.experts.0.gate_proj.weight", "shared_head.head.weight"):
        assert f"model.layers.4.{part}" in extra
    assert json.loads((tiny_mtp_checkpoint / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert "num_nextn_predict_layers" not in json.loads((plain / "config.json").read_text()) or \
        json.loads((plain / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_mtp_layer_loads_only_when_asked(tiny_mtp_checkpoint):
    stored = load_file(str(tiny_mtp_checkpoint / "model.safetensors"))
    model = load_model(tiny_mtp_checkpoint, BuildOptions(mtp=True), progress=False)
    assert torch.equal(model.mtp.eh_proj.weight, stored["model.layers.4.eh_proj.weight"])
    assert torch.equal(model.mtp.shared_head_norm.weight, stored["model.layers.4.shared_head.norm.weight"])
    assert torch.equal(model.mtp.layer.mlp.experts.w2[3], stored["model.layers.4.mlp.experts.3.down_proj.weight"])
    assert model.num_kv_layers == 5
    assert load_model(tiny_mtp_checkpoint, BuildOptions(), progress=False).mtp is None


def test_fp8_mtp_layer_stays_fp8(tmp_path, module_seed):
    path = make_tiny_model(tmp_path / "fp8", seed=module_seed, mtp_layers=1, fp8_block=(128, 128))
    model = load_model(path, BuildOptions(mtp=True, fp8_backend="torch"), progress=False)
    assert isinstance(model.mtp.layer.self_attn.o_proj, Fp8Linear)
    assert model.mtp.layer.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert model.mtp.eh_proj.weight.dtype == torch.float32  # bf16/fp32 in the release, as SGLang keeps it


def test_speculation_without_an_mtp_layer_is_a_startup_error(tmp_path, module_seed):
    plain = make_tiny_model(tmp_path / "plain", seed=module_seed)
    with pytest.raises(UserError, match="num_nextn_predict_layers=0"):
        Engine(str(plain), speculative_num_steps=3)
    # config.json says it has one, but the tensors are not there (a trimmed checkpoint)
    broken = make_tiny_model(tmp_path / "broken", seed=module_seed, mtp_layers=1)
    tensors = {n: t for n, t in load_file(str(broken / "model.safetensors")).items()
               if not n.startswith("model.layers.4.")}
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"no model\.layers\.4\.eh_proj\.weight"):
        Engine(str(broken), speculative_num_steps=1)
    Engine(str(broken))  # without speculation it still serves


@pytest.mark.parametrize("steps", [-1, MAX_SPECULATIVE_NUM_STEPS + 1, True, 2.0])
def test_speculative_num_steps_out_of_range_is_refused(steps):
    with pytest.raises(UserError, match="--speculative-num-steps"):
        EngineConfig(speculative_num_steps=steps)


def test_resolve_auto_and_strings():
    assert resolve_speculative_num_steps("auto", 1) == 3
    assert resolve_speculative_num_steps("auto", 0) == 0
    assert resolve_speculative_num_steps("2", 0) == 2
    for bad in ("x", "9", "-1"):
        with pytest.raises(UserError, match="--speculative-num-steps"):
            resolve_speculative_num_steps(bad, 1)


def test_generate_cli_refuses_bad_steps_and_reports_acceptance(tiny_mtp_checkpoint):
    def generate(*extra):
        return subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "generate", "--model", str(tiny_mtp_checkpoint),
                               "--input-ids", "0,5,9", "--max-new-tokens", "6", "--device", "cpu", "--json", *extra],
                              capture_output=True, text=True, timeout=240)
    bad = generate("--speculative-num-steps", "12")
    assert bad.returncode != 0 and "--speculative-num-steps must be" in bad.stderr
    assert "Traceback" not in bad.stderr
    off, on = generate("--speculative-num-steps", "0"), generate()  # auto: 3 on a checkpoint with MTP
    assert off.returncode == 0 and on.returncode == 0, off.stderr + on.stderr
    off_json, on_json = json.loads(off.stdout), json.loads(on.stdout)
    assert on_json["output_ids"] == off_json["output_ids"]
    assert "speculative" not in off_json and on_json["speculative"]["num_steps"] == 3
