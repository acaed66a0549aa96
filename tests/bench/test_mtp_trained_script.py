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
    assert run["training"]["depth"] == 2  # the chain's every step (--steps 1,2)
    # fp32: the evaluation repeats the trained sequences, and the extend path ranks the decoded tokens
    # first (a rare fp32 near-tie of the random tiny model aside)
    assert run["training"]["off_equal_prefix_fraction"] == {str(b): 1.0 for b in batches}
    assert all(v >= 0.95 for v in result["off_path_agreement"].values()), result["off_path_agreement"]
    assert "random weights" in result["note"]
    costs = result["step_costs_ms"]
    assert len(costs["ms_by_k"]) == 3 and costs["batches"][0] == 1  # k = 0..2 at batch 1, 2, ..
    for row in run["rows"]:
        assert row["off_tok_s"] > 0 and row["best_fixed"] in ("k1", "k2")
        for name in ("k1", "k2", "adaptive"):
            setting = row[name]
            assert setting["greedy_equal"] and setting["first_divergence"] is None, (seed, row["batch"], name)
            assert setting["equal_prefix_fraction"] == 1.0 and "max_divergence_gap" not in setting
            assert setting["speedup"] == pytest.approx(setting["tok_s"] / row["off_tok_s"], rel=0.01)
            assert setting["accepted"] <= setting["drafted"]
            assert 0 <= setting["mixed_steps"] <= setting["steps"] and setting["verify_replays"] is None  # no graphs
            assert setting["steps"] >= 1 and setting["step_ms"] > 0
        for k in (1, 2):  # the table's implication at the measured accept length
            setting = row[f"k{k}"]
            assert setting["implied_at_measured_accept"] == pytest.approx(
                setting["accept_length"] * row["plain_step_ms"] / setting["table_step_ms"], rel=0.01)
        implied = row["implied"]
        assert list(implied) == [str(a) for a in bench.ACCEPT_LENGTHS]
        assert implied["1.8"]["k"] in (1, 2) and implied["2.4"]["k"] == implied["3.0"]["k"] == 2  # k + 1 >= A
        assert row["k2"]["accept_length"] > 1.5, (seed, row)  # trained: drafts are accepted
        chosen = row["adaptive"]["chosen_steps"]
        assert chosen and set(chosen) <= {"0", "1", "2"}, chosen  # JSON keys
        verdicts = row["adaptive_verdict"], row["best_fixed_verdict"]
        if row["batch"] in bench.TARGETS:
            assert all(v.split()[0] == ("PASS" if s >= bench.TARGETS[row["batch"]] else "MISS") for v, s in
                       zip(verdicts, (row["adaptive"]["speedup"], row[row["best_fixed"]]["speedup"]))), row
        else:
            assert verdicts == ("", "")


def test_implied_speedups_pick_the_best_reachable_k() -> None:
    from deepseek_pd.model.speculative.policy import StepCosts

    bench = bench_module("mtp_trained_gpu")
    rng = random.Random(random.randrange(1 << 20))
    ms = tuple(tuple(rng.uniform(1, 10) for _ in range(3)) for _ in range(4))  # k = 0..3 at batch 1, 2, 4
    costs, batch, plain = StepCosts((1, 2, 4), ms), rng.choice([1, 2, 4]), rng.uniform(1, 10)
    got = bench.implied_speedups(costs, batch, plain)
    for a in bench.ACCEPT_LENGTHS:
        want = max((a * plain / costs.at(batch, k), k) for k in range(1, 4) if k + 1 >= a)
        assert got[str(a)] == {"k": want[1], "speedup": round(want[0], 3)}


def test_equal_prefix_fraction() -> None:
    bench = bench_module("mtp_trained_gpu")
    rng = random.Random(random.randrange(1 << 20))
    want = [[rng.randrange(100) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    got = [list(w) for w in want]
    assert bench.equal_prefix_fraction(want, got) == 1.0
    i = rng.randrange(5)
    j = rng.randrange(len(want[i]))
    got[i][j] += 1
    assert bench.equal_prefix_fraction(want, got) == pytest.approx(1 - (len(want[i]) - j) / sum(map(len, want)))


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
