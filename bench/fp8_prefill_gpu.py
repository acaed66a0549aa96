"""FP8 prefill kernels in one GPU call: every variant checked, then timed, at V2-Lite's and V3's shapes.

    python bench/fp8_prefill_gpu.py --out $OUT            # one H100/H200, well under 8 minutes
    python bench/fp8_prefill_gpu.py --tiny --out /tmp     # CPU, Triton's interpreter: checks the script

Parts (`--parts`, each written to `<out>/fp8_prefill.json` as soon as it ends):
- `quant`: the per-token-group activation quantisation, 1 group per program (the old launch) against
  `GROUPS_PER_PROGRAM`; the bytes must be equal; GB/s of bf16 read + e4m3 and scales written.
- `linear`: the FP8 linear layers of V2-Lite and V3 for M = 128..8192: bf16 `F.linear` on the
  dequantised weight; the shipped FP8 backend (`FP8_GEMM_BACKENDS["triton"]`: Triton below
  `CUBLAS_MIN_ROWS`, torch's cuBLAS blockwise above); Triton quant + GEMM at its default tile and the
  best of `linear_tiles()` (GEMM alone); torch's blockwise `scaled_mm` (quant + GEMM); DeepGEMM where
  `import deep_gemm` works.
- `norm_quant`, `qk_split` (bench/fusion_parts.py): RMSNorm fused with the FP8 quantisation, and
  MHA prefill reading q/k's rope parts apart, each against the path it replaces.
- `post_norm_quant`, `tp_norm_quant`, `mla_route` (bench/norm_route_parts.py): the post-attention norm
  fused into a dense gate_up_proj's quantisation; the input norm's packed rows for the TP all-gather;
  MLA decode through Triton and FlashInfer, and which one attention backend "auto"'s route picks.
- `moe`: the routed experts (top-k plus the fused shared experts) for 128..8192 tokens: bf16 Triton
  and `torch._grouped_mm` on the dequantised twin; FP8 Triton at the default tile and at
  `moe_tiles()`; DeepGEMM's grouped GEMM where it imports; a per-expert loop of torch's blockwise `scaled_mm` (a probe: one host sync, 2E GEMM
  launches; torch's grouped scaled GEMM has only row-wise scales on sm90).

The sweeps become `<out>/tile_tables.py` (the fastest tile per shape and row count), which replaces
`model/kernels/tile_tables.py` to make them the kernels' launch tiles on that GPU.

Errors, per variant (relative Frobenius, and the largest |out - ref| over max |ref|): `err` against the
exact FP8 arithmetic (`fp8_ops` / the torch MoE reference with `Fp8ExpertScales`), `twin` against the
dequantised bf16 twin (what issue 21's accuracy target names). Outputs are copied over NaN-filled
buffers, so an unwritten cell shows.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pprint
import subprocess
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

V2_LITE_LINEARS = {"q_proj": (3072, 2048), "kv_a": (576, 2048), "o_proj": (2048, 2048),
                   "dense gate_up": (21888, 2048), "dense down": (2048, 10944)}
V3_LINEARS = {"q_a+kv_a": (2112, 7168), "q_b": (24576, 1536), "o_proj": (7168, 16384),
              "dense gate_up": (36864, 7168), "dense down": (7168, 18432)}
TINY_LINEARS = {"tiny": (96, 256)}
# (routed experts, fused shared, top-k, hidden, moe intermediate)
MOES = {"V2-Lite": (64, 2, 6, 2048, 1408), "V3": (256, 1, 8, 7168, 2048)}
TINY_MOES = {"tiny": (4, 1, 2, 128, 128)}


class Bench:
    def __init__(self, tiny: bool, budget_s: float, models: tuple[str, ...], rows: tuple[int, ...]) -> None:
        self.tiny = tiny
        self.models = models  # which of V2-Lite, V3 (the tiny run has its own)
        self.counts = rows  # M of the linears, tokens of the MoE
        self.save = lambda: None  # main's: writes the JSON so far (a call cut off keeps its rows)
        self.device = "cpu" if tiny else "cuda"
        self.began = time.perf_counter()
        self.budget_s = budget_s

    def over_budget(self) -> bool:
        return time.perf_counter() - self.began > self.budget_s

    def ms(self, fn) -> float:
        if self.tiny:  # the interpreter: one call, to check the path, not the speed
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    poisoned = torch.full(out.shape, float("nan"), dtype=out.dtype, device=out.device)
    poisoned.copy_(out)
    diff = poisoned.double() - ref.double()
    return {"rel": float(diff.norm() / ref.double().norm().clamp_min(1e-30)),
            "max": float(diff.abs().max() / ref.double().abs().max().clamp_min(1e-30))}


def measure(bench: Bench, fn, refs: dict[str, torch.Tensor]) -> dict:
    """Check `fn()` against each reference, then time it; an exception is recorded, not raised."""
    try:
        out = fn()
        row = {name: errors(out, ref) for name, ref in refs.items()}
        row["ms"] = bench.ms(fn)
        return row
    except Exception as exc:  # a variant this torch/GPU cannot run (no blockwise recipe, shared memory)
        return {"error": repr(exc)[:300]}


def random_fp8_weight(n: int, k: int, device: str, lead: tuple[int, ...] = ()):
    """e4m3 values of std ~16 and block scales around 1/800: dequantised std ~0.02, as a model's."""
    w = (torch.randn(*lead, n, k, device=device) * 16).to(torch.float8_e4m3fn)
    scale = torch.rand(*lead, -(-n // 128), -(-k // 128), device=device) * 2.5e-3 + 1.25e-4
    return w, scale


# ---- quant ---------------------------------------------------------------------------------------

def quant_part(bench: Bench, rows: list[dict]) -> None:
    from deepseek_pd.model.kernels.fp8_quant import GROUPS_PER_PROGRAM, per_token_group_quant

    shapes = [(3, 1000)] if bench.tiny else [(4096, 7168), (8192, 7168), (8192, 16384), (8192, 2048)]
    for m, k in shapes:
        x = torch.randn(m, k, device=bench.device, dtype=torch.float32 if bench.tiny else torch.bfloat16)
        one = per_token_group_quant(x, 128, groups_per_program=1)
        row = {"m": m, "k": k}
        for per_program in sorted({1, GROUPS_PER_PROGRAM} if bench.tiny else {1, 4, GROUPS_PER_PROGRAM, 16}):
            q, s = per_token_group_quant(x, 128, groups_per_program=per_program)
            same = torch.equal(q.view(torch.uint8), one[0].view(torch.uint8)) and torch.equal(s, one[1])
            ms = bench.ms(lambda: per_token_group_quant(x, 128, groups_per_program=per_program))
            nbytes = x.numel() * x.element_size() + q.numel() + s.numel() * 4
            row[f"groups_{per_program}"] = {"ms": ms, "GB/s": nbytes / ms / 1e6, "bytes_equal": same}
        rows.append(row)
        bench.save()
        print(f"quant {m}x{k}: " + ", ".join(f"{key} {v['ms']:.3f} ms ({v['GB/s']:.0f} GB/s, equal {v['bytes_equal']})"
                                            for key, v in row.items() if key.startswith("groups")), flush=True)


# ---- linear --------------------------------------------------------------------------------------

def linear_tiles():
    from deepseek_pd.model.kernels.fp8_gemm import Fp8GemmTile

    return [Fp8GemmTile(64, 128, 4, 4), Fp8GemmTile(128, 128, 8, 3), Fp8GemmTile(128, 128, 4, 3),
            Fp8GemmTile(128, 64, 4, 4), Fp8GemmTile(128, 256, 8, 3)]


def deep_gemm_module():
    """`kernels/fp8_deep_gemm.py` where DeepGEMM imports on this GPU, else None."""
    from deepseek_pd.model.kernels import fp8_deep_gemm

    return fp8_deep_gemm if fp8_deep_gemm.deep_gemm_available() else None


def linear_part(bench: Bench, rows: list[dict]) -> None:
    from deepseek_pd.model.kernels import fp8_scaled_mm
    from deepseek_pd.model.kernels.fp8_gemm import block_fp8_matmul, default_tile
    from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
    from deepseek_pd.model.quant.fp8_linear import FP8_GEMM_BACKENDS
    from deepseek_pd.model.quant.fp8_ops import block_fp8_matmul_ref, dequant_weight

    shipped = FP8_GEMM_BACKENDS.build("triton")
    dtype = torch.float32 if bench.tiny else torch.bfloat16
    models = {"tiny": TINY_LINEARS} if bench.tiny else \
        {name: shapes for name, shapes in (("V2-Lite", V2_LITE_LINEARS), ("V3", V3_LINEARS)) if name in bench.models}
    m_values = (5, 40) if bench.tiny else bench.counts
    deep_gemm = None if bench.tiny else deep_gemm_module()
    cublas = not bench.tiny and fp8_scaled_mm.blockwise_scaled_mm_available()
    for model, shapes in models.items():
        for name, (n, k) in shapes.items():
            w, scale = random_fp8_weight(n, k, bench.device)
            w_twin = dequant_weight(w, scale, 128, 128)
            w_bf16 = w_twin.to(dtype)
            for m in m_values:
                if bench.over_budget():
                    rows.append({"model": model, "shape": name, "m": m, "skipped": "budget"})
                    continue
                x = torch.randn(m, k, device=bench.device, dtype=dtype)
                x_fp8, x_scale = per_token_group_quant(x, 128)
                refs = {"err": block_fp8_matmul_ref(x_fp8, x_scale, w, scale, 128, 128, torch.float32),
                        "twin": F.linear(x.float(), w_twin)}
                row = {"model": model, "shape": name, "m": m, "n": n, "k": k,
                       "bf16": measure(bench, lambda: F.linear(x, w_bf16), refs),
                       "shipped": measure(bench, lambda: shipped(x, w, scale, 128, 128), refs),
                       "quant_ms": bench.ms(lambda: per_token_group_quant(x, 128)),
                       "triton_default": measure(bench, lambda: block_fp8_matmul(
                           *per_token_group_quant(x, 128), w, scale, 128, 128, dtype), refs),
                       "default_tile": str(default_tile(m))}
                if m >= 2048 or bench.tiny:  # the GEMM alone, per tile (add quant_ms for the layer)
                    row["tiles"] = {str(t): {**measure(bench, lambda t=t: block_fp8_matmul(
                        x_fp8, x_scale, w, scale, 128, 128, dtype, t), {"err": refs["err"]}), "fields": asdict(t)}
                        for t in linear_tiles()[: 1 if bench.tiny else None]}
                if cublas and fp8_scaled_mm.fits_blockwise(n, k, 128, 128):
                    row["torch_blockwise"] = measure(bench, lambda: fp8_scaled_mm.scaled_mm_block_fp8(
                        *per_token_group_quant(x, 128), w, scale, dtype), refs)
                if deep_gemm is not None and deep_gemm.fits(n, k, 128, 128):
                    row["deep_gemm"] = measure(bench, lambda: deep_gemm.dense(*per_token_group_quant(x, 128), w, scale,
                                                                              dtype), refs)
                rows.append(row)
                bench.save()
                print(linear_line(row), flush=True)
            del w, scale, w_twin, w_bf16
            if not bench.tiny:
                torch.cuda.empty_cache()


def linear_line(row: dict) -> str:
    return _line(f"{row['model']} {row['shape']} M={row['m']}: bf16", row, "bf16",
                 ("shipped", "triton_default", "torch_blockwise", "deep_gemm"), row.get("tiles", {}),
                 lambda best, ms: f"best tile {best} {ms:.3f} + quant {row['quant_ms']:.3f}")


def _line(head: str, row: dict, base_key: str, keys: tuple[str, ...], tiles: dict, best_tile) -> str:
    """One printed row: the baseline's time, each variant's time, speed-up and errors (or its error
    message), then the fastest tile as `best_tile(tile, ms)` words it."""
    base = row[base_key].get("ms")
    parts = [f"{head} {base:.3f} ms" if base else f"{base_key} failed"]
    for key in keys:
        v = row.get(key)
        if v is None:
            continue
        speed_up = f"{base / v['ms']:.2f}x, " if base and "ms" in v else ""
        parts.append(f"{key} {v['ms']:.3f} ({speed_up}err {v['err']['rel']:.1e}, twin {v['twin']['rel']:.1e})"
                     if "ms" in v else f"{key} {v['error'][:80]}")
    timed = {t: v["ms"] for t, v in tiles.items() if "ms" in v}
    if timed:
        best = min(timed, key=timed.get)
        parts.append(best_tile(best, timed[best]))
    return "; ".join(parts)


# ---- moe -----------------------------------------------------------------------------------------

def moe_tiles():
    from deepseek_pd.model.kernels.fused_moe import MoETile

    # block_k is the FP8 scale group (128) whatever is written here. The gate_up kernel keeps two
    # accumulators (gate, up) plus each step's rescaled product: 128x128 tiles may spill at 4 warps.
    return [MoETile(64, 128, 128, 4, 3), MoETile(64, 128, 128, 8, 3), MoETile(64, 128, 128, 4, 4),
            MoETile(128, 128, 128, 8, 3), MoETile(128, 64, 128, 4, 3), MoETile(64, 64, 128, 4, 3),
            MoETile(64, 64, 128, 4, 4)]


def moe_cublas_loop(hidden, topk_ids, topk_weights, w13, w2, scales):
    """Probe: the experts as one blockwise `scaled_mm` per expert hit over expert-sorted rows."""
    from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
    from deepseek_pd.model.kernels.fp8_scaled_mm import scaled_mm_block_fp8

    num_experts, two_inter, _ = w13.shape
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)
    counts = torch.bincount(torch.where(valid, flat, num_experts), minlength=num_experts + 1).tolist()
    used = sum(counts[:num_experts])
    tokens = order[:used] // top_k
    x_fp8, x_scale = per_token_group_quant(hidden, 128)
    x_fp8, x_scale = x_fp8[tokens], x_scale[tokens]

    def per_expert(rows_fp8, rows_scale, weight, weight_scale, columns: int) -> torch.Tensor:
        """One blockwise GEMM per expert over its run of the expert-sorted rows."""
        out = torch.empty(used, columns, dtype=hidden.dtype, device=hidden.device)
        start = 0
        for expert, count in enumerate(counts[:num_experts]):
            if count:
                out[start:start + count] = scaled_mm_block_fp8(
                    rows_fp8[start:start + count], rows_scale[start:start + count], weight[expert],
                    weight_scale[expert], hidden.dtype)
            start += count
        return out

    gate, up = per_expert(x_fp8, x_scale, w13, scales.w13_scale, two_inter).chunk(2, dim=-1)
    a_fp8, a_scale = per_token_group_quant((F.silu(gate) * up).contiguous(), 128)
    down = per_expert(a_fp8, a_scale, w2, scales.w2_scale, hidden.shape[1])
    weight = topk_weights.reshape(-1).float()[order[:used]]
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tokens, down.float() * weight[:, None])
    return out.to(hidden.dtype)


