"""The benches that hold the prefill worker's forward against its runner's build the very configs the
serving benchmark runs (bench/serving_configs.py): the worker's as `serve prefill` resolves it from
serving_gpu.py's flags, the runner's as runner_steps.py builds it."""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest

from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
from deepseek_pd.model.config import ModelConfig
from pdtest.bench_scripts import bench_module

pytestmark = pytest.mark.timeout(60)


def _draw() -> tuple[int, int]:
    rng = random.Random()
    return rng.choice([16, 32, 64]), rng.randint(8, 64)  # page size, pages


def test_the_serving_worker_and_the_runner_bench_run_the_same_forward() -> None:
    configs = bench_module("serving_configs")
    _, pages = _draw()
    model_config = ModelConfig.from_hf(resolve_model_dir("tiny") / "config.json")
    worker = configs.worker_runner_config(Path("tiny"), "cpu", pages)
    runner = configs.runner_bench_config(Path("tiny"), "cpu", pages)
    assert configs.config_differences(runner, worker, model_config).keys() <= {
        "attention_backend", "moe_backend", "dispatcher", "fp8_backend", "norm_rope_backend"}  # "auto" vs resolved
    assert not configs.forwards_differ(configs.config_differences(runner, worker, model_config))
    assert worker.num_fused_shared_experts == model_config.n_shared_experts > 0  # serving_gpu.py fuses them
    assert worker.num_pages == runner.num_pages == pages


def test_prefill_step_ratio_runs_the_serving_workers_forward() -> None:
    """Before 2026-12-07 its runner had the "auto" backends and unfused shared experts."""
    configs, ratio = bench_module("serving_configs"), bench_module("prefill_step_ratio")
    page_size, pages = _draw()
    args = ratio.parse_args(["--tiny", "--page-size", str(page_size)])
    built = ratio.runner_config(args, "tiny", pages)
    model_config = ModelConfig.from_hf(resolve_model_dir("tiny") / "config.json")
    worker = configs.worker_runner_config(Path("tiny"), "cpu", pages)
    assert built.build_options(model_config) == worker.build_options(model_config)
    assert (built.page_size, built.num_pages, built.dtype) == (page_size, pages, args.dtype)
    assert not configs.forwards_differ(configs.config_differences(built, worker, model_config))
