"""An FP8 GEMM backend's own error (bench/fp8_accuracy.py's (b): the backend against the exact product
of the same e4m3 activations and weights) is its bf16 output rounding, ~0.0017; a scale that is 1%
off or a transposed scale grid shows in it. The 1e-2 of issue 21 is too loose to see a 1% scale
error (it gives ~0.010), so these checks use 4e-3: twice the bf16 output rounding's 2^-9/sqrt(3)."""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.bench_scripts import bench_module

OWN_ERROR_BOUND = 4e-3


def _own_errors(monkeypatch, seed: int, scale_fault) -> list[float]:
    bench = bench_module("fp8_accuracy")
    real = bench.FP8_GEMM_BACKENDS.build

    def faulty(name):
        gemm = real(name)
        return lambda x, weight, scale, block_n, block_k: gemm(x, weight, scale_fault(scale), block_n, block_k)
    monkeypatch.setattr(bench.FP8_GEMM_BACKENDS, "build", faulty)
    rows = bench.gemm_rows(torch.device("cpu"), bench.TINY_SHAPES, 16, seed, ["torch"])
    return [row["backend_own"] for row in rows]


def test_the_torch_backend_is_within_its_output_rounding(monkeypatch) -> None:
    errors = _own_errors(monkeypatch, random.randrange(1 << 20), lambda scale: scale)
    assert max(errors) < OWN_ERROR_BOUND, errors


@pytest.mark.parametrize("fault", ["one percent", "transposed"])
def test_a_wrong_scale_shows_in_the_backends_own_error(monkeypatch, fault: str) -> None:
    def wrong(scale: torch.Tensor) -> torch.Tensor:
        if fault == "one percent":
            return scale * 1.01
        return scale.t().contiguous().reshape(scale.shape)  # the grid read in the other order
    errors = _own_errors(monkeypatch, random.randrange(1 << 20), wrong)
    assert min(errors) > OWN_ERROR_BOUND, errors
