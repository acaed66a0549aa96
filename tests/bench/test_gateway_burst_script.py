"""`bench/gateway_burst.py`: its helpers, and a bounded burst through `up` and the real gateway.

The bounded run (one policy, 24 streams, two bursts) checks the script against what it must count:
every stream is counted exactly once, the tally in the JSON equals the printed table, and on a
healthy cluster every stream completes, the router stays live and the pools drain.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdtest.bench_scripts import bench_module

REPO = Path(__file__).resolve().parents[2]


def test_percentile_matches_the_sorted_rank() -> None:
    burst = bench_module("gateway_burst")
    rng = random.Random()
    values = [rng.random() for _ in range(rng.randint(1, 300))]
    ordered = sorted(values)
    assert burst.percentile(values, 0) == ordered[0] and burst.percentile(values, 100) == ordered[-1]
    assert burst.percentile(values, 50) == ordered[round(0.5 * (len(values) - 1))]
    assert burst.percentile([], 50) is None


def test_prompts_share_prefixes_and_respect_the_length_range() -> None:
    burst = bench_module("gateway_burst")
    rng = random.Random()
    low = rng.randint(4, 20)
    config = burst.BurstConfig(streams=rng.randint(50, 200), prompt_len=(low, low + rng.randint(0, 40)), prefixes=4)
    prompts = burst.burst_prompts(config, vocab=400, rng=rng)
    assert len(prompts) == config.streams
    assert all(1 <= len(p) for p in prompts) and all(3 <= t < 400 for p in prompts for t in p)
    heads = {tuple(p[:low // 2]) for p in prompts}
    assert len(heads) <= config.prefixes  # cache_aware's tree gets shared branches


def test_help_and_bad_arguments() -> None:
    script = str(REPO / "bench" / "gateway_burst.py")
    ok = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--streams" in ok.stdout and "cache_aware" in ok.stdout
    bad = subprocess.run([sys.executable, script, "--policies", "fastest"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "fastest" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bounded_burst_through_up(tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    argv = [sys.executable, str(REPO / "bench" / "gateway_burst.py"), "--streams", "24", "--bursts", "2",
            "--policies", "round_robin", "--decode", "1", "--hang-after-s", "120", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["streams"] == 48 == row["completed"] + row["failed"] + row["hung"]
    assert row["completed"] == 48 and row["router_live"] and row["pools_drained"]
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    table = proc.stdout.strip().splitlines()
    assert table[-1].startswith("| round_robin | 48 | 48 | 0 | 0 |"), table
