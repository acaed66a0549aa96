"""`serve --speculative-num-steps` (workers/serve/resolution.py): the runner gets it, the identity's
KV bytes per token count the MTP layer's KV (one layer more: what the pool holds, and `bench
serving` reads), CUDA graphs stay on by default on a GPU (draft and verify captured too), and a value out of range is refused."""
from __future__ import annotations

import json

import pytest
import torch

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.errors import UserError
from deepseek_pd.model import runner_config as runner_config_module
from deepseek_pd.model.checkpoint.tiny import tiny_config
from deepseek_pd.model.kv.memory_headroom import default_headroom_gib
from deepseek_pd.workers.serve.resolution import resolve_serve_config


def resolve(*argv: str):
    return resolve_serve_config(flags_from_args(build_parser().parse_args(["serve", *argv])))


@pytest.fixture
def model(tmp_path):
    config = {**tiny_config("v3", 512), "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_flag_reaches_the_runner_and_the_identity(model, role):
    plain = resolve(role, "--model", model, "--device", "cpu")
    spec = resolve(role, "--model", model, "--device", "cpu", "--speculative-num-steps", "2")
    assert (plain.runner.speculative_num_steps, spec.runner.speculative_num_steps) == (0, 2)
    layers = 4  # tiny_config's decoder layers; the MTP layer's KV is one more
    assert spec.identity.kv_bytes_per_token == plain.identity.kv_bytes_per_token * (layers + 1) // layers


def test_speculative_graphs_are_on_by_default_on_a_gpu(model, monkeypatch):
    """Draft and verify are captured too (model/speculative/graphs.py), by default as a plain decode
    worker's step is (RunnerConfig.resolve); the headroom follows the verify graph's k + 1 tokens
    per sequence, and `cuda_graph=false` turns them off."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner_config_module, "_triton_available", lambda: True)
    plain = resolve("decode", "--model", model).runner
    assert not resolve("decode", "--model", model, "--speculative-num-steps", "3",
                       "--engine-opt", "cuda_graph=false").runner.cuda_graph
    spec = resolve("decode", "--model", model, "--speculative-num-steps", "3").runner
    assert plain.cuda_graph and spec.cuda_graph
    assert spec.headroom_gib == default_headroom_gib(plain.cuda_graph_max_batch * 4) >= plain.headroom_gib


@pytest.mark.parametrize("steps", ["9", "-1"])
def test_out_of_range_is_refused(model, steps):
    with pytest.raises(UserError, match="--speculative-num-steps must be an integer in 0..8"):
        resolve("decode", "--model", model, "--device", "cpu", "--speculative-num-steps", steps)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_checkpoint_without_mtp_is_a_clear_start_up_error(tmp_path, role):
    """`serve` on a checkpoint without an MTP layer, speculation asked for: the process exits non-zero
    with the message naming the config and the flag (no traceback), before it serves anything."""
    import subprocess
    import sys

    from deepseek_pd.model.checkpoint.tiny import make_tiny_model
    from deepseek_pd.ports import pick_free_ports

    plain = make_tiny_model(tmp_path / "plain", seed=0)
    port, bootstrap = pick_free_ports(2)
    proc = subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "serve", role, "--model", str(plain),
                           "--device", "cpu", "--port", str(port), "--bootstrap-port", str(bootstrap),
                           "--speculative-num-steps", "2"],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode != 0
    assert "num_nextn_predict_layers=0" in proc.stderr and "--speculative-num-steps" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
