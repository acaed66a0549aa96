"""`bench/mla_decode_gpu.py`'s verdicts, on rows drawn here (the timings themselves need a GPU):
each library's route starts at the smallest batch from which it and every larger batch beat
Triton over a step's layers, its once-per-batch cost counted once (FlashInfer's plan, FlashMLA's
first run less a layer's); a target takes the best kernel of its row whose error is small, so a
wrong fast kernel never passes a target."""
from __future__ import annotations

import random

from pdtest.bench_scripts import bench_module


def _rows(rng: random.Random) -> list[dict]:
    rows = []
    for heads in (128, 16):
        for batch in (1, 2, 4, 8, 16, 32, 64, 128):
            row = {"kind": "sweep", "heads": heads, "batch": batch,
                   "triton": {"ms": rng.uniform(0.01, 1), "peak_frac": rng.random(), "hbm_frac": rng.random()}}
            if rng.random() < 0.9:
                row["flashinfer"] = {"ms": rng.uniform(0.01, 1), "plan_ms": rng.uniform(0, 3), "rel_err": 1e-3,
                                     "peak_frac": rng.random(), "hbm_frac": rng.random()}
            if rng.random() < 0.9:
                row["flashmla"] = {"ms": rng.uniform(0.01, 1), "first_ms": rng.uniform(0, 1),
                                   "rel_err": rng.choice([1e-3, 1e-3, 0.5]), "peak_frac": rng.random(),
                                   "hbm_frac": rng.random()}
            rows.append(row)
    return rows


def test_routes_and_targets_follow_the_rows():
    bench = bench_module("mla_decode_gpu")
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(50):
        rows = _rows(rng)
        routes = bench.route_table(rows)
        for library in bench.LIBRARIES:
            for heads in (128, 16):
                layers = bench.LAYERS[heads]
                timed = [r for r in rows if r["heads"] == heads and library in r]
                once = {"flashinfer": lambda m: m["plan_ms"], "flashmla": lambda m: max(0.0, m["first_ms"] - m["ms"])}
                wins = {r["batch"]: once[library](r[library]) + layers * r[library]["ms"] < layers * r["triton"]["ms"]
                        for r in timed}
                want = min((b for b in wins if all(wins[b2] for b2 in wins if b2 >= b)), default=None)
                assert routes[f"{library} {heads}"]["min_batch"] == want, (library, heads, wins)
        (big,) = [r for r in rows if r["heads"] == 128 and r["batch"] == 128]
        good = [big[k]["peak_frac"] for k in ("triton", "flashinfer", "flashmla")
                if k in big and big[k].get("rel_err", 0) < 2e-2]
        (check, *_) = bench.targets(rows)
        assert check["value"] == max(good) and check["result"] == ("PASS" if max(good) >= 0.55 else "MISS")
