"""bench/speculative_steps.py on the CPU (the tiny model with a random MTP layer): one run times a
plain decode step and a speculative step of each draft count at each batch size and reports the
implied speed-ups, `A * plain / spec(k)`, for every accept length A a k can reach (k + 1 at most),
and the decoder's whole step (acceptance and host read included) of each k, and the time per step
of a chain of steps launched in order and launched ahead of the step before.
The context is chosen so each sequence's last page is nearly empty: the KV pool must be sized in
whole pages per sequence (it was sized in tokens, and the GPU command's batch 128 ran out)."""
from __future__ import annotations

import json
import random

import pytest

from pdtest.bench_scripts import bench_module

pytestmark = pytest.mark.timeout(300)


def test_one_run_times_every_batch_and_draft_count(tmp_path) -> None:
    bench = bench_module("speculative_steps")
    rng = random.Random()
    page, steps = 16, [1, 2]
    context = page * rng.randint(1, 2) - max(steps)  # context + k + 1 tokens: one token into a new page
    batches = [1, rng.randint(4, 6)]
    out = tmp_path / "spec.json"
    result = bench.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--page-size", str(page),
                         "--context", str(context), "--batches", ",".join(map(str, batches)),
                         "--steps", ",".join(map(str, steps)), "--repeats", "1", "--chain", "3",
                         "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [row["batch"] for row in result["rows"]] == batches and result["context"] == context
    for row in result["rows"]:
        assert row["plain_ms"] > 0
        for k in steps:
            assert row[f"spec{k}_ms"] > 0 and row[f"spec{k}_step_ms"] > 0
            assert row[f"spec{k}_inorder_ms"] > 0 and row[f"spec{k}_ahead_ms"] > 0
            assert row[f"spec{k}_ahead_gain"] == pytest.approx(row[f"spec{k}_inorder_ms"] / row[f"spec{k}_ahead_ms"])
            for a in bench.ACCEPT_LENGTHS:
                key = f"spec{k}_speedup_at_{a}"
                assert (key in row) == (a <= k + 1)
                if key in row:
                    assert row[key] == pytest.approx(a * row["plain_ms"] / row[f"spec{k}_ms"])
        floor = row["floor"]
        assert floor["batch"] == row["batch"]
        for k in steps:
            assert floor[f"spec{k}_gb"] >= floor["plain_gb"] > 0  # a verify reads at least a plain step's
