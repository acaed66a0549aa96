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
`--tiny`: small fp32 shapes on the CPU through Triton's interpreter (the script's own test).
The serving cost end to end is bench/serving_session.sh run twice, with and without
--worker-args "--deterministic" (docs/deterministic.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

@dataclass(frozen=True)
class Scale:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    rows: tuple[int, ...] = (1, 8, 32, 128, 512, 2048, 8192)
    # (K, N) of V2-Lite's dense products
    gemm_shapes: dict = field(default_factory=lambda: {
        "q_proj": (2048, 3072), "o_proj": (2048, 2048), "dense_gate_up": (2048, 21888), "lm_head": (2048, 102400)})
    moe: dict = field(default_factory=lambda: dict(experts=66, top_k=8, hidden=2048, inter=1408))  # + 2 fused shared
    mla: dict = field(default_factory=lambda: dict(heads=16, rank=512, rope=64, page=64, max_len=2048))
    mla_batches: tuple[int, ...] = (1, 8, 32, 128)


TINY = Scale(device="cpu", dtype=torch.float32, rows=(1, 5, 70), gemm_shapes={"small": (96, 80)},
             moe=dict(experts=6, top_k=3, hidden=128, inter=64),
             mla=dict(heads=16, rank=64, rope=16, page=8, max_len=600), mla_batches=(1, 4))


def timed_ms(fn, device: str) -> float:
    if device != "cuda":  # the interpreter: one run, for the table's shape only
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3
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


def gemm_cases(rng: random.Random, scale: Scale):
    from deepseek_pd.model.kernels.matmul_invariant import matmul_invariant

    dev, dt = scale.device, scale.dtype
    for name, (k, n) in scale.gemm_shapes.items():
        w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
        for m in scale.rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            base = lambda rows: F.linear(rows, w)  # noqa: E731
            inv = lambda rows: matmul_invariant(rows.unsqueeze(0), w.t().unsqueeze(0))[0]  # noqa: E731
            make = lambda a, b: x[a:b]  # noqa: E731
            yield dict(part="gemm", case=f"{name} {k}x{n}", rows=m, base_ms=timed_ms(lambda: base(x), dev),
                       inv_ms=timed_ms(lambda: inv(x), dev), inv=row_invariant(inv, make, m, rng),
                       base=row_invariant(base, make, m, rng) if m > 1 else None)


def moe_cases(rng: random.Random, scale: Scale):
    from deepseek_pd.model.kernels.fused_moe import fused_moe

    dev, dt = scale.device, scale.dtype
    e, k, h, i = (scale.moe[key] for key in ("experts", "top_k", "hidden", "inter"))
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=dt) / h ** 0.5
    w2 = torch.randn(e, h, i, device=dev, dtype=dt) / i ** 0.5
    for m in scale.rows:
        x = torch.randn(m, h, device=dev, dtype=dt)
        ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(m)])
        weights = torch.rand(m, k, device=dev)
        base = lambda a, b: fused_moe(x[a:b], ids[a:b], weights[a:b], w13, w2)  # noqa: E731
        inv = lambda a, b: fused_moe(x[a:b], ids[a:b], weights[a:b], w13, w2, invariant=True)  # noqa: E731
        yield dict(part="moe", case=f"E{e} top{k} {h}x{i}", rows=m, base_ms=timed_ms(lambda: base(0, m), dev),
                   inv_ms=timed_ms(lambda: inv(0, m), dev),
                   inv=row_invariant(lambda r: inv(*r), lambda a, b: (a, b), m, rng),
                   base=row_invariant(lambda r: base(*r), lambda a, b: (a, b), m, rng) if m > 1 else None)


def mla_cases(rng: random.Random, scale: Scale):
    from deepseek_pd.model.kernels.mla_decode import INVARIANT_DECODE_TILE, MLADecodeTile, mla_decode

    dev, dt = scale.device, scale.dtype
    heads, rank, rope, page, max_len = (scale.mla[key] for key in ("heads", "rank", "rope", "page", "max_len"))
    for batch in scale.mla_batches:
        lengths = [rng.randrange(64, max_len) for _ in range(batch)]
        need = [-(-n // page) for n in lengths]
        cache = torch.randn(sum(need) + 1, page, rank + rope, device=dev, dtype=dt)
        table = torch.zeros(batch, max(need), dtype=torch.int32, device=dev)
        start = 0
        for row, n in enumerate(need):
            table[row, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        q = torch.randn(batch, heads, rank, device=dev, dtype=dt)
        q_pe = torch.randn(batch, heads, rope, device=dev, dtype=dt)

        def run(a: int, b: int, tile: MLADecodeTile):
            return mla_decode(q[a:b], q_pe[a:b], cache, table[a:b], seq_lens[a:b], max(lengths[a:b]), 192 ** -0.5,
                              tile=tile)

        default = MLADecodeTile()
        yield dict(part="mla", case=f"{heads} heads, ctx {min(lengths)}-{max(lengths)}", rows=batch,
                   base_ms=timed_ms(lambda: run(0, batch, default), dev),
                   inv_ms=timed_ms(lambda: run(0, batch, INVARIANT_DECODE_TILE), dev),
                   inv=row_invariant(lambda r: run(*r, INVARIANT_DECODE_TILE), lambda a, b: (a, b), batch, rng),
                   base=row_invariant(lambda r: run(*r, default), lambda a, b: (a, b), batch, rng)
                   if batch > 1 else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="gemm,moe,mla")
    parser.add_argument("--tiny", action="store_true", help="small fp32 shapes on the CPU (Triton's interpreter)")
    args = parser.parse_args()
    scale = TINY if args.tiny else Scale()
    if args.tiny:  # before the kernel modules import triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    card = torch.cuda.get_device_name() if scale.device == "cuda" else "cpu (Triton interpreter)"
    print(f"card: {card}  commit: {commit}")
    rng = random.Random(25)
    parts = {"gemm": gemm_cases, "moe": moe_cases, "mla": mla_cases}
    print(f"{'part':5} {'case':34} {'rows':>5} {'default ms':>11} {'determ. ms':>11} {'cost':>6}  inv  base")
    failed = False
    with args.out.open("w") as out:
        for part in args.parts.split(","):
            for row in parts[part](rng, scale):
                row.update(card=card, commit=commit, cost=row["inv_ms"] / max(row["base_ms"], 1e-9))
                out.write(json.dumps(row) + "\n")
                failed |= not row["inv"]
                base = "-" if row["base"] is None else ("yes" if row["base"] else "no")
                print(f"{row['part']:5} {row['case']:34} {row['rows']:>5} {row['base_ms']:>11.4f} "
                      f"{row['inv_ms']:>11.4f} {row['cost']:>5.2f}x  {'yes' if row['inv'] else 'NO!'}  {base}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
