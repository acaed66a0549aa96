"""Kernel backends that compile on first use (FlashInfer, DeepGEMM): compiled at start-up, or left
for what "auto" runs, with a warning that says why.

FlashInfer's MLA decode and DeepGEMM's FP8 GEMMs are JIT-compiled with nvcc the first time they
run. A worker that named one and cannot compile it (an image without nvcc, a GPU that is not
Hopper, a compiler error) would otherwise start, then fail its first request. So before the model
is built, in the process that runs it, `with_compiled_jit_backends` runs each named one's kernel
once (`compile_and_run_once`, which also moves the compile time from the first request to
start-up); where that raises, it logs the reason and sets the field to what "auto" resolves to
(`RunnerConfig.auto_choice`: the Triton kernels on CUDA). An "auto" field that picks one
(attention "auto" picks FlashMLA where it is built, else FlashInfer where it can win,
model/kernels/mla_decode_route.py) is named
first, so a library caller's "auto" is checked as a resolved one is.

    config = with_compiled_jit_backends(config, model_config)
    # attention_backend 'flashinfer' cannot run here (no nvcc ...); running 'triton' (what auto picks) instead
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.runner_config import RunnerConfig

log = logging.getLogger(__name__)


def _flashinfer(device: str) -> None:
    from deepseek_pd.model.kernels.flashinfer_mla import compile_and_run_once

    compile_and_run_once(device)


def _flashmla(device: str) -> None:
    # Not compiled on first use (built ahead: bench/flashmla_build.sh), but checked the same way: a
    # build for another torch or GPU, or a wrong result, must fall back at start-up, not at a request.
    # `flashmla_available` runs the check once per process (the backend's constructor asks it again).
    from deepseek_pd.model.kernels.flashmla_mla import flashmla_available, flashmla_blocker

    if not flashmla_available():
        raise RuntimeError(flashmla_blocker() or f"FlashMLA cannot run on {device}: it needs a Hopper GPU "
                           f"and must pass its start-up check (the reason is logged above)")


def _deep_gemm(device: str) -> None:
    from deepseek_pd.model.kernels.fp8_deep_gemm import compile_and_run_once

    compile_and_run_once(device)


@dataclass(frozen=True)
class JitBackend:
    """A backend name of a `RunnerConfig` field whose kernels compile on first use, and the check
    that compiles and runs them once on a device (raising where it cannot)."""

    field: str
    name: str
    compile_and_run_once: Callable[[str], None]


JIT_BACKENDS: tuple[JitBackend, ...] = (
    JitBackend("attention_backend", "flashmla", _flashmla),
    JitBackend("attention_backend", "flashinfer", _flashinfer),
    JitBackend("fp8_backend", "deep_gemm", _deep_gemm),
)


def with_compiled_jit_backends(config: RunnerConfig, model_config: ModelConfig,
                               backends: tuple[JitBackend, ...] = JIT_BACKENDS) -> RunnerConfig:
    """`config` with every JIT backend it names compiled and run once on its device, or replaced
    by the field's "auto" choice where that fails (logged as a warning with the reason)."""
    if config.attention_backend == "auto":
        picked = config.resolve_attention_backend(model_config)
        if any(b.field == "attention_backend" and b.name == picked for b in backends):
            config = replace(config, attention_backend=picked)
    for backend in backends:
        if getattr(config, backend.field) != backend.name:
            continue
        try:
            backend.compile_and_run_once(config.device)
        except Exception as exc:  # an import, device or compiler error: all mean "not here"
            fallback = config.auto_choice(backend.field, model_config)
            log.warning("%s %r cannot run here (%s: %s); running %r (what auto picks) instead",
                        backend.field, backend.name, type(exc).__name__, exc, fallback)
            config = replace(config, **{backend.field: fallback})
        else:
            log.info("%s %r: its kernels compiled and ran on %s", backend.field, backend.name, config.device)
    return config
