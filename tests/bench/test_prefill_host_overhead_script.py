"""bench/prefill_host_overhead.py and bench/gil_switch.py on the CPU (the GPU runs the same code):
one run reports every stage, the ops counted, the configs compared and the real engines' pair; the
GIL bench keeps to its budget and says so when its spinner had to stop."""
from __future__ import annotations

import json
import random
import time

import pytest

from pdtest.bench_scripts import bench_module

pytestmark = pytest.mark.timeout(120)


def test_one_run_reports_every_stage_and_the_engines_pair(tmp_path, capsys) -> None:
    bench = bench_module("prefill_host_overhead")
    rng = random.Random()
    tokens, switch = rng.randint(4, 24), rng.choice([0.2, 0.5, 1.0])
    out = tmp_path / "host.json"
    result = bench.main(["--model", "tiny", "--tokens", str(tokens), "--repeats", "1", "--engine-requests", "3",
                         "--busy-cap-s", "0.2", "--switch-ms", str(switch), "--seed", str(rng.randrange(1 << 30)),
                         "--json", str(out)])
    printed = capsys.readouterr().out
    # The serving worker's config and the runner bench's make the same forward on the tiny model, so
    # one runner serves both and the worker_config stage is left out.
    stages = [stage for stage in bench.STAGES if stage != "worker_config"] + [f"busy_{switch:g}ms"]
    assert list(result["seconds"]) == stages and all(value > 0 for value in result["seconds"].values())
    assert "the same forward" in printed and result["repeats"] == 1
    for stage in stages:
        assert f"\n{stage:<14} {result['seconds'][stage] * 1e3:9.2f}" in printed
    ops = result["ops"]
    assert ops["layer_events"] > ops["runner"] > 0  # the first token's sampling on top of the same extend
    engine = result["engine"]
    assert engine["worker_engine"] >= engine["engine_forward"] > 0 and engine["engine_ratio"] > 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))


def test_gil_switch_keeps_to_its_budget(capsys) -> None:
    bench = bench_module("gil_switch")
    budget = random.uniform(1.5, 2.5)
    began = time.monotonic()
    results = bench.main(["--tokens", "16", "--pairs", "1000", "--intervals-ms", "5,0.5", "--budget-s", str(budget)])
    # The load, then pairs only while the budget lasts (1,000 unbounded pairs take minutes); the
    # margin is for a loaded 2-core machine.
    assert time.monotonic() - began < budget + 15
    assert set(results) == {5.0, 0.5} and all(ratio > 0 for ratio in results.values())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gil_switch: loading") and len([ln for ln in lines if "switch interval" in ln]) == 2


def test_gil_switch_says_at_once_when_the_model_is_missing(tmp_path) -> None:
    with pytest.raises(SystemExit, match="neither 'tiny' nor an existing directory"):
        bench_module("gil_switch").main(["--model", str(tmp_path / "absent")])
