"""bench/mooncake_gpu.py on a GPU with a CUDA build of Mooncake (bench/mooncake_gpu_session.sh installs
`mooncake-transfer-engine-cuda13`): tiny shapes, GPU pool to GPU pool over TCP, every repeat bit for
bit, the check computed from the recorded seconds and the card named. Inside `unshare -n` where the
machine allows it, else on its loopback (the lent GPU machines reach nothing and nothing reaches
them). The CPU path is test_mooncake_gpu_script.py."""
from __future__ import annotations

import importlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepseek_pd.workers.transport.mooncake_build import imported_build
from pdtest.bench_scripts import bench_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "mooncake_gpu.py"


def test_gpu_pool_to_gpu_pool_over_mooncake_tcp_is_exact_and_checked(tmp_path) -> None:
    try:
        build = imported_build(importlib.import_module("mooncake.engine"))
    except (ImportError, OSError) as exc:
        pytest.skip(f"mooncake is not importable: {exc}")
    if not build.moves_cuda_memory_over_tcp:
        pytest.skip(f"{build} does not move GPU memory over TCP (bench/mooncake_gpu_session.sh installs one that does)")
    rng = random.Random()
    repeats = rng.randint(2, 3)
    argv = [sys.executable, str(SCRIPT), "--device", "cuda", "--tiny", "--repeats", str(repeats),
            "--seed", str(rng.randrange(1 << 30)), "--out", str(tmp_path)]
    if bench_module("target_parts").netns_problem() is None:
        argv.append("--netns")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    exact = [line for line in proc.stdout.splitlines() if line.startswith("repeat ") and ", exact; raw " in line]
    assert len(exact) == repeats, proc.stdout[-4000:]
    result = json.loads((tmp_path / "mooncake_gpu.json").read_text())
    run = result["kv_transfer"]["runs"][0]
    assert result["check"]["value"] == pytest.approx(min(run["raw_seconds"]) / min(run["seconds"]))
    assert result["card"] == torch.cuda.get_device_name() and result["mooncake"] == str(build)
    assert "cuda pool -> pool" in result["check"]["check"]
