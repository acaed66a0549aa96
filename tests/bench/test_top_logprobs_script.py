"""bench/top_logprobs.py runs unattended in one command and ends with its table (CPU, tiny shapes)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "top_logprobs.py"


def test_top_logprobs_bench_prints_one_row_per_batch_size_last() -> None:
    argv = [sys.executable, str(SCRIPT), "--device", "cpu", "--vocab", "300", "--batches", "1,4",
            "--steps", "2", "--warmup", "1", "--k", "5"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("sampling step ms"))
    assert "V=300, k=5" in lines[header]
    assert [line.split()[0] for line in lines[header + 2:]] == ["1", "4"]
