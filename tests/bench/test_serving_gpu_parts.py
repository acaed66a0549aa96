"""`bench/serving_gpu.py --parts`: what a run with parts left out runs and reports, without a run.

The tiny end-to-end run (tests/bench/conftest.py) runs every part. What leaving parts out changes
is checked here on the script's own functions, with random figures: `report` marks each target
row of a part left out "not in --parts" and returns only the tables of the parts that ran (the
script prints them in that order, so the last one run is the last printed), `all_measured` (the
exit code) asks only for the parts named, and `serve_levels`, against an `up` that starts nothing,
starts the mixed levels only for "serving" and the loads apart only for theirs.
"""
from __future__ import annotations

import importlib
import random
from pathlib import Path

import pytest

from pdtest.bench_scripts import bench_module

TRANSFER = ("kv_transfer", "mooncake", "layerwise")
SOLO = ("prefill_only", "decode_only")


def _summary(rng: random.Random, requests: int) -> dict:
    """A `bench serving` summary with random figures (the fields `serving_report.level_row` reads)."""
    pct = lambda lo, hi: {"p50": rng.uniform(lo, hi), "p99": rng.uniform(hi, 2 * hi)}  # noqa: E731
    return {"num_requests": requests, "failed": 0, "request_throughput": rng.uniform(1, 50),
            "output_throughput": rng.uniform(100, 9000), "input_throughput": rng.uniform(1000, 90000),
            "ttft_ms": pct(10, 400), "tpot_ms": pct(2, 40), "itl_ms": pct(2, 40), "duration_s": rng.uniform(1, 60)}


def _measured(rng: random.Random, plan, parts: set[str]) -> dict:
    """serving_gpu.py's result as `main` holds it before `report`, after running `parts`."""
    sg, report = bench_module("serving_gpu"), bench_module("serving_report")
    check = bench_module("target_check").check
    loads = plan.solo
    runner = {"device_name": "cpu", "prefill_ms_median": rng.uniform(5, 50),
              "prefill": [{"length": rng.randint(32, plan.input_len)}],
              "decode": [{"batch": c, "step_ms": rng.uniform(2, 30), "tok_s": rng.uniform(100, 9000)}
                         for c, _ in plan.levels],
              "prefill_only_round": {"tok_s": rng.uniform(1000, 50000), "tokens": 2048},
              "decode_only": [{"batch": c, "step_ms": rng.uniform(2, 30)} for c, _ in loads.decode_levels]}
    solo = {"prefill_only": None, "decode_only": {}}
    if "prefill_only" in parts:
        solo["prefill_only"] = report.level_row(4, _summary(rng, 12))
    if "decode_only" in parts:
        solo["decode_only"] = {c: report.level_row(c, _summary(rng, n)) for c, n in loads.decode_levels}
    return {"meta": {"commit": f"{rng.getrandbits(160):040x}", "dirty": False, "parts": sorted(parts)},
            "phases": {}, "runner": runner if parts & sg.LEVEL_PARTS else None,
            "levels": [report.level_row(c, _summary(rng, n)) for c, n in plan.levels] if "serving" in parts else [],
            "parts": {name: {"check": check(name, rng.uniform(0.1, 3), ">=", 1.0)} for name in TRANSFER
                      if name in parts},
            "skipped": {}, "notes": [], "solo": solo}


@pytest.mark.parametrize("parts", [{"serving"}, set(TRANSFER), set(SOLO), {"serving", *SOLO}],
                         ids=["serving", "transfer", "solo", "serving+solo"])
def test_a_part_left_out_keeps_its_target_rows_and_prints_no_table(tmp_path: Path, parts: set[str]) -> None:
    sg = bench_module("serving_gpu")
    rng = random.Random()
    result = _measured(rng, sg.TINY, parts)
    table, targets, solo = sg.report(sg.TINY, tmp_path, result, True, sg.Budget(60.0))

    rows = result["targets"]
    assert len(rows) == 7
    for row in rows:
        left_out = row.get("part", "serving") not in parts
        assert (row.get("why") == "not in --parts") == left_out, row
        assert (row["value"] is None) == left_out, row
    # The tables printed are those of the parts run, in this order; each ends with the tiny-run note.
    assert bool(table) == ("serving" in parts) and bool(solo) == bool(parts & set(SOLO))
    printed = [text for text in (table, targets, solo) if text]
    assert printed[-1].splitlines()[-1].startswith("tiny CPU run")
    lines = targets.splitlines()
    assert lines[0].startswith(f"issue 7 targets, commit {result['meta']['commit']}") and len(lines) == 2 + 7 + 1
    if solo:
        assert solo.splitlines()[0].startswith("issue 25 loads apart")
        assert (tmp_path / "solo_targets.txt").read_text().strip() == solo
    else:
        assert not (tmp_path / "solo_targets.txt").exists()
    assert (tmp_path / "serving_gpu.png").exists() == ("serving" in parts)

    # The exit code: 0 when every part named gave its figures, whichever were left out.
    assert sg.all_measured(parts, result)
    if "serving" in parts:
        assert not sg.all_measured(parts, {**result, "levels": []})
    if parts & set(TRANSFER):
        dropped = rng.choice(sorted(result["parts"]))
        fewer = {k: v for k, v in result["parts"].items() if k != dropped}
        assert not sg.all_measured(parts, {**result, "parts": fewer})
    if solo:
        missing = rng.randrange(len(result["solo_checks"]))
        checks = [{**c, "value": None} if i == missing else c for i, c in enumerate(result["solo_checks"])]
        assert not sg.all_measured(parts, {**result, "solo_checks": checks})


class _IdleUp:
    """`up` that starts nothing: the script's steps against it are recorded, not run."""

    def __init__(self, spec) -> None:
        self.spec = spec

    def start(self) -> str:
        return "http://127.0.0.1:9"

    def stop(self) -> None:
        pass

    @property
    def control_plane_key_file(self) -> Path:
        return self.spec.log_dir / "control-plane-key"


@pytest.mark.parametrize("parts", [{"serving"}, set(SOLO), {"serving", *SOLO}], ids=["serving", "solo", "both"])
def test_the_levels_started_are_those_of_the_parts_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         parts: set[str]) -> None:
    sg = bench_module("serving_gpu")
    started: list[str] = []

    def run_step(name, argv, timeout_s, log):
        started.append(name)
        return False, 0.0, ""  # no JSON written: the level is noted as without a result

    monkeypatch.setattr(sg, "run_step", run_step)
    monkeypatch.setattr(importlib.import_module("up_process"), "UpProcess", _IdleUp)
    plan, flags = sg.TINY, sg.worker_flags(sg.TINY, [])
    result = {"notes": [], "levels": [], "phases": {}, "runner": None,
              "solo": {"prefill_only": None, "decode_only": {}}}
    sg.serve_levels(plan, tmp_path / "model", tmp_path, flags, False, random.Random().randrange(1 << 30),
                    sg.Budget(plan.budget_s), result, parts)

    mixed = [f"c={c}" for c, _ in plan.levels] if "serving" in parts else []
    prefill_c, _ = plan.solo.prefill_load(sg.prefill_round_tokens(flags, plan.device))
    apart = ([f"prefill_only c={prefill_c}"] + [f"decode_only c={c}" for c, _ in plan.solo.decode_levels]
             if parts & set(SOLO) else [])
    assert started == ["warmup", *mixed, *apart]
