"""`deepseek-pd bench serving`: the metric definitions against a hand computation, and a whole run
against a local cluster (real router, real workers) that must write a valid JSON and a PNG."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from deepseek_pd.loadgen.metrics import SLO, RequestRecord, summarize
from deepseek_pd.loadgen.workload import WorkloadSpec, build_requests

pytestmark = pytest.mark.timeout(240)


def random_records(rng: random.Random, n: int) -> list[RequestRecord]:
    records = []
    for _ in range(n):
        out = rng.randint(1, 30)
        ttft = rng.uniform(0.001, 0.5)
        itls = [rng.uniform(0.001, 0.05) for _ in range(out - 1)]
        records.append(RequestRecord(prompt_len=rng.randint(1, 100), expected_output_len=out,
                                     success=rng.random() > 0.1, output_len=out, ttft=ttft,
                                     latency=ttft + sum(itls), itls=itls))
    return records


def nearest_rank_bounds(values: list[float], p: float) -> tuple[float, float]:
    """Linear-interpolated percentile lies between these two order statistics."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100
    return ordered[int(pos)], ordered[min(int(pos) + 1, len(ordered) - 1)]


def test_summary_matches_hand_computation() -> None:
    rng = random.Random()
    records = random_records(rng, 200)
    duration = rng.uniform(1, 10)
    slo = SLO(ttft_ms=250.0, tpot_ms=30.0)
    summary = summarize(records, duration, slo)
    done = [r for r in records if r.success]
    assert summary["completed"] == len(done) and summary["failed"] == len(records) - len(done)
    assert summary["output_throughput"] == pytest.approx(sum(r.output_len for r in done) / duration)
    good = 0
    for r in done:
        tpot = (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None
        good += r.ttft * 1e3 <= 250.0 and (tpot is None or tpot * 1e3 <= 30.0)
    assert summary["goodput"] == pytest.approx(good / duration)
    ttfts_ms = [r.ttft * 1e3 for r in done]
    for p in (50, 90, 99):
        low, high = nearest_rank_bounds(ttfts_ms, p)
        assert low - 1e-9 <= summary["ttft_ms"][f"p{p}"] <= high + 1e-9
    tpots_ms = [(r.latency - r.ttft) / (r.output_len - 1) * 1e3 for r in done if r.output_len > 1]
    assert summary["tpot_ms"]["mean"] == pytest.approx(sum(tpots_ms) / len(tpots_ms))


def test_workload_lengths_and_determinism() -> None:
    spec = WorkloadSpec(num_prompts=50, dataset="random", input_len=40, output_len=10, range_ratio=0.5,
                        seed=random.randrange(1000))
    requests = build_requests(spec, vocab_size=300)
    assert requests == build_requests(spec, vocab_size=300)
    assert all(20 <= len(r.input_ids) <= 40 and 5 <= r.output_len <= 10 for r in requests)
    assert all(3 <= t < 300 for r in requests for t in r.input_ids)
    fixed = build_requests(WorkloadSpec(num_prompts=5, dataset="fixed", input_len=7, output_len=3), 300)
    assert {(len(r.input_ids), r.output_len) for r in fixed} == {(7, 3)}
    # Outputs pinned, prompts still random (the GPU serving bench: 512..1024 in, exactly 128 out).
    out_len = random.randint(2, 50)
    pinned = build_requests(WorkloadSpec(num_prompts=60, input_len=64, output_len=out_len, range_ratio=0.5,
                                         output_range_ratio=0.0, seed=random.randrange(1000)), 300)
    assert {r.output_len for r in pinned} == {out_len}
    assert len({len(r.input_ids) for r in pinned}) > 1 and all(32 <= len(r.input_ids) <= 64 for r in pinned)


@pytest.mark.slow
@pytest.mark.parametrize("direct", [False, True], ids=["router", "direct-pd"])
def test_bench_serving_against_local_cluster(tmp_path: Path, direct: bool) -> None:
    from pdtest.e2e_cluster import cluster_cli_flags

    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    num_prompts, input_len, output_len = 12, 24, 6
    argv = [sys.executable, "-m", "deepseek_pd.cli", "bench", "serving", *cluster_cli_flags(),
            "--num-prompts", str(num_prompts), "--dataset", "fixed", "--input-len", str(input_len),
            "--output-len", str(output_len), "--request-rate", "20", "--max-concurrency", "8",
            "--slo-ttft-ms", "60000", "--output-json", str(out_json), "--output-png", str(out_png),
            "--log-dir", str(tmp_path / "logs")] + (["--direct"] if direct else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TTFT" in proc.stdout.upper() and "requests" in proc.stderr  # summary + progress bar
    result = json.loads(out_json.read_text())
    summary = result["summary"]
    assert summary["completed"] == num_prompts and summary["failed"] == 0
    assert summary["total_output_tokens"] == num_prompts * output_len  # ignore_eos: exact lengths
    assert summary["total_input_tokens"] == num_prompts * input_len
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        stats = summary[name]
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"]
    assert summary["goodput"] > 0
    assert result["config"]["direct"] is direct
    assert len(result["requests"]) == num_prompts
    assert all(r["output_len"] == output_len for r in result["requests"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(out_png).shape[0] > 100


def test_sse_parser_survives_arbitrary_read_boundaries() -> None:
    import asyncio

    from deepseek_pd.client.sse import parse_sse_json

    rng = random.Random()
    events = [{"text": "".join(rng.choice("ab\u00e9\u4e2d ") for _ in range(rng.randint(0, 9))),
               "output_ids": [rng.randrange(500) for _ in range(rng.randint(0, 3))]} for _ in range(30)]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events)
    body = (": keep-alive comment\n\n" + body + "data: [DONE]\n\ndata: {\"after\": \"done\"}\n\n").encode()
    cuts = sorted(rng.sample(range(1, len(body)), 40))
    pieces = [body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)])]

    async def feed():
        for piece in pieces:
            yield piece

    async def collect():
        return [event async for event in parse_sse_json(feed())]

    assert asyncio.run(collect()) == events
