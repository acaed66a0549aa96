"""Every "auto" of a RunnerConfig decided before it is frozen: device, dtype, backends, CUDA graphs.

`torch.cuda.is_available` is patched to play a GPU machine; nothing here needs one.
"""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model import runner_config as runner_config_module
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.device import is_cuda, resolve_device
from deepseek_pd.model.runner_config import RunnerConfig, auto_dtype
from deepseek_pd.model.checkpoint.tiny import tiny_config

DTYPES = ("float32", "bfloat16", "float16")


@pytest.fixture
def gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner_config_module, "_triton_available", lambda: True)


@pytest.fixture
def cpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def model_config(torch_dtype: str, fp8: bool = False) -> ModelConfig:
    raw = {**tiny_config(random.choice(["v2", "v3"]), 512), "torch_dtype": torch_dtype}
    if fp8:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return ModelConfig.from_hf(raw)


def test_device_auto_follows_cuda_availability(monkeypatch) -> None:
    for available, want in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert resolve_device("auto") == want
        assert resolve_device("cpu") == "cpu"


def test_explicit_devices_are_checked(cpu_machine) -> None:
    with pytest.raises(UserError, match="CUDA is not available"):
        resolve_device("cuda:1")
    with pytest.raises(UserError, match="not a torch device"):
        resolve_device("gpu0")
    assert [is_cuda(d) for d in ("cuda", "cuda:3", "cpu", "meta")] == [True, True, False, False]


def test_auto_dtype_is_the_checkpoints_on_gpu_fp32_on_cpu_bf16_for_fp8() -> None:
    for stored in DTYPES:
        assert auto_dtype("cpu", model_config(stored)) == "float32"
        assert auto_dtype("cuda", model_config(stored)) == stored
        assert auto_dtype("cuda:1", model_config(stored, fp8=True)) == "bfloat16"
        assert auto_dtype("cpu", model_config(stored, fp8=True)) == "float32"


def test_resolve_decides_every_auto_on_a_gpu(gpu_machine) -> None:
    stored = random.choice(DTYPES)
    resolved = RunnerConfig.resolve(model_config(stored), graphs_by_default=True, model="m")
    assert (resolved.device, resolved.dtype) == ("cuda", stored)
    assert (resolved.attention_backend, resolved.moe_backend, resolved.dispatcher) == ("triton", "triton", "local")
    assert resolved.cuda_graph is True
    assert RunnerConfig.resolve(model_config(stored), graphs_by_default=False, model="m").cuda_graph is False
    explicit = RunnerConfig.resolve(model_config(stored), graphs_by_default=True, model="m", dtype="float32")
    assert explicit.dtype == "float32"


def test_graph_default_needs_capturable_backends(gpu_machine) -> None:
    cfg = model_config("bfloat16")
    for fields in ({"attention_backend": "torch"}, {"moe_backend": "torch"}, {"enable_tbo": True}):
        assert RunnerConfig.resolve(cfg, graphs_by_default=True, model="m", **fields).cuda_graph is False
        with pytest.raises(UserError, match="cuda_graph=true"):
            RunnerConfig.resolve(cfg, graphs_by_default=True, model="m", cuda_graph=True, **fields)
    grouped = RunnerConfig.resolve(cfg, graphs_by_default=True, model="m", moe_backend="grouped")
    assert grouped.cuda_graph is True
    off = RunnerConfig.resolve(cfg, graphs_by_default=True, model="m", cuda_graph=False)
    assert off.cuda_graph is False


def test_speculative_graphs_follow_the_decode_graph_default(gpu_machine) -> None:
    """Draft and verify graphs passed their GPU test (H100, 2026-12-07): a speculative worker
    captures by default where a plain one does, and `cuda_graph=false` still turns them off."""
    cfg = model_config("bfloat16")
    steps = random.randint(1, 3)
    assert RunnerConfig.resolve(cfg, graphs_by_default=True, model="m", speculative_num_steps=steps).cuda_graph is True
    assert RunnerConfig.resolve(cfg, graphs_by_default=False, model="m", speculative_num_steps=steps).cuda_graph is False
    off = RunnerConfig.resolve(cfg, graphs_by_default=True, model="m", speculative_num_steps=steps, cuda_graph=False)
    assert off.cuda_graph is False


def test_resolve_on_a_cpu_machine(cpu_machine) -> None:
    resolved = RunnerConfig.resolve(model_config("bfloat16"), graphs_by_default=True, model="m")
    assert (resolved.device, resolved.dtype, resolved.attention_backend, resolved.moe_backend) == \
        ("cpu", "float32", "torch", "torch")
    assert resolved.cuda_graph is False
    with pytest.raises(UserError, match="need a CUDA device"):
        RunnerConfig.resolve(model_config("bfloat16"), graphs_by_default=True, model="m", cuda_graph=True)


def test_no_auto_reaches_a_frozen_config() -> None:
    with pytest.raises(UserError, match="device 'auto' must be resolved"):
        RunnerConfig(device="auto")
    with pytest.raises(UserError, match="cuda_graph must be true or false"):
        RunnerConfig(cuda_graph="auto")


def _generate_args(*argv: str):
    from deepseek_pd.cli import build_parser

    return build_parser().parse_args(["generate", "--input-ids", "1,2", *argv])


def test_generate_defaults_follow_the_machine(gpu_machine) -> None:
    from deepseek_pd.commands.generate import resolved_runner_config

    on_gpu = resolved_runner_config(_generate_args())
    assert (on_gpu.device, on_gpu.cuda_graph, on_gpu.attention_backend) == ("cuda", True, "triton")
    assert on_gpu.dtype == "float32"  # the tiny checkpoint's torch_dtype
    assert resolved_runner_config(_generate_args("--no-cuda-graph")).cuda_graph is False
    assert resolved_runner_config(_generate_args("--attention-backend", "torch")).cuda_graph is False
    on_cpu = resolved_runner_config(_generate_args("--device", "cpu"))
    assert (on_cpu.device, on_cpu.cuda_graph, on_cpu.attention_backend) == ("cpu", False, "torch")


def test_generate_on_a_cpu_machine(cpu_machine) -> None:
    from deepseek_pd.commands.generate import resolved_runner_config

    resolved = resolved_runner_config(_generate_args())
    assert (resolved.device, resolved.dtype, resolved.cuda_graph) == ("cpu", "float32", False)
    with pytest.raises(UserError, match="cuda_graph=true"):
        resolved_runner_config(_generate_args("--cuda-graph"))
