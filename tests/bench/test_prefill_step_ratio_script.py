"""bench/prefill_step_ratio.py on the CPU: one run gives the worker's step, the runner alone beside
each request, their ratio and the split, consistently (the GPU run uses the same code)."""
from __future__ import annotations

import json
import random
import statistics

import pytest

from pdtest.bench_scripts import bench_module

pytestmark = pytest.mark.timeout(300)


def test_one_run_reports_the_ratio_of_paired_steps(tmp_path) -> None:
    bench = bench_module("prefill_step_ratio")
    rng = random.Random()
    repeats, tokens = rng.randint(2, 3), rng.randint(8, 40)
    out = tmp_path / "step.json"
    both = rng.random() < 0.5
    result = bench.main(["--tiny", "--repeats", str(repeats), "--tokens", str(tokens), "--layerwise",
                         rng.choice(["on", "off"]), "--json", str(out), "--trace", str(tmp_path / "trace"),
                         *(["--also-without-inference-mode"] if both else [])])
    assert ("without_inference_mode" in result) == both
    if both:
        assert {len(values) for values in result["without_inference_mode"]["seconds"].values()} == {repeats}
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    seconds = result["seconds"]
    assert {len(values) for values in seconds.values()} == {repeats}, seconds
    for step, thread, forward in zip(seconds["step"], seconds["model_thread"], seconds["forward"]):
        assert 0 < forward <= thread <= step
    assert result["ratio"] == pytest.approx(statistics.median(s / a for s, a in zip(seconds["step"], seconds["alone"])))
    assert result["check"]["value"] == result["ratio"] and result["check"]["result"] in ("PASS", "MISS")
    assert result["tokens"] == tokens and result["inference_mode"]
    # The trace holds the model thread's forward ops, not only the event loop's.
    assert (tmp_path / "trace" / "prefill_step_trace.json.gz").stat().st_size > 0
    assert "aten::mm" in (tmp_path / "trace" / "prefill_step_ops.txt").read_text()
    # Each traced window's split (bench/step_attribution.py): the round holds its extend and first
    # token, in the model thread; on the CPU no device time and no CUDA call.
    split = json.loads((tmp_path / "trace" / "prefill_step_attribution.json").read_text())
    assert set(split) == {"pd::runner_alone", "pd::worker_round", "pd::extend", "pd::first_token"}
    assert {row["windows"] for row in split.values()} == {min(repeats, 3) * (2 if both else 1)}  # pairs traced, per mode
    assert split["pd::worker_round"]["ms"] >= split["pd::extend"]["ms"] > 0
    assert all(row["gpu_busy_ms"] == row["syncs"] == row["launches"] == 0 for row in split.values())
    # The worker's own metrics over the same rounds, as a serving run scrapes them: the round's phases
    # (workers/engine/round_clock.py) add up to the mean of the steps the bench timed itself.
    worker = result["worker_metrics"]["prefill-0"]
    steps = seconds["step"] + (result["without_inference_mode"]["seconds"]["step"] if both else [])
    assert worker["prefill_step_count"] == len(steps)
    assert worker["prefill_step_ms"] == pytest.approx(statistics.mean(steps) * 1e3)
    assert sum(worker["prefill_phases_ms"].values()) == pytest.approx(worker["prefill_step_ms"], abs=0.05)
    assert worker["prefill_phases_ms"]["launch"] > 0 and "prefill_step_p50_ms" in worker
