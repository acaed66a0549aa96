"""GPU: `up` with no memory flags starts the V2-Lite shape (random bf16 weights, the tiny tokenizer's
vocabulary) on one card, 1 prefill + 1 decode, each worker holding its own copy of the weights, and
reports each worker's KV capacity in tokens. On an 80 GB card this failed before model/kv/memory_budget.py
(prefill's budget 0.352 x 79.2 GiB = 27.9 GiB was below its 28.5 GiB of weights).

Run on the GPU machine: `python -m pytest -q -s tests/launcher/test_up_gpu_memory.py` (about 2 min:
the checkpoint is written on the GPU, then both workers load it)."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from deepseek_pd.units import GIB
from pdtest.bench_scripts import bench_module

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_up_starts_v2_lite_with_default_memory_flags(tmp_path, caplog) -> None:
    from deepseek_pd.launcher.cluster import ClusterSpec, LocalCluster

    checkpoints = bench_module("random_checkpoint")
    model = checkpoints.write_random_checkpoint(tmp_path / "v2-lite", checkpoints.v2_lite_config(), device="cuda")
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    spec = ClusterSpec(model=str(model), device="cuda", log_dir=tmp_path / "logs", startup_timeout_s=600)
    with caplog.at_level(logging.INFO, logger="deepseek_pd.launcher.cluster"), LocalCluster(spec):
        pass
    line = next(r.getMessage() for r in caplog.records if "KV capacity" in r.getMessage())
    tokens = {name: int(count.replace(",", "")) for name, count in re.findall(r"(\w+-\d+) ([\d,]+) tokens", line)}
    print(f"{torch.cuda.get_device_name()} ({total / GIB:.1f} GiB): {line}")
    assert set(tokens) == {"prefill-0", "decode-0"} and all(t > 0 for t in tokens.values()), line
    # The KV room is split 2:3 (whole pages; both reserves are 2 GiB + the same weights by default).
    assert tokens["decode-0"] / tokens["prefill-0"] == pytest.approx(1.5, rel=0.01), line