def routing(tokens: int, experts: int, shared: int, k: int, device: str):
    ids = torch.rand(tokens, experts, device=device).topk(k, dim=1).indices
    weights = torch.rand(tokens, k, device=device)
    ids = torch.cat([ids, torch.arange(experts, experts + shared, device=device).expand(tokens, -1)], dim=1)
    weights = torch.cat([weights, torch.ones(tokens, shared, device=device)], dim=1)
    return ids, weights


def moe_part(bench: Bench, rows: list[dict]) -> None:
    from deepseek_pd.model.kernels import fp8_scaled_mm
    from deepseek_pd.model.kernels.fused_moe import default_tile, fused_moe
    from deepseek_pd.model.moe import MOE_BACKENDS
    from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
    from deepseek_pd.model.quant.fp8_ops import dequant_weight
    from deepseek_pd.model.quant.moe_scales import Fp8ExpertScales

    dtype = torch.float32 if bench.tiny else torch.bfloat16
    block = Fp8BlockQuantConfig(128, 128)
    reference = MOE_BACKENDS.build("torch")
    grouped = MOE_BACKENDS.build("grouped") if "grouped" in MOE_BACKENDS.names() and not bench.tiny else None
    cublas = not bench.tiny and fp8_scaled_mm.blockwise_scaled_mm_available()
    deep_gemm = None if bench.tiny else deep_gemm_module()
    token_counts = (3, 20) if bench.tiny else bench.counts
    moes = TINY_MOES if bench.tiny else {name: shape for name, shape in MOES.items() if name in bench.models}
    for model, (experts, shared, k, hidden, inter) in moes.items():
        total = experts + shared
        w13, s13 = random_fp8_weight(2 * inter, hidden, bench.device, (total,))
        w2, s2 = random_fp8_weight(hidden, inter, bench.device, (total,))
        scales = Fp8ExpertScales(s13, block, s2, block)
        twin13 = torch.empty(w13.shape, dtype=dtype, device=bench.device)
        twin2 = torch.empty(w2.shape, dtype=dtype, device=bench.device)
        for e in range(total):  # one expert at a time: V3's fp32 intermediates would not fit at once
            twin13[e] = dequant_weight(w13[e], s13[e], 128, 128)
            twin2[e] = dequant_weight(w2[e], s2[e], 128, 128)
        for tokens in token_counts:
            if bench.over_budget():
                rows.append({"model": model, "tokens": tokens, "skipped": "budget"})
                continue
            x = torch.randn(tokens, hidden, device=bench.device, dtype=dtype)
            ids, weights = routing(tokens, experts, shared, k, bench.device)
            refs = {"err": reference(x, ids, weights, w13, w2, scales), "twin": reference(x, ids, weights, twin13, twin2)}
            row = {"model": model, "tokens": tokens, "pairs": ids.numel(), "shape": f"E{total}xN{inter}xK{hidden}-fp8",
                   "default_tile": str(default_tile(ids.numel(), total)),
                   "default_fields": asdict(default_tile(ids.numel(), total)),
                   "bf16_triton": measure(bench, lambda: fused_moe(x, ids, weights, twin13, twin2), refs),
                   "fp8_triton": measure(bench, lambda: fused_moe(x, ids, weights, w13, w2, scales=scales), refs)}
            if grouped is not None:
                row["bf16_grouped"] = measure(bench, lambda: grouped(x, ids, weights, twin13, twin2), refs)
            if tokens >= 2048 or bench.tiny:
                row["fp8_tiles"] = {str(t): {**measure(bench, lambda t=t: fused_moe(x, ids, weights, w13, w2, t,
                                                                           scales=scales), {"err": refs["err"]}),
                                             "fields": asdict(t)}
                                    for t in moe_tiles()[: 1 if bench.tiny else None]}
            if deep_gemm is not None:
                row["fp8_deep_gemm"] = measure(bench, lambda: deep_gemm.grouped_moe(x, ids, weights, w13, w2, scales),
                                               refs)
            if cublas and tokens >= 512:
                row["fp8_cublas_loop"] = measure(bench, lambda: moe_cublas_loop(x, ids, weights, w13, w2, scales), refs)
            rows.append(row)
            bench.save()
            print(moe_line(row), flush=True)
        del w13, s13, w2, s2, twin13, twin2, scales
        if not bench.tiny:
            torch.cuda.empty_cache()


