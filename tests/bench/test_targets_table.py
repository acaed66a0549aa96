"""Issue 7's one table of six targets (`bench/targets_table.py`, printed last by `bench/serving_gpu.py`).

The merge is checked with fresh random measurements against recomputed ratios and verdicts; the
transfer parts (`bench/target_parts.py`) run for real once in the tiny CPU mode, and each of their
rows must equal what their own JSON's seconds give. That run is the session's one tiny run of
every part (tests/bench/conftest.py), whose serving rows tests/bench/test_serving_gpu_script.py
checks; the rows of parts left out: test_serving_gpu_parts.py.
"""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from pdtest.bench_scripts import bench_module
from pdtest.tiny_serving_run import TinyServingRun


def _random_run(rng: random.Random) -> tuple[list[dict], dict]:
    """Serving rows and runner figures as serving_gpu.py records them, plus the parts' JSON."""
    report, check = bench_module("serving_report"), bench_module("target_check").check
    levels = [{"concurrency": c, "output_tok_s": rng.uniform(100, 9000), "tpot_p50_ms": rng.uniform(5, 40),
               "ttft_p50_ms": rng.uniform(50, 400)} for c in (1, 16, 64, 128)]
    runner = {"prefill_ms_median": rng.uniform(20, 200),
              "decode": [{"batch": c, "step_ms": rng.uniform(4, 30)} for c in (1, 16, 64, 128)]}
    parts = {"kv_transfer": {"check": check("grpc KV (GB/s)", rng.uniform(0.5, 3), ">=", 2.0)},
             "mooncake": {"check": check("Mooncake ours / raw", rng.uniform(0.3, 1.2), ">=", 0.8)},
             "layerwise": {"check": check("layer-wise / compute", rng.uniform(0.9, 4), "<=", 1.1)}}
    return report.evaluate(levels, runner), parts


def test_six_targets_merge_into_one_table_with_ratios_and_verdicts() -> None:
    table = bench_module("targets_table")
    rng = random.Random()
    serving, parts = _random_run(rng)
    rows = table.target_rows(serving, parts, {})
    assert [r["check"] for r in rows] == [c["check"] for c in serving] + [p["check"]["check"] for p in parts.values()]
    for row in rows:
        assert row["ratio"] == pytest.approx(row["value"] / row["limit"])
        passed = row["value"] <= row["limit"] if row["op"] == "<=" else row["value"] >= row["limit"]
        assert row["result"] == ("PASS" if passed else "MISS")
    commit = f"{rng.getrandbits(160):040x}"
    text = table.format_targets(rows, commit).splitlines()
    assert commit in text[0] and len(text) == 2 + len(rows)
    for line, row in zip(text[2:], rows):
        assert line.startswith(row["check"]) and line.endswith(row["result"])
        assert f"{row['value']:.3f}" in line and f"{row['ratio']:.2f}" in line


def test_a_part_not_measured_keeps_its_row_and_says_why() -> None:
    table = bench_module("targets_table")
    serving, parts = _random_run(random.Random())
    del parts["mooncake"]
    why = "mooncake is not importable"
    rows = table.target_rows(bench_module("serving_report").evaluate([], None), parts, {"mooncake": why})
    assert len(rows) == 7 and all(r["result"] == "n/a" for r in rows[:4])
    mooncake = next(r for r in rows if r.get("part") == "mooncake")
    assert mooncake["value"] is None and mooncake["why"] == why
    assert why in table.format_targets(rows, "abc")
    with pytest.raises(ValueError):
        table.target_rows(serving[:3], parts, {})


def test_parts_that_do_not_fit_in_the_budget_are_skipped_not_started(tmp_path: Path) -> None:
    parts = bench_module("target_parts")
    started: list[str] = []

    def run_step(name, argv, timeout_s, log):
        started.append(name)
        return False, 0.0, ""

    notes: list[str] = []
    skipped: dict[str, str] = {}
    found = parts.run_parts(parts.TINY_PARTS, {"kv_transfer", "layerwise"}, tmp_path, tmp_path / "parts",
                            lambda: 1.0, run_step, notes, skipped)
    assert found == {} and started == []
    assert set(skipped) == {"kv_transfer", "layerwise"} and all("skipped for time" in w for w in skipped.values())
    assert len(notes) == 2


@pytest.mark.slow
@pytest.mark.timeout(480)  # the shared run starts in the first test that asks
def test_tiny_run_of_the_transfer_parts_reports_what_their_json_says(tiny_serving_run: TinyServingRun) -> None:
    out = tiny_serving_run.out
    result = tiny_serving_run.result()
    rows = {r.get("part", "serving"): r for r in result["targets"]}
    assert len(result["targets"]) == 7 and set(rows) == {"serving", "kv_transfer", "mooncake", "layerwise"}

    kv = json.loads((out / "parts" / "kv_transfer.json").read_text())
    assert [r["streams"] for r in kv["runs"]] == [1, 2] and kv["raw_grpc"]
    assert rows["kv_transfer"]["value"] == pytest.approx(max(kv["bytes"] / min(r["seconds"]) / 1e9 for r in kv["runs"]))
    mooncake = json.loads((out / "parts" / "mooncake.json").read_text())["runs"][0]
    assert len(mooncake["raw_seconds"]) == len(mooncake["seconds"]) == 2
    assert rows["mooncake"]["value"] == pytest.approx(min(mooncake["raw_seconds"]) / min(mooncake["seconds"]))
    layerwise = json.loads((out / "parts" / "layerwise.json").read_text())
    assert layerwise["model"] == str(tiny_serving_run.model_dir)  # the run's own checkpoint
    seconds = layerwise["seconds"]
    assert rows["layerwise"]["value"] == pytest.approx(statistics.median(seconds["layer-wise"])
                                                       / statistics.median(seconds["compute"]))
    for name in ("kv_transfer", "mooncake", "layerwise"):
        assert rows[name]["ratio"] == pytest.approx(rows[name]["value"] / rows[name]["limit"])
        assert rows[name]["result"] in ("PASS", "MISS")

    lines = tiny_serving_run.lines
    start = next(i for i, line in enumerate(lines) if line.startswith("issue 7 targets, commit "))
    assert result["meta"]["commit"] in lines[start]
    # Title, header, the rows, the tiny-run note; then the loads apart (the last table when they run).
    assert lines[start + 2 + 7].startswith("tiny CPU run")
    assert lines[start + 2 + 7 + 1].startswith("issue 25 loads apart")
    assert any("mooncake ran" in note for note in result["notes"])  # in a namespace, or why not
