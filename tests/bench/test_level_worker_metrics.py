"""bench/worker_metrics.py reads back what the workers' own metrics recorded between two scrapes.

The oracle is a real `WorkerMetrics` fed random observations: the breakdown's means are those of
the observations made between the scrapes, whatever was observed before."""
from __future__ import annotations

import random
import statistics

import pytest
from prometheus_client import generate_latest

from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from pdtest.bench_scripts import bench_module

worker_metrics = bench_module("worker_metrics")


def _observe(metrics: WorkerMetrics, rng: random.Random, n: int) -> dict[str, list[float]]:
    seen: dict[str, list[float]] = {"prefill": [], "decode": [], "ttft": [], "kv": [], "tokens": [], "rows": [],
                                    "gc": [], "gc2": []}
    for _ in range(n):
        for _ in range(rng.randrange(0, 4)):
            generation, pause = rng.randrange(3), rng.uniform(0, 0.3)
            metrics.observe_gc_pause(generation, pause)
            seen["gc"].append(pause)
            if generation == 2:
                seen["gc2"].append(pause)
        prefill, decode = rng.uniform(0.01, 0.2), rng.uniform(0.001, 0.02)
        tokens, rows = rng.randrange(1, 9000), rng.randrange(1, 9)
        metrics.observe_step("prefill", prefill, rows, tokens)
        metrics.observe_step("decode", decode, rng.randrange(1, 64), rng.randrange(1, 64))
        ttft, kv = rng.uniform(0.01, 1), rng.uniform(0.001, 0.5)
        metrics.observe_request("length", 10, 3, 0, ttft, ttft + 0.5)
        metrics.observe_kv_transfer("grpc", 1000, kv)
        for key, value in (("prefill", prefill), ("decode", decode), ("ttft", ttft), ("kv", kv),
                           ("tokens", tokens), ("rows", rows)):
            seen[key].append(value)
    return seen


def test_breakdown_is_the_mean_of_what_happened_between_the_scrapes():
    rng = random.Random()
    metrics = WorkerMetrics()
    _observe(metrics, rng, rng.randrange(0, 5))
    before = {"prefill-0": worker_metrics.parse(generate_latest(metrics.registry).decode())}
    seen = _observe(metrics, rng, rng.randrange(1, 20))
    after = {"prefill-0": worker_metrics.parse(generate_latest(metrics.registry).decode())}
    row = worker_metrics.breakdown(before, after)["prefill-0"]
    assert row["prefill_step_ms"] == pytest.approx(statistics.mean(seen["prefill"]) * 1e3)
    assert row["decode_step_ms"] == pytest.approx(statistics.mean(seen["decode"]) * 1e3)
    assert row["ttft_ms"] == pytest.approx(statistics.mean(seen["ttft"]) * 1e3)
    assert row["kv_ms"] == pytest.approx(statistics.mean(seen["kv"]) * 1e3)
    assert row["prefill_tokens_per_step"] == pytest.approx(statistics.mean(seen["tokens"]))
    assert row["prefill_rows_per_step"] == pytest.approx(statistics.mean(seen["rows"]))
    assert row["prefill_step_count"] == len(seen["prefill"])
    if seen["gc"]:
        assert row["gc_count"] == len(seen["gc"]) and row["gc_total_ms"] == pytest.approx(sum(seen["gc"]) * 1e3)
        assert "GC" in worker_metrics.describe({"prefill-0": row})
    if seen["gc2"]:
        assert row["gc2_count"] == len(seen["gc2"])
        assert row["gc2_ms"] == pytest.approx(statistics.mean(seen["gc2"]) * 1e3)
    assert "prefill-0: ttft" in worker_metrics.describe({"prefill-0": row})


def test_metrics_urls_are_the_workers_latest_starts(tmp_path):
    urls = {f"{role}-{rank}": f"http://127.0.0.1:{random.randrange(1024, 65535)}/metrics"
            for role in ("prefill", "decode") for rank in range(random.randrange(1, 3))}
    for name, url in urls.items():
        (tmp_path / f"{name}.log").write_text(f"x Prometheus metrics on http://127.0.0.1:1/metrics\n"
                                              f"restarted\nx Prometheus metrics on {url}\n")
    (tmp_path / "up.log").write_text("prefill-0 | Prometheus metrics on http://127.0.0.1:2/metrics\n")
    assert worker_metrics.metrics_urls(tmp_path) == urls


def test_round_phases_add_up_to_the_step_mean_and_the_p50_falls_in_the_median_bucket():
    """The phases' means per round over the scrapes' interval, and the step's p50 from its buckets:
    in the bucket of the observed median, which a few slow rounds move no further (the mean goes)."""
    from deepseek_pd.workers.engine.round_clock import PHASES
    from deepseek_pd.workers.metrics.worker_metrics import REQUEST_PHASES, STEP_BUCKETS

    rng = random.Random()
    metrics = WorkerMetrics()
    metrics.observe_round_phases({"launch": rng.uniform(0.01, 0.1)})  # before the first scrape: not counted
    metrics.observe_step("prefill", 0.05, 1, 1)
    metrics.observe_request_phases({"handshake": 1.0})
    before = {"prefill-0": worker_metrics.parse(generate_latest(metrics.registry).decode())}
    steps, sums = [], {phase: 0.0 for phase in PHASES}
    requests = {phase: [] for phase in REQUEST_PHASES}
    for _ in range(rng.randrange(5, 40)):
        phases = {phase: rng.uniform(0, 0.01) for phase in rng.sample(PHASES, rng.randrange(1, len(PHASES)))}
        if rng.random() < 0.1:  # a slow one (a kernel first loaded mid-run)
            phases["launch"] = phases.get("launch", 0.0) + rng.uniform(0.5, 1.5)
        metrics.observe_round_phases(phases)
        steps.append(sum(phases.values()))
        metrics.observe_step("prefill", steps[-1], 1, 100)
        for phase, seconds in phases.items():
            sums[phase] += seconds
        request = {phase: rng.uniform(0, 0.2) for phase in REQUEST_PHASES}
        metrics.observe_request_phases(request)
        for phase, seconds in request.items():
            requests[phase].append(seconds)
    after = {"prefill-0": worker_metrics.parse(generate_latest(metrics.registry).decode())}
    row = worker_metrics.breakdown(before, after)["prefill-0"]
    means = {phase: total / len(steps) * 1e3 for phase, total in sums.items() if total > 0}
    assert row["prefill_phases_ms"] == pytest.approx(means)
    assert row["prefill_unattributed_ms"] == pytest.approx(0.0, abs=1e-6)
    assert row["prefill_request_phases_ms"] == pytest.approx(
        {phase: statistics.mean(values) * 1e3 for phase, values in requests.items()})
    bounds = (0.0, *STEP_BUCKETS, float("inf"))

    def bucket(seconds: float) -> int:
        return next(i for i in range(1, len(bounds)) if seconds <= bounds[i])

    median = statistics.median_low(steps)  # (the interpolation ranks q * n: the lower middle of an even count)
    assert bucket(row["prefill_step_p50_ms"] / 1e3) == bucket(median), (row["prefill_step_p50_ms"], sorted(steps))
    text = worker_metrics.describe({"prefill-0": row})
    assert "prefill step p50" in text and "prefill round (means)" in text and "unattributed" in text
    assert "prefill request (means): handshake" in text
