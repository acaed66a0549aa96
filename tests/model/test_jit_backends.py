"""A named JIT backend (FlashInfer, DeepGEMM) that cannot compile at start-up: the runner logs why
and runs what "auto" picks, with the same outputs as a runner that named that in the first place.

On the CPU both checks fail for real (no CUDA device, no library); the compiler failure itself is
simulated by a check that raises what a failed nvcc run raises.
"""
from __future__ import annotations

import logging
import random
import subprocess
from dataclasses import replace

import pytest
import torch

# First: the DeepGEMM check imports the Triton quantisation kernel, which must see TRITON_INTERPRET.
from pdtest.triton_env import DEVICE  # noqa: F401,E402

from deepseek_pd.model import jit_backends  # noqa: E402
from deepseek_pd.model.checkpoint.tiny import make_tiny_model, tiny_config
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.jit_backends import JIT_BACKENDS, JitBackend, with_compiled_jit_backends
from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig


def _logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    pages = list(range(-(-len(prompt) // runner.config.page_size)))
    return runner.extend([ExtendSeq(prompt, 0, pages)])


# FlashMLA is checked only where "auto" picked it (tests/model/kernels/test_mla_decode_route.py): a
# named "flashmla" that cannot run is refused before the runner is built, not fallen back from.
NAMED_FALLBACKS = [(b.field, b.name) for b in JIT_BACKENDS if b.name != "flashmla"]


@pytest.mark.parametrize("field,name", NAMED_FALLBACKS)
def test_a_jit_backend_that_cannot_run_here_falls_back_to_auto_with_the_same_outputs(tmp_path, caplog, field, name):
    fp8 = field == "fp8_backend"
    directory = make_tiny_model(tmp_path / "model", arch=random.choice(["v2", "v3"]), seed=random.randint(0, 10_000),
                                fp8_block=(128, 128) if fp8 else None)
    prompt = [random.randrange(1, 100) for _ in range(random.randint(3, 20))]
    with caplog.at_level(logging.WARNING, logger=jit_backends.__name__):
        named = ModelRunner(RunnerConfig(model=str(directory), num_pages=16, **{field: name}))
    assert getattr(named.config, field) == ("dequant" if fp8 else "torch")  # "auto" on the CPU
    (record,) = [r for r in caplog.records if r.name == jit_backends.__name__]
    assert record.levelno == logging.WARNING and name in record.getMessage() and "cannot run here" in record.getMessage()
    auto = ModelRunner(RunnerConfig(model=str(directory), num_pages=16))
    torch.testing.assert_close(_logits(named, prompt), _logits(auto, prompt), rtol=0, atol=0)


def _nvcc_fails(device: str) -> None:
    raise subprocess.CalledProcessError(2, ["nvcc", "-arch=sm_90a", "batch_mla.cu"],
                                        stderr="nvcc fatal: Unsupported gpu architecture 'compute_90a'")


@pytest.mark.parametrize("field,name", NAMED_FALLBACKS)
def test_a_compiler_failure_at_start_up_is_logged_with_its_reason(caplog, field, name):
    model_config = ModelConfig.from_hf({**tiny_config("v3", 512), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    config = RunnerConfig(**{field: name})
    failing = (JitBackend(field, name, _nvcc_fails),)
    with caplog.at_level(logging.WARNING, logger=jit_backends.__name__):
        fallen = with_compiled_jit_backends(config, model_config, failing)
    assert getattr(fallen, field) == config.auto_choice(field, model_config)
    assert "CalledProcessError" in caplog.text and "batch_mla.cu" in caplog.text and repr(name) in caplog.text
    # Everything else is as it was; a check that passes keeps the name, and says so at INFO.
    assert fallen == replace(config, **{field: getattr(fallen, field)})
    compiled: list[str] = []
    kept = with_compiled_jit_backends(config, model_config, (JitBackend(field, name, compiled.append),))
    assert kept == config and compiled == [config.device]


def _flashinfer_here() -> bool:
    from deepseek_pd.model.kernels.flashinfer_mla import flashinfer_mla_available

    return flashinfer_mla_available()


def _deep_gemm_here() -> bool:
    from deepseek_pd.model.kernels.fp8_deep_gemm import deep_gemm_available

    return deep_gemm_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _flashinfer_here(), reason="needs FlashInfer, nvcc and a Hopper GPU")
def test_flashinfer_compiles_and_runs_at_start_up_on_a_hopper_gpu(caplog):
    """Where FlashInfer is usable the check passes (its kernel compiled, ~20 s the first time) and
    the backend stays."""
    from deepseek_pd.model.kernels.flashinfer_mla import compile_and_run_once

    compile_and_run_once("cuda")
    config = RunnerConfig(device="cuda", attention_backend="flashinfer")
    model_config = ModelConfig.from_hf(tiny_config("v3", 512))
    assert with_compiled_jit_backends(config, model_config) == config


@pytest.mark.gpu
@pytest.mark.skipif(not _deep_gemm_here(), reason="needs DeepGEMM built for this torch and a Hopper GPU")
def test_deep_gemm_compiles_and_runs_at_start_up_on_a_hopper_gpu():
    from deepseek_pd.model.kernels.fp8_deep_gemm import compile_and_run_once

    compile_and_run_once("cuda")  # raises where nvcc, its headers or the product fail
