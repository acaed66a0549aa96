"""Speculative decoding in `bench serving`'s report (deepseek_pd/loadgen/speculation.py): the figures
from the decode workers' own /metrics pages against what was observed into real `WorkerMetrics`, no
figure without speculation, and a whole run against a local cluster whose workers speculate, where
the emitted tokens must be every output token but each request's first (which prefill makes)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from deepseek_pd.loadgen.speculation import parse_totals, speculation_summary
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics

pytestmark = pytest.mark.timeout(300)


def _page(metrics: WorkerMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def _observe(rng: random.Random, metrics: WorkerMetrics, steps: int) -> tuple[int, int, list[int]]:
    drafted = accepted = 0
    lengths: list[int] = []
    for _ in range(steps):
        rows = [rng.randint(1, 4) for _ in range(rng.randint(1, 8))]  # accept lengths 1..k+1, k = 3
        metrics.observe_speculative(3 * len(rows), sum(r - 1 for r in rows), rows)
        drafted, accepted, lengths = drafted + 3 * len(rows), accepted + sum(r - 1 for r in rows), lengths + rows
    return drafted, accepted, lengths


def test_figures_are_the_differences_over_the_ranks():
    rng = random.Random()
    ranks = [WorkerMetrics() for _ in range(rng.randint(1, 3))]
    for metrics in ranks:  # before the run
        _observe(rng, metrics, rng.randint(0, 3))
    before = {f"r{i}": parse_totals(_page(m)) for i, m in enumerate(ranks)}
    seen = [_observe(rng, m, rng.randint(1, 5)) for m in ranks]
    after = {f"r{i}": parse_totals(_page(m)) for i, m in enumerate(ranks)}
    summary = speculation_summary(before, after)
    lengths = [n for _, _, rows in seen for n in rows]
    assert summary["drafted"] == sum(d for d, _, _ in seen) and summary["accepted"] == sum(a for _, a, _ in seen)
    assert summary["verify_rows"] == len(lengths) and summary["emitted"] == sum(lengths)
    assert summary["accept_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert summary["workers"] == len(ranks)
    # no verify over the run (no speculation, or an idle one): no figure rather than zeros
    assert speculation_summary(after, after) is None
    assert speculation_summary({}, {}) is None
    assert parse_totals("# nothing here\n") == {}


@pytest.mark.slow
def test_bench_serving_reports_the_workers_speculation(tmp_path: Path) -> None:
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model
    from pdtest.e2e_cluster import cluster_cli_flags

    path = make_tiny_model(tmp_path / "v3", seed=random.randrange(1000), mtp_layers=1)
    flags = cluster_cli_flags()
    flags[flags.index("--model") + 1] = str(path)
    out_json = tmp_path / "bench.json"
    num_prompts, output_len = 8, 7
    argv = [sys.executable, "-m", "deepseek_pd.cli", "bench", "serving", *flags,
            "--worker-arg=--speculative-num-steps=3", "--num-prompts", str(num_prompts), "--dataset", "fixed",
            "--input-len", "16", "--output-len", str(output_len), "--max-concurrency", "4", "--no-progress",
            "--output-json", str(out_json), "--output-png", str(tmp_path / "bench.png"),
            "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out_json.read_text())["summary"]
    spec = summary["speculative"]
    assert summary["completed"] == num_prompts and spec is not None, summary
    # every decode token came out of a verify row; the first of each request came from prefill
    assert spec["emitted"] == summary["total_output_tokens"] - num_prompts
    assert spec["verify_rows"] > 0 and spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["accept_length"] == pytest.approx(spec["emitted"] / spec["verify_rows"])
    assert "speculative decoding: accept length" in proc.stdout
    print(proc.stdout.splitlines()[-3:])
