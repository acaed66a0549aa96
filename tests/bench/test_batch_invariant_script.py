"""bench/batch_invariant_gpu.py runs end to end (`--tiny`: the CPU through Triton's interpreter),
so the GPU call that measures --deterministic's cost does not fail on the script itself."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdtest.triton_env import needs_triton  # the interpreter must run here (numpy < 2.4)

REPO = Path(__file__).resolve().parents[2]


@needs_triton
@pytest.mark.timeout(300)
def test_the_script_times_every_kernel_and_finds_them_invariant(tmp_path: Path) -> None:
    out = tmp_path / "bi.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "batch_invariant_gpu.py"), "--tiny",
                           "--out", str(out)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {row["part"] for row in rows} == {"gemm", "moe", "mla"}
    assert all(row["inv"] for row in rows) and all(row["inv_ms"] > 0 and row["base_ms"] > 0 for row in rows)
    assert "cost" in proc.stdout.splitlines()[1]
