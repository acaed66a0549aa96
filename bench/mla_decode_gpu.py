"""MLA decode on one GPU: our Triton kernel against FlashInfer's and FlashMLA's sm90 kernels, and
issue 21's targets.

For each shape (V3: 128 heads; V2-Lite: 16 heads; latent 512 + rope 64, page 64, bf16) and batch,
one run times:
- `triton`: our kernel (`model/kernels/mla_decode.py`, default tile);
- `flashinfer`: FlashInfer's planned kernel (`model/kernels/flashinfer_mla.py`), run only, and its
  host plan (once per batch, shared by all layers) apart;
- `flashmla`: FlashMLA's dense kernel (`model/kernels/flashmla_mla.py`, built by
  bench/flashmla_build.sh), a layer's run with the batch's metadata already computed, and a
  batch's first run (the metadata kernel and the host work included) apart;
and checks each against the torch reference (relative error; FlashInfer writes into a NaN-poisoned
output). FLOP/s and GB/s are read against the card's dense bf16 peak and HBM bandwidth. A library
that is not installed is left out of the row, with the reason.

It then prints, per head count and library, the smallest batch from which the library's per-batch
cost + one run per layer beats Triton's per-layer runs (the `MLADecodeRoute` tables,
model/kernels/mla_decode_route.py), and the targets of issue 21 with value, target, ratio and
PASS/MISS (the best kernel of each row), the card and the commit. JSON lines go to --out.

Usage (GPU): python bench/mla_decode_gpu.py --out /tmp/mla.json; `--tiny` runs a few small shapes.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_batch import random_decode_batch  # noqa: E402

RANK, ROPE, PAGE = 512, 64, 64
# Card name fragment → (dense bf16 FLOP/s, HBM bytes/s): FACTS.md.
CARDS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12)}
LAYERS = {128: 61, 16: 27}  # decoder layers per step that reuse one plan (V3, V2-Lite)
LIBRARIES = ("flashinfer", "flashmla")
# A library's cost paid once per batch, shared by every layer: FlashInfer's host plan, FlashMLA's
# first run (its metadata) less a later layer's run.
ONCE_PER_BATCH = {"flashinfer": lambda r: r["plan_ms"], "flashmla": lambda r: max(0.0, r["first_ms"] - r["ms"])}


def card_peaks() -> tuple[str, float, float]:
    name = torch.cuda.get_device_name()
    for key, (flops, bw) in CARDS.items():
        if key in name:
            return name, flops, bw
    return name, CARDS["H100"][0], CARDS["H100"][1]


def timed_ms(fn, reps: int = 50) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def decode_case(heads: int, lengths: list[int]):
    batch, cache = random_decode_batch(lengths, PAGE, RANK + ROPE)
    b = len(lengths)
    q_latent = torch.randn(heads, b, RANK, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    q_pe = torch.randn(b, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    return batch, cache, q_latent, q_pe


def _rates(flops: float, nbytes: float, ms: float, flops_peak: float, bw_peak: float) -> dict:
    return {"TFLOPs": flops / ms / 1e9, "GBs": nbytes / ms / 1e6, "peak_frac": flops / ms / 1e-3 / flops_peak,
            "hbm_frac": nbytes / ms / 1e-3 / bw_peak}


def _host_ms(fn, reps: int = 5) -> float:
    """The median wall time of `fn` with the device drained before and after (host work included)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[reps // 2]


def _flashinfer(batch, cache, q_latent, q_pe, heads: int, scale: float) -> dict:
    from deepseek_pd.model.kernels.flashinfer_mla import flashinfer_mla_available, plan_decode

    if not flashinfer_mla_available():
        raise RuntimeError("flashinfer not available here")
    lengths = batch.seq_lens

    def plan():
        return plan_decode(batch.page_table, lengths, heads, RANK, ROPE, PAGE, scale, torch.bfloat16,
                           page_lists=batch.page_lists)

    planned = plan()
    out = torch.full((len(lengths), heads, RANK), float("nan"), dtype=torch.bfloat16, device="cuda")
    planned.run(q_latent, q_pe, cache, out=out)
    return {"ms": timed_ms(lambda: planned.run(q_latent, q_pe, cache, out=out)), "plan_ms": _host_ms(plan),
            "nan_rows": int(torch.isnan(out).any(-1).sum()), "out": out}


def _flashmla(batch, cache, q_latent, q_pe, heads: int, scale: float) -> dict:
    from deepseek_pd.model.attention.triton_backend import decode_metadata
    from deepseek_pd.model.kernels.flashmla_mla import MLADecodeCall, flashmla_available

    if not flashmla_available():
        raise RuntimeError("flashmla not available here (bench/flashmla_build.sh builds it)")
    table, seq_lens, _ = decode_metadata(batch)
    call = MLADecodeCall(table, seq_lens, heads, scale)
    out = call.run(q_latent, q_pe, cache)  # the first layer: fills the batch's metadata
    return {"ms": timed_ms(lambda: call.run(q_latent, q_pe, cache)),
            "first_ms": _host_ms(lambda: MLADecodeCall(table, seq_lens, heads, scale).run(q_latent, q_pe, cache)),
            "out": out}


def measure(heads: int, lengths: list[int], flops_peak: float, bw_peak: float, with_reference: bool) -> dict:
    from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend
    from deepseek_pd.model.attention.triton_backend import decode_metadata
    from deepseek_pd.model.kernels.mla_decode import mla_decode

    batch, cache, q_latent, q_pe = decode_case(heads, lengths)
    scale = 192 ** -0.5
    tokens = sum(lengths)
    nbytes = tokens * (RANK + ROPE) * 2 + 2 * q_latent.numel() * 2 + q_pe.numel() * 2
    flops = 2.0 * heads * tokens * (2 * RANK + ROPE)
    row = {"heads": heads, "batch": len(lengths), "sum_context": tokens, "max_context": max(lengths)}
    ref = TorchAttentionBackend().mla_decode(q_latent, q_pe, cache, batch, RANK, scale) if with_reference else None

    table, seq_lens, max_len = decode_metadata(batch)
    ms = timed_ms(lambda: mla_decode(q_latent, q_pe, cache, table, seq_lens, max_len, scale))
    row["triton"] = {"ms": ms, **_rates(flops, nbytes, ms, flops_peak, bw_peak)}
    if ref is not None:
        row["triton"]["rel_err"] = rel_err(mla_decode(q_latent, q_pe, cache, table, seq_lens, max_len, scale), ref)

    for library, timing in (("flashinfer", _flashinfer), ("flashmla", _flashmla)):
        try:
            row[library] = timing(batch, cache, q_latent, q_pe, heads, scale)
        except Exception as exc:  # recorded, not fatal: the other kernels' figures still stand
            row[f"{library}_error"] = repr(exc)[:400]
            continue
        out = row[library].pop("out")
        row[library].update(_rates(flops, nbytes, row[library]["ms"], flops_peak, bw_peak))
        if ref is not None:
            row[library]["rel_err"] = rel_err(out, ref)
    del batch, cache
    torch.cuda.empty_cache()
    return row


def best(row: dict, key: str) -> float:
    cands = [row[k][key] for k in ("triton", *LIBRARIES) if k in row and row[k].get("rel_err", 0) < 2e-2]
    return max(cands) if cands else 0.0


def route_table(rows: list[dict]) -> dict:
    """Per library and head count: the smallest batch from which its once-per-batch cost + LAYERS
    runs beat Triton's LAYERS runs, and from which every larger batch measured does too."""
    out = {}
    for library in LIBRARIES:
        for heads in sorted({r["heads"] for r in rows if r.get("kind") == "sweep"}):
            wins = []
            for r in sorted((r for r in rows if r.get("kind") == "sweep" and r["heads"] == heads),
                            key=lambda r: r["batch"]):
                if library not in r:
                    continue
                layers = LAYERS.get(heads, 61)
                lib_ms = ONCE_PER_BATCH[library](r[library]) + layers * r[library]["ms"]
                wins.append((r["batch"], lib_ms < layers * r["triton"]["ms"], lib_ms, layers * r["triton"]["ms"]))
            first = next((b for b, w, _, _ in wins if w and all(w2 for b2, w2, _, _ in wins if b2 >= b)), None)
            out[f"{library} {heads}"] = {"library": library, "heads": heads, "min_batch": first, "per_batch": wins}
    return out


def targets(rows: list[dict]) -> list[dict]:
    def pick(kind, heads, batch=None):
        return [r for r in rows if r.get("kind") == kind and r["heads"] == heads
                and (batch is None or r["batch"] == batch)]

    checks = []
    big = pick("sweep", 128, 128)
    if big:
        checks.append(("MLA decode, 128 heads, bs 128, ~2.3k ctx: fraction of dense bf16 peak",
                       best(big[0], "peak_frac"), 0.55))
    long = pick("long", 128)
    if long:
        checks.append(("MLA decode, 128 heads, bs 1-8, 2k-32k ctx: worst fraction of HBM",
                       min(best(r, "hbm_frac") for r in long), 0.70))
    v2 = pick("sweep", 16, 128)
    if v2:
        checks.append(("MLA decode, 16 heads, bs 128: fraction of HBM", best(v2[0], "hbm_frac"), 0.85))
    return [{"check": c, "value": v, "target": t, "ratio": v / t, "result": "PASS" if v >= t else "MISS"}
            for c, v, t in checks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mla_decode.json")
    parser.add_argument("--tiny", action="store_true", help="a few small shapes (a smoke run)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    random.seed(seed)
    torch.manual_seed(seed)
    name, flops_peak, bw_peak = card_peaks()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    batches = (1, 8, 32) if args.tiny else (1, 2, 4, 8, 16, 32, 64, 128)
    cases = [("sweep", h, [random.randint(1500, 3100) for _ in range(b)]) for h in (128, 16) for b in batches]
    long_ctx = (2048,) if args.tiny else (2048, 8192, 32768)
    cases += [("long", 128, [ctx] * b) for b in ((1, 4) if args.tiny else (1, 2, 4, 8)) for ctx in long_ctx]
    rows = []
    with open(args.out, "w") as sink:
        for kind, heads, lengths in cases:
            row = {"kind": kind, **measure(heads, lengths, flops_peak, bw_peak, with_reference=sum(lengths) < 400_000)}
            rows.append(row)
            sink.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
        routes = route_table(rows)
        checks = targets(rows)
        sink.write(json.dumps({"routes": routes, "targets": checks, "card": name, "commit": commit}) + "\n")
    print(f"\n{name}, commit {commit}")
    print(f"{'kind':<6} {'H':>4} {'bs':>4} {'ctx':>8} {'triton ms':>10} {'TF/s':>6} {'fi ms':>8} {'TF/s':>6} "
          f"{'plan ms':>8} {'mla ms':>8} {'TF/s':>6} {'GB/s':>6} {'1st ms':>7} {'err t/fi/mla':>23}")
    nan = float("nan")
    for r in rows:
        t, f, m = r["triton"], r.get("flashinfer", {}), r.get("flashmla", {})
        print(f"{r['kind']:<6} {r['heads']:>4} {r['batch']:>4} {r['sum_context']:>8} {t['ms']:>10.4f} "
              f"{t['TFLOPs']:>6.0f} {f.get('ms', nan):>8.4f} {f.get('TFLOPs', nan):>6.0f} {f.get('plan_ms', nan):>8.3f} "
              f"{m.get('ms', nan):>8.4f} {m.get('TFLOPs', nan):>6.0f} {m.get('GBs', nan):>6.0f} "
              f"{m.get('first_ms', nan):>7.3f} "
              f"{t.get('rel_err', nan):.1e}/{f.get('rel_err', nan):.1e}/{m.get('rel_err', nan):.1e}")
    for route in routes.values():
        heads = route["heads"]
        print(f"route, {route['library']} at {heads} heads: from batch {route['min_batch']} (once per batch + "
              f"{LAYERS.get(heads, 61)} layers vs Triton)")
    for library in LIBRARIES:
        errors = {r.get(f"{library}_error") for r in rows} - {None}
        if errors:
            print(f"{library}: left out ({'; '.join(sorted(errors))[:300]})")
    print(f"\nissue 21 MLA targets ({name}, commit {commit}); ratio = value / target")
    for c in checks:
        print(f"{c['check']:<72} {c['value']:>7.3f} {c['target']:>6} {c['ratio']:>6.2f}  {c['result']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
