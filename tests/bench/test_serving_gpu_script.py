"""`bench/serving_gpu.py --tiny`: the GPU serving benchmark's whole path on CPU, in one run.

Its report is checked against its own sources, not against fixed numbers: each table row equals
the `bench serving` summary it came from, the runner timed exactly the prompt lengths that the
c=1 run then sent, every request decoded exactly the planned output length, the ratio checks are
the quotients of the figures they name, and the KV bytes per token that `bench serving` learned
from the router equal the runner's own KV pool figure. The run is the session's one tiny run of
every part (tests/bench/conftest.py); the rows of parts left out: test_serving_gpu_parts.py.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pdtest.bench_scripts import bench_module
from pdtest.tiny_serving_run import TinyServingRun

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]  # the shared run starts in the first test that asks


def test_tiny_run_reports_what_it_measured(tiny_serving_run: TinyServingRun) -> None:
    out = tiny_serving_run.out
    result = tiny_serving_run.result()
    plan, runner = result["meta"]["plan"], result["runner"]
    assert runner is not None, result["notes"]
    assert [row["concurrency"] for row in result["levels"]] == [c for c, _ in plan["levels"]], result["notes"]

    for row in result["levels"]:
        level = json.loads(Path(row["json"]).read_text())
        summary = level["summary"]
        assert row["output_tok_s"] == summary["output_throughput"]
        assert row["tpot_p50_ms"] == summary["tpot_ms"]["p50"] and row["failed"] == summary["failed"] == 0
        assert level["config"]["max_concurrency"] == row["concurrency"]
        low = int(plan["input_len"] * (1 - plan["range_ratio"]))
        assert all(r["output_len"] == plan["output_len"] for r in level["requests"])
        assert all(low <= r["prompt_len"] <= plan["input_len"] for r in level["requests"])
        assert summary["kv_bytes_per_token"] == runner["kv_bytes_per_token"]
        # The workers' own view of the level: every request reached both, each as one TTFT.
        workers = row["workers"]
        assert sorted(workers) == ["decode-0", "prefill-0"]
        assert workers["prefill-0"]["ttft_count"] == workers["decode-0"]["ttft_count"] == summary["completed"]
        assert 0 < workers["prefill-0"]["prefill_step_ms"] <= workers["decode-0"]["ttft_ms"]

    assert result["c1_prompt_lengths_sent"] == result["c1_prompt_lengths_planned"]
    assert sorted(p["length"] for p in runner["prefill"]) == result["c1_prompt_lengths_planned"]

    checks = {c["check"]: c for c in result["checks"]}
    by_level = {row["concurrency"]: row for row in result["levels"]}
    steps = {d["batch"]: d["step_ms"] for d in runner["decode"]}
    tpot_level = plan["checks"]["tpot_level"]
    ratio = checks[f"TPOT p50 @c={tpot_level} / runner step @bs{tpot_level}"]
    assert ratio["value"] == pytest.approx(by_level[tpot_level]["tpot_p50_ms"] / steps[tpot_level])
    assert ratio["result"] == ("PASS" if ratio["value"] <= plan["checks"]["tpot_ratio_max"] else "MISS")
    ttft = checks["TTFT p50 @c=1 - runner prefill (ms)"]
    assert ttft["value"] == pytest.approx(by_level[1]["ttft_p50_ms"] - runner["prefill_ms_median"])

    # The runner's prefill round is the worker's default round of the c=1 lengths, and each level's
    # one-GPU ceiling is computed from it and the runner step at the level's batch.
    from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
    expected_round = bench_module("runner_steps").round_lengths(tuple(p["length"] for p in runner["prefill"]),
                                                                SchedulerConfig().chunked_prefill_size)
    assert runner["prefill_round"]["lengths"] == expected_round and runner["prefill_round"]["tok_s"] > 0
    caps = bench_module("serving_report").ceilings(result["levels"], runner)
    assert result["ceilings"] == caps and [c["concurrency"] for c in caps] == [c for c, _ in plan["levels"]]
    table = tiny_serving_run.lines
    assert sum(line.startswith("one-GPU ceiling") for line in table) == len(caps)

    config = json.loads((tiny_serving_run.model_dir / "config.json").read_text())
    assert {k: result["meta"]["shapes"][k] for k in config} == config
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert result["meta"]["commit"] == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert (out / "serving_gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The serving table (its checks, then the tiny-run note) comes just before the six targets'
    # table, whose first four rows are the serving checks as measured.
    targets, checks = result["targets"], result["checks"]
    start = next(i for i, line in enumerate(table) if line.startswith("issue 7 targets, commit "))
    assert table[start - 1].startswith("tiny CPU run")
    assert table[start - 2 - len(checks)].startswith("check") and table[start - 2].startswith(checks[-1]["check"])
    assert [{k: t[k] for k in c} for t, c in zip(targets[:4], checks)] == checks and len(targets) == 7

    pyspy_binary = bench_module("pyspy_profile").pyspy_binary

    if pyspy_binary() is None:
        assert any("py-spy is not installed" in note for note in result["notes"])
    else:
        # Both workers were recorded; an idle one has no samples (py-spy skips idle threads).
        assert set(result["profile"]) == {"decode-0", "prefill-0"}, result["notes"]
        assert sum(p["sampled_s"] for p in result["profile"].values()) > 0
