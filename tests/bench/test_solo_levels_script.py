"""`bench/serving_gpu.py --tiny --parts prefill_only,decode_only`: issue 25's loads apart, on CPU.

The loads' table is checked against its own sources: each row's figure is the `bench serving`
summary it came from, each request had exactly the load's lengths, the runner timed a round of
the load's prompts at the worker's own round size and decode steps at the load's batches and mean
context, each ratio is the quotient of the figures it names and its verdict follows its target,
and the table names the card and the commit. The run is the session's one tiny run of every part
(tests/bench/conftest.py); that the loads apart run without the mixed levels when those are left
out: test_serving_gpu_parts.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdtest.bench_scripts import bench_module
from pdtest.tiny_serving_run import TinyServingRun


def test_the_loads_need_the_figures_they_divide() -> None:
    solo = bench_module("solo_levels")
    loads = solo.SoloLoads()
    assert loads.prefill_load(8192) == (16, 96) and loads.decode_context == 32 + 512
    checks = solo.solo_checks({"prefill_only": None, "decode_only": {}}, None, loads)
    assert [c["result"] for c in checks] == ["n/a"] * (1 + len(loads.decode_levels))
    row = {"input_tok_s": 45_000.0, "tpot_p50_ms": None}
    runner = {"prefill_only_round": {"tok_s": 50_000.0, "tokens": 8192},
              "decode_only": [{"batch": 64, "step_ms": 10.0}]}
    got = solo.solo_checks({"prefill_only": row, "decode_only": {64: {"tpot_p50_ms": 11.5}}}, runner, loads)
    assert got[0]["value"] == pytest.approx(0.9) and got[0]["result"] == "PASS"
    assert got[1]["value"] == pytest.approx(1.15) and got[1]["result"] == "MISS" and got[2]["result"] == "n/a"
    assert [c["check"] for c in solo.solo_checks({}, runner, loads, ("decode_only",))] == [
        solo.decode_label(c) for c, _ in loads.decode_levels]


@pytest.mark.slow
@pytest.mark.timeout(480)  # the shared run starts in the first test that asks
def test_tiny_run_reports_the_loads_apart(tiny_serving_run: TinyServingRun) -> None:
    out = tiny_serving_run.out
    result = tiny_serving_run.result()
    loads, runner, solo = result["meta"]["plan"]["solo"], result["runner"], result["solo"]

    prefill = solo["prefill_only"]
    level = json.loads(Path(prefill["json"]).read_text())
    assert prefill["input_tok_s"] == level["summary"]["input_throughput"] and level["summary"]["failed"] == 0
    assert {(r["prompt_len"], r["output_len"]) for r in level["requests"]} == {(loads["prefill_len"], 1)}
    from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
    round_tokens = SchedulerConfig().chunked_prefill_size  # the CPU worker's round
    per_round = round_tokens // loads["prefill_len"]
    assert (level["config"]["max_concurrency"], level["summary"]["num_requests"]) == (
        2 * per_round, loads["prefill_rounds"] * per_round)
    assert runner["prefill_only_round"]["lengths"] == bench_module("runner_steps").round_lengths(
        (loads["prefill_len"],), round_tokens)

    steps = {d["batch"]: d for d in runner["decode_only"]}
    assert sorted(steps) == [c for c, _ in loads["decode_levels"]]
    assert all(d["mean_context"] == loads["decode_input_len"] + loads["decode_output_len"] // 2
               for d in steps.values())
    decode = solo["decode_only"]
    assert sorted(int(c) for c in decode) == sorted(steps)
    for c, row in decode.items():
        level = json.loads(Path(row["json"]).read_text())
        assert row["tpot_p50_ms"] == level["summary"]["tpot_ms"]["p50"] and level["summary"]["failed"] == 0
        assert {(r["prompt_len"], r["output_len"]) for r in level["requests"]} == {
            (loads["decode_input_len"], loads["decode_output_len"])}
        assert level["config"]["max_concurrency"] == int(c)

    checks = result["solo_checks"]
    assert len(checks) == 1 + len(loads["decode_levels"])
    assert checks[0]["measured"] == prefill["input_tok_s"]
    assert checks[0]["reference"] == runner["prefill_only_round"]["tok_s"]
    for check, (c, _) in zip(checks[1:], loads["decode_levels"]):
        assert check["measured"] == decode[str(c)]["tpot_p50_ms"] and check["reference"] == steps[c]["step_ms"]
    for check in checks:
        assert check["value"] == pytest.approx(check["measured"] / check["reference"])
        passed = check["value"] >= check["limit"] if check["op"] == ">=" else check["value"] <= check["limit"]
        assert check["result"] == ("PASS" if passed else "MISS")

    lines = tiny_serving_run.lines  # the loads' table comes last
    start = next(i for i, line in enumerate(lines) if line.startswith("issue 25 loads apart"))
    assert f"card {runner['device_name']}" in lines[start] and result["meta"]["commit"] in lines[start]
    table = lines[start + 2:start + 2 + len(checks)]
    assert [line.split()[-1] for line in table] == [c["result"] for c in checks]
    assert (out / "solo_targets.txt").read_text().strip() == "\n".join(lines[start:])