def moe_line(row: dict) -> str:
    return _line(f"moe {row['model']} N={row['tokens']}: bf16 triton", row, "bf16_triton",
                 ("bf16_grouped", "fp8_triton", "fp8_deep_gemm", "fp8_cublas_loop"), row.get("fp8_tiles", {}),
                 lambda best, ms: f"best fp8 tile {best} {ms:.3f}")


# ---- tile tables ---------------------------------------------------------------------------------

def tile_tables(results: dict) -> dict:
    """`model/kernels/tile_tables.py`'s TABLES from this run's sweeps: per shape, the fastest tile at
    each swept row count (the FP8 MoE's default tile competes too)."""
    from deepseek_pd.model.kernels.tile_table import check, ranges

    best: dict[tuple[str, str], dict[int, tuple[float, dict]]] = {}

    def offer(kernel: str, shape: str, rows: int, ms: float, fields: dict) -> None:
        current = best.setdefault((kernel, shape), {}).get(rows)
        if current is None or ms < current[0]:
            best[(kernel, shape)][rows] = (ms, fields)

    for row in results.get("linear", {}).get("rows", []):
        for tile in row.get("tiles", {}).values():
            if "ms" in tile:
                offer("fp8_gemm", f"{row['n']}x{row['k']}", row["m"], tile["ms"], tile["fields"])
    for row in results.get("moe", {}).get("rows", []):
        if "fp8_tiles" not in row:
            continue
        if "ms" in row["fp8_triton"]:
            offer("fused_moe", row["shape"], row["pairs"], row["fp8_triton"]["ms"], row["default_fields"])
        for tile in row["fp8_tiles"].values():
            if "ms" in tile:
                offer("fused_moe", row["shape"], row["pairs"], tile["ms"], tile["fields"])
    tables: dict = {}
    for (kernel, shape), by_rows in best.items():
        tables.setdefault(kernel, {}).setdefault(results["device"], {})[shape] = \
            ranges({rows: fields for rows, (_, fields) in by_rows.items()})
    check(tables)
    return tables


