"""bench/kv_transfer.py runs unattended in one command and ends with its summary table: here on
the CPU with tiny shapes, prefill in a child process (split mode, which needs both processes to
share the deployment secret), one and two KV streams per room, every repeat checked bit for bit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kv_transfer.py"


def test_kv_transfer_bench_prints_one_row_per_stream_count_last() -> None:
    argv = [sys.executable, str(SCRIPT), "--tokens", "300", "--layers", "3", "--kv-dim", "40", "--page-size", "4",
            "--chunk-mb", "0.01", "--repeats", "2", "--streams", "1,2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert sum(1 for line in lines if line.startswith("repeat ") and ", exact" in line) == 4  # 2 repeats x 2 runs
    header = next(i for i, line in enumerate(lines) if line.startswith("KV transfer summary:"))
    assert "grpc on cpu, prefill and decode in two processes" in lines[header]
    assert len(lines) - header == 7  # header, column names, rule, 2 of ours, 2 ceilings: the table is last
    rows = {row.split("|")[1].strip(): row for row in lines if row.startswith("| ours,") or row.startswith("| raw")}
    assert {"ours, 1 stream(s)", "ours, 2 stream(s)", "raw gRPC, 1 connection(s)", "raw gRPC, 2 connection(s)"} <= set(rows)
    assert lines[-1].startswith("| raw gRPC, 2 connection(s)")
