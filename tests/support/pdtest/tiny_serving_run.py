"""One `bench/serving_gpu.py --tiny` run with every part, shared by the tests that read its report.

The checkpoint, the runner alone, the transfer parts, `up`, the mixed levels and the loads apart
take about a minute on CPU together; run once per part set, they took twice that (each wrote its
own checkpoint and started its own runner and `up`). `tiny_serving_run` (tests/bench/conftest.py)
runs them once per session for test_serving_gpu_script.py, test_solo_levels_script.py and
test_targets_table.py, each checking its own part of the one report. What a run with parts left
out reports is tests/bench/test_serving_gpu_parts.py, on the script's functions, without a run.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pdtest.bench_scripts import BENCH_DIR, bench_module

RUN_TIMEOUT_S = 450  # under the 480 s pytest timeout of the first test that asks for the run


@dataclass(frozen=True)
class TinyServingRun:
    out: Path  # serving_gpu.py --out
    model_dir: Path  # the run's own checkpoint
    returncode: int
    stdout: str
    stderr: str

    def result(self) -> dict:
        """serving_gpu.json, once the run is known to have succeeded (its output's tail if not)."""
        assert self.returncode == 0, self.stdout[-3000:] + self.stderr[-3000:]
        return json.loads((self.out / "serving_gpu.json").read_text())

    @property
    def lines(self) -> list[str]:
        """What the script printed, line by line (its tables come last)."""
        return self.stdout.strip().splitlines()


def run_tiny_serving(root: Path) -> TinyServingRun:
    """`serving_gpu.py --tiny --profile` with every part it knows, under `root`."""
    parts = ",".join(bench_module("serving_gpu").PARTS)
    out, model_dir = root / "out", root / "model"
    argv = [sys.executable, str(BENCH_DIR / "serving_gpu.py"), "--tiny", "--out", str(out),
            "--model-dir", str(model_dir), "--profile", "--parts", parts]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return TinyServingRun(out, model_dir, proc.returncode, proc.stdout, proc.stderr)
