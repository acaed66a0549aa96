"""The one-GPU serving ceiling (`bench/serving_report.ceilings`) and the runner's prefill round it
is computed from (`bench/runner_steps.round_lengths`, `bench/serving_gpu.prefill_round_tokens`),
against formulas recomputed here from fresh random figures."""
from __future__ import annotations

import random

import pytest

from pdtest.bench_scripts import bench_module


def _random_levels(rng: random.Random) -> tuple[list[dict], dict]:
    levels = []
    for c in (1, 16, 64, 128):
        out = rng.uniform(50, 9000)
        levels.append({"concurrency": c, "output_tok_s": out, "input_tok_s": out * rng.uniform(1, 20)})
    runner = {"decode": [{"batch": c, "step_ms": rng.uniform(3, 30)} for c in (1, 64, 128)],
              "prefill_round": {"tok_s": rng.uniform(5e3, 2e5)}}
    return levels, runner


def test_each_level_gets_the_output_rate_at_which_prefill_and_decode_fill_the_gpu() -> None:
    report = bench_module("serving_report")
    rng = random.Random()
    levels, runner = _random_levels(rng)
    caps = report.ceilings(levels, runner)
    steps = {d["batch"]: d["step_ms"] for d in runner["decode"]}
    assert [cap["concurrency"] for cap in caps] == [1, 64, 128]  # no runner step at batch 16
    for cap in caps:
        row = next(r for r in levels if r["concurrency"] == cap["concurrency"])
        x = cap["ceiling_tok_s"]
        # At the ceiling, computing the prompts and decoding the tokens of x output tok/s take the
        # whole GPU: prompt tokens at the prefill round's rate, decode steps of c tokens each.
        gpu_s = (x * row["input_tok_s"] / row["output_tok_s"] / runner["prefill_round"]["tok_s"]
                 + x / cap["concurrency"] * steps[cap["concurrency"]] / 1e3)
        assert gpu_s == pytest.approx(1.0)
        assert cap["prefill_share"] + cap["decode_share"] == pytest.approx(1.0)
        assert cap["of_ceiling"] == pytest.approx(row["output_tok_s"] / x)
    assert report.ceilings(levels, {**runner, "prefill_round": None}) == []
    assert report.ceilings(levels, None) == []
    text = report.format_table([{**r, "requests": 1, "failed": 0, "req_s": 1.0, "ttft_p50_ms": 1.0,
                                 "ttft_p99_ms": 1.0, "tpot_p50_ms": 1.0} for r in levels],
                               [], {**runner, "prefill_ms_median": 1.0, "prefill": [{}],
                                    "prefill_round": {**runner["prefill_round"], "tokens": 1, "lengths": [1], "ms": 1.0}})
    assert sum("one-GPU ceiling" in line for line in text.splitlines()) == len(caps)


def test_a_prefill_round_is_whole_prompts_in_turn_then_a_chunk_of_the_next_up_to_the_budget() -> None:
    round_lengths = bench_module("runner_steps").round_lengths
    rng = random.Random()
    for _ in range(200):
        lengths = tuple(rng.randint(1, 1200) for _ in range(rng.randint(1, 6)))
        budget = rng.randint(1, 9000)
        got = round_lengths(lengths, budget)
        assert sum(got) == budget and all(n > 0 for n in got), (lengths, budget, got)
        cycled = [lengths[i % len(lengths)] for i in range(len(got))]
        assert got[:-1] == cycled[:-1] and 0 < got[-1] <= cycled[-1], (lengths, budget, got)


def test_the_round_size_follows_the_worker_flags_as_serve_reads_them(monkeypatch) -> None:
    serving_gpu = bench_module("serving_gpu")
    from deepseek_pd.errors import UserError
    from deepseek_pd.workers.serve import resolution as serve_resolution
    from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig, gpu_chunked_prefill_size

    rng = random.Random()
    a, b, c = (rng.randint(16, 16384) for _ in range(3))
    total = rng.randrange(8 << 30, 200 << 30)
    monkeypatch.setattr(serve_resolution, "total_memory_bytes", lambda device: total)
    tokens = serving_gpu.prefill_round_tokens
    assert tokens(["--page-size=64"], "cpu") == SchedulerConfig.chunked_prefill_size
    assert tokens(["--page-size=64"], "cuda") == gpu_chunked_prefill_size(total)
    assert tokens([f"--chunked-prefill-size={a}", f"--chunked-prefill-size={c}"], "cuda") == c
    assert tokens(["--chunked-prefill-size", str(c), "--page-size=64"], "cpu") == c
    # serve's own reading: other engine options pass, the flag's field is no engine option there.
    assert tokens(["--engine-opt", "prefix_cache=false", "--page-size=64"], "cuda") == gpu_chunked_prefill_size(total)
    with pytest.raises(UserError, match="unknown --engine-opt 'chunked_prefill_size'"):
        tokens(["--engine-opt", f"chunked_prefill_size={b}"], "cuda")


def test_the_prefill_worker_lines_hold_its_step_against_the_runner() -> None:
    """c=1: the step's p50 and mean over the runner's one-prompt prefill; above: its rate by the mean
    over the runner's round rate; each with the round's phases when the worker reported them."""
    report = bench_module("serving_report")
    rng = random.Random()
    one, round_tok_s = rng.uniform(10, 60), rng.uniform(1e4, 1e5)
    rows = []
    for c in (1, 16):
        worker = {"prefill_step_ms": rng.uniform(20, 200), "prefill_step_p50_ms": rng.uniform(20, 200),
                  "prefill_tokens_per_step": rng.uniform(100, 8000),
                  "prefill_phases_ms": {"launch": rng.uniform(1, 20)}, "prefill_unattributed_ms": 0.0,
                  "prefill_request_phases_ms": {"handshake": rng.uniform(1, 9)}}
        rows.append({"concurrency": c, "workers": {"decode-0": {"decode_step_ms": 1.0}, "prefill-0": worker}})
    lines = report.prefill_worker_lines(rows, {"prefill_ms_median": one, "prefill_round": {"tok_s": round_tok_s}})
    first, second = rows[0]["workers"]["prefill-0"], rows[1]["workers"]["prefill-0"]
    assert f"p50 {first['prefill_step_p50_ms'] / one:.2f}x, mean {first['prefill_step_ms'] / one:.2f}x" in lines[0]
    rate = second["prefill_tokens_per_step"] / second["prefill_step_ms"] * 1e3
    assert f"{rate / round_tok_s:.2f} of the runner's round" in lines[3]
    assert lines[1].startswith("  round (means, ms): launch") and lines[2].startswith("  request (means, ms): handshake")
    assert len(lines) == 6
    assert report.prefill_worker_lines([{"concurrency": 1}], None) == []
