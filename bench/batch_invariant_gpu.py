"""What `--deterministic` costs on the GPU, kernel by kernel, and whether its kernels are invariant.

For each of the three kernels it swaps (V2-Lite shapes, bf16), at row counts from decode to prefill:
- dense GEMM: cuBLAS `F.linear` against `kernels/matmul_invariant.py` (one 64x64x64 tile, no split-K);
- fused MoE: `fused_moe` with its per-M tile table against `invariant=True` (pinned tile, slot-order sum);
- MLA decode: the split count chosen by batch size against fixed 256-position splits;
it prints the median time of both, the ratio (the deterministic kernel's cost), and two bit checks:
`inv`: a random row computed inside the batch equals, bit for bit, the row alone and inside a batch
of another size (must be "yes" for the deterministic kernel), and `base`: the same check for the
default kernel ("no" shows the variance the mode removes). One JSON line per case goes to --out;
the card and the commit are printed first.

Usage (GPU): python bench/batch_invariant_gpu.py --out /tmp/bi.jsonl [--parts gemm,moe,mla]
The serving cost end to end is bench/serving_session.sh run twice, with and without
--worker-args "--deterministic" (docs/deterministic.md).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

ROWS = (1, 8, 32, 128, 512, 2048, 8192)
GEMM_SHAPES = {"q_proj": (2048, 3072), "o_proj": (2048, 2048), "dense_gate_up": (2048, 21888),
               "lm_head": (2048, 102400)}  # (K, N) of V2-Lite
MOE = dict(experts=66, top_k=8, hidden=2048, inter=1408)  # 64 routed + 2 fused shared, top-6 + 2
MLA = dict(heads=16, rank=512, rope=64, page=64)


def timed_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def row_invariant(run, make_rows, rows: int, rng: random.Random) -> bool:
    """run(batch of rows) vs the same row alone and inside a smaller batch, bit for bit."""
    full = run(make_rows(0, rows))
    row = rng.randrange(rows)
    alone = run(make_rows(row, row + 1))
    lo = rng.randrange(0, row + 1)
    part = run(make_rows(lo, row + 1))
    return bool(torch.equal(full[row], alone[0]) and torch.equal(full[row], part[row - lo]))


def gemm_cases(rng: random.Random):
    from deepseek_pd.model.kernels.matmul_invariant import matmul_invariant

    for name, (k, n) in GEMM_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = lambda rows: F.linear(rows, w)  # noqa: E731
            inv = lambda rows: matmul_invariant(rows.unsqueeze(0), w.t().unsqueeze(0))[0]  # noqa: E731
            make = lambda a, b: x[a:b]  # noqa: E731
            yield dict(part="gemm", case=f"{name} {k}x{n}", rows=m, base_ms=timed_ms(lambda: base(x)),
                       inv_ms=timed_ms(lambda: inv(x)), inv=row_invariant(inv, make, m, rng),
                       base=row_invariant(base, make, m, rng) if m > 1 else None)


def moe_cases(rng: random.Random):
    from deepseek_pd.model.kernels.fused_moe import fused_moe

    e, k, h, i = MOE["experts"], MOE["top_k"], MOE["hidden"], MOE["inter"]
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i ** 0.5
    for m in ROWS:
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(m)])
        weights = torch.rand(m, k, device="cuda")
        base = lambda a, b: fused_moe(x[a:b], ids[a:b], weights[a:b], w13, w2)  # noqa: E731
        inv = lambda a, b: fused_moe(x[a:b], ids[a:b], weights[a:b], w13, w2, invariant=True)  # noqa: E731
        yield dict(part="moe", case=f"E{e} top{k} {h}x{i}", rows=m, base_ms=timed_ms(lambda: base(0, m)),
                   inv_ms=timed_ms(lambda: inv(0, m)),
                   inv=row_invariant(lambda r: inv(*r), lambda a, b: (a, b), m, rng),
                   base=row_invariant(lambda r: base(*r), lambda a, b: (a, b), m, rng) if m > 1 else None)


def mla_cases(rng: random.Random):
    from deepseek_pd.model.kernels.mla_decode import INVARIANT_DECODE_TILE, MLADecodeTile, mla_decode

    heads, rank, rope, page = MLA["heads"], MLA["rank"], MLA["rope"], MLA["page"]
    for batch in (1, 8, 32, 128):
        lengths = [rng.randrange(64, 2048) for _ in range(batch)]
        need = [-(-n // page) for n in lengths]
        cache = torch.randn(sum(need) + 1, page, rank + rope, device="cuda", dtype=torch.bfloat16)
        table = torch.zeros(batch, max(need), dtype=torch.int32, device="cuda")
        start = 0
        for row, n in enumerate(need):
            table[row, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, rank, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)

        def run(a: int, b: int, tile: MLADecodeTile):
            return mla_decode(q[a:b], q_pe[a:b], cache, table[a:b], seq_lens[a:b], max(lengths[a:b]), 192 ** -0.5,
                              tile=tile)

        default = MLADecodeTile()
        yield dict(part="mla", case=f"{heads} heads, ctx {min(lengths)}-{max(lengths)}", rows=batch,
                   base_ms=timed_ms(lambda: run(0, batch, default)),
                   inv_ms=timed_ms(lambda: run(0, batch, INVARIANT_DECODE_TILE)),
                   inv=row_invariant(lambda r: run(*r, INVARIANT_DECODE_TILE), lambda a, b: (a, b), batch, rng),
                   base=row_invariant(lambda r: run(*r, default), lambda a, b: (a, b), batch, rng)
                   if batch > 1 else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="gemm,moe,mla")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    print(f"card: {torch.cuda.get_device_name()}  commit: {commit}")
    rng = random.Random(25)
    parts = {"gemm": gemm_cases, "moe": moe_cases, "mla": mla_cases}
    print(f"{'part':5} {'case':34} {'rows':>5} {'default ms':>11} {'determ. ms':>11} {'cost':>6}  inv  base")
    failed = False
    with args.out.open("w") as out:
        for part in args.parts.split(","):
            for row in parts[part](rng):
                row.update(card=torch.cuda.get_device_name(), commit=commit, cost=row["inv_ms"] / row["base_ms"])
                out.write(json.dumps(row) + "\n")
                failed |= not row["inv"]
                base = "-" if row["base"] is None else ("yes" if row["base"] else "no")
                print(f"{row['part']:5} {row['case']:34} {row['rows']:>5} {row['base_ms']:>11.4f} "
                      f"{row['inv_ms']:>11.4f} {row['cost']:>5.2f}x  {'yes' if row['inv'] else 'NO!'}  {base}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
