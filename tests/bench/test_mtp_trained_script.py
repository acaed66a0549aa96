"""bench/mtp_trained_gpu.py on the CPU (`--tiny`): one run decodes prompts with speculation off,
trains the tiny model's MTP layer on their greedy continuations (`--data in-sample`, as the
speculative engine tests train it), then decodes them again with k = 1, 2 and the adaptive policy.
The oracle is the run without speculation: fp32 greedy tokens equal in every setting. Training must
work for the accept path to be exercised: the accept length comes out well above 1. The CPU's
tok/s say nothing of the GPU's (decode is not memory-bound here); only their bookkeeping is checked."""
from __future__ import annotations

import json
import random

import pytest

from pdtest.bench_scripts import bench_module

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


def test_trained_mtp_run_reports_every_setting(tmp_path) -> None:
    bench = bench_module("mtp_trained_gpu")
    seed = random.randrange(1 << 20)
    batches = [1, random.randint(2, 3)]
    out = tmp_path / "mtp.json"
    result = bench.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--page-size", "16",
                         "--batches", ",".join(map(str, batches)), "--bs1-prompts", "2", "--prompt-len", "8",
                         "--output-len", "16", "--train-len", "16", "--steps", "1,2", "--data", "in-sample", "--train-prompts", "1",
                         "--train-seconds", "6", "--min-train-seconds", "1", "--lr", "1e-2",
                         "--seed", str(seed), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    result = json.loads(out.read_text())
    assert [run["data"] for run in result["runs"]] == ["in-sample"]
    run = result["runs"][0]
    assert [row["batch"] for row in run["rows"]] == batches
    assert run["training"]["steps"] > 0 and 0 < run["training"]["data_distinct_fraction"] <= 1
    costs = result["step_costs_ms"]
    assert len(costs["ms_by_k"]) == 3 and costs["batches"][0] == 1  # k = 0..2 at batch 1, 2, ..
    for row in run["rows"]:
        assert row["off_tok_s"] > 0 and row["best_fixed"] in ("k1", "k2")
        for name in ("k1", "k2", "adaptive"):
            setting = row[name]
            assert setting["greedy_equal"] and setting["first_divergence"] is None, (seed, row["batch"], name)
            assert setting["speedup"] == pytest.approx(setting["tok_s"] / row["off_tok_s"], rel=0.01)
            assert setting["accepted"] <= setting["drafted"]
        assert row["k2"]["accept_length"] > 1.5, (seed, row)  # trained: drafts are accepted
        chosen = row["adaptive"]["chosen_steps"]
        assert chosen and set(chosen) <= {"0", "1", "2"}, chosen  # JSON keys
        verdicts = row["adaptive_verdict"], row["best_fixed_verdict"]
        if row["batch"] in bench.TARGETS:
            assert all(v.split()[0] == ("PASS" if s >= bench.TARGETS[row["batch"]] else "MISS") for v, s in
                       zip(verdicts, (row["adaptive"]["speedup"], row[row["best_fixed"]]["speedup"]))), row
        else:
            assert verdicts == ("", "")


def test_first_divergence_and_distinct_fraction() -> None:
    bench = bench_module("mtp_trained_gpu")
    rng = random.Random(random.randrange(1 << 20))
    want = [[rng.randrange(100) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    assert bench.first_divergence(want, [list(w) for w in want]) is None
    i = rng.randrange(5)
    j = rng.randrange(len(want[i]))
    got = [list(w) for w in want]
    got[i][j] += 1
    assert bench.first_divergence(want, got) == {"prompt": i, "position": j, "want": want[i][j], "got": got[i][j]}
    assert bench.distinct_fraction([[1, 1, 1, 1], [1, 2, 3, 4]]) == pytest.approx((0.25 + 1.0) / 2)