def write_tile_tables(tables: dict, path: Path, results: dict) -> None:
    path.write_text(f'''"""Measured launch tiles (data only; `tile_table.py` reads it), written by
bench/fp8_prefill_gpu.py on {results["device"]} at commit {results["commit"]}, torch {results["torch"]}.
"""
TABLES: dict[str, dict[str, dict[str, list]]] = {pprint.pformat(tables, width=110, sort_dicts=True)}
''')


# ---- main ----------------------------------------------------------------------------------------

def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for fp8_prefill.json")
    parser.add_argument("--parts", default="quant,norm_quant,qk_split,post_norm_quant,tp_norm_quant,mla_route,linear,moe")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="time no new shape after this many seconds (the GPU call is capped)")
    parser.add_argument("--models", default="V2-Lite,V3", help="shapes of these models")
    parser.add_argument("--rows", default="128,512,2048,4096,8192", help="M of the linears, tokens of the MoE")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    args = parser.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported (triton.jit reads it)
    bench = Bench(args.tiny, args.budget_s, tuple(args.models.split(",")), tuple(int(v) for v in args.rows.split(",")))
    torch.manual_seed(int(time.time()))
    results: dict = {"device": torch.cuda.get_device_name() if not args.tiny else "cpu (tiny)",
                     "torch": torch.__version__, "commit": commit(),
                     "deep_gemm": importlib.util.find_spec("deep_gemm") is not None}
    from fusion_parts import norm_quant_part, qk_split_part  # beside this script (its folder is on sys.path)
    from norm_route_parts import mla_route_part, post_norm_quant_part, tp_norm_quant_part

    parts = {"quant": quant_part, "norm_quant": norm_quant_part, "qk_split": qk_split_part,
             "post_norm_quant": post_norm_quant_part, "tp_norm_quant": tp_norm_quant_part, "mla_route": mla_route_part,
             "linear": linear_part, "moe": moe_part}
    out = Path(args.out) / "fp8_prefill.json"
    tables_path = Path(args.out) / "tile_tables.py"

    def save() -> None:
        out.write_text(json.dumps(results, indent=1))
        write_tile_tables(tile_tables(results), tables_path, results)
    bench.save = save
    for name in [p for p in args.parts.split(",") if p]:
        start = time.perf_counter()
        results[name] = {"rows": []}
        try:
            with torch.inference_mode():
                parts[name](bench, results[name]["rows"])
        except Exception as exc:  # keep the other parts' numbers when one fails
            traceback.print_exc()
            results[name]["error"] = repr(exc)
        results[name]["wall_s"] = time.perf_counter() - start
        print(f"part {name}: {results[name]['wall_s']:.1f} s", flush=True)
        save()
    save()
    tables = tile_tables(results)
    print(f"tile tables for {', '.join(tables) or 'no kernel'}: {tables_path} "
          "(copy over model/kernels/tile_tables.py to use them)")
    failed = [name for name in parts if "error" in results.get(name, {})]
    print(f"wrote {out}; parts failed: {failed or 'none'}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
