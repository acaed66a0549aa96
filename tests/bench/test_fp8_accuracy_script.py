"""bench/fp8_accuracy.py: its GEMM part splits an FP8 GEMM's error into the activation rounding and
the backend's own, and catches a backend that applies a scale to the wrong block; its model part
trains, quantises and compares a tiny model end to end (a smoke run: the figures are the bench's)."""
from __future__ import annotations

import random

import torch

from pdtest.bench_scripts import bench_module


def test_the_gemm_part_separates_rounding_from_the_backend_and_catches_a_misplaced_scale(monkeypatch) -> None:
    bench = bench_module("fp8_accuracy")
    seed = random.randrange(1 << 20)
    rows = bench.gemm_rows(torch.device("cpu"), bench.TINY_SHAPES, 16, seed, ["torch"])
    assert len(rows) == len(bench.TINY_SHAPES)
    for row in rows:
        # e4m3's own rounding: a few percent of the product, never zero, never order 1.
        assert 0.003 < row["activation_rounding"] < 0.06, row
        assert row["backend_own"] < 5e-3, row  # the torch reference: its bf16 output rounding only
        assert abs(row["total"] - row["activation_rounding"]) < 5e-3, row
    real = bench.FP8_GEMM_BACKENDS.build

    def misplaced(name):  # each row block's scale taken from the next row block
        gemm = real(name)
        return lambda x, weight, scale, block_n, block_k: gemm(x, weight, scale.roll(1, dims=0), block_n, block_k)
    monkeypatch.setattr(bench.FP8_GEMM_BACKENDS, "build", misplaced)
    wrong = bench.gemm_rows(torch.device("cpu"), bench.TINY_SHAPES, 16, seed, ["torch"])
    assert max(row["backend_own"] for row in wrong) > 0.05, wrong


def test_the_model_part_trains_quantises_and_compares_end_to_end(tmp_path) -> None:
    bench = bench_module("fp8_accuracy")
    result = bench.main(["--device", "cpu", "--tiny", "--parts", "model", "--train-steps", "20", "--prefixes", "6",
                         "--out", str(tmp_path / "fp8.json")])
    random_row, trained_row = result["model"]
    assert random_row["train_steps"] == 0 < trained_row["train_steps"]
    assert trained_row["train_loss"] < 2 * bench.math.log(96)  # it trained (uniform guessing: log V)
    for row in result["model"]:
        assert row["positions"] == 6 and 0.0 <= row["top1_agreement"] <= 1.0
        assert 0.0 < row["logits_rel_error_p50"] < 1.0  # kept FP8 differs from its twin, not wildly
    assert (tmp_path / "fp8.json").exists() and result["checks"][-1]["result"] in ("PASS", "MISS")
