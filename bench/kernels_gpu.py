"""Every kernel against its torch reference and its H200 roofline, in one command; one table last.

Parts (select with --parts; the default is everything but `e2e`):
- `fp8`: block-scaled FP8 GEMM (per-token-group activations) at DeepSeek-V3's linear shapes,
  M = 1 / 64 / 128 / 4096 / 8192, vs the torch reference and vs bf16 `F.linear` (kernel_parts_fp8.py).
- `fp8moe`: the FP8 fused MoE at V3's expert shape (256 top-8 + 1 shared), 1 / 64 / 128 / 4096
  tokens, vs the torch FP8 reference and the bf16 Triton MoE; floor = touched FP8 expert bytes.
- `small`: add+RMSNorm, RoPE + latent-cache write, the 3-launch MoE sort, merge_states, absorbed
  MLA extend over a short prefix, each vs the torch ops it replaces (kernel_parts_small.py).
- `moe`, `mla`, `flash`: the bf16 fused MoE (V2-Lite / V3), MLA decode (16 / 128 heads), flash
  prefill (causal and chunked-prefix), with small tile sweeps.
- `runner`: V2-Lite end to end, bf16 and FP8-kept weights holding the same values: prefill
  1k / 4k / 8k tokens, CUDA-graph decode at batch 1 / 64 / 128, FP8-vs-bf16 logits (kernel_parts_runner.py).
- `e2e`: the V2-Lite runner with torch vs Triton backends and HF transformers' weights (slow).

Every check draws fresh random inputs and reports ‖out−ref‖/‖ref‖ (NaN fails; outputs are copied
over NaN-poisoned buffers); times are `triton.testing.do_bench` medians. Ceilings
(../shared/FACTS.md): 4,136 GB/s copy, 758 TFLOP/s bf16, 1,325 TFLOP/s FP8.

Usage (on the GPU):  python bench/kernels_gpu.py --out kernels.json [--parts fp8,fp8moe,small,runner]
On a CPU:            python bench/kernels_gpu.py --tiny   (tiny shapes through Triton's interpreter)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_batch import random_decode_batch  # noqa: E402
from kernel_table import (BF16_TFLOPS, COPY_GBS, TOL_BF16, Context, Row, Timer,  # noqa: E402
                          floor_ms, format_table)

MOE_SHAPES = {  # routed experts, fused shared, top-k, hidden, intermediate
    "v2lite": (64, 2, 6, 2048, 1408),
    "v3": (256, 1, 8, 7168, 2048),
}
MLA_HEADS = {"v2lite": 16, "v3": 128}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


# ---- MoE -------------------------------------------------------------------------------------------

def _routing(tokens: int, experts: int, shared: int, k: int):
    ids = torch.rand(tokens, experts, device="cuda").topk(k, dim=1).indices
    weights = torch.rand(tokens, k, device="cuda")
    ids = torch.cat([ids, torch.arange(experts, experts + shared, device="cuda").expand(tokens, -1)], dim=1)
    weights = torch.cat([weights, torch.ones(tokens, shared, device="cuda")], dim=1)
    return ids, weights


def moe_part(token_counts: tuple[int, ...] = (1, 128, 8 * 2048)) -> dict:
    from deepseek_pd.model.kernels.fused_moe import MoETile, default_tile, fused_moe
    from deepseek_pd.model.moe import MOE_BACKENDS

    names = [name for name in ("torch", "triton", "grouped") if name in MOE_BACKENDS.names()]
    backends = {name: MOE_BACKENDS.build(name) for name in names}
    sweep = [MoETile(16, 64, 128, 4, 4), MoETile(32, 64, 64, 4, 4), MoETile(64, 128, 64, 8, 3),
             MoETile(128, 128, 64, 8, 3), MoETile(64, 64, 64, 4, 4)]
    rows = []
    for shape, (experts, shared, k, hidden, inter) in MOE_SHAPES.items():
        total = experts + shared
        w13 = torch.randn(total, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
        w2 = torch.randn(total, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter ** 0.5
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            ids, weights = _routing(tokens, experts, shared, k)
            touched = int(torch.unique(ids).numel())  # host work outside the timed region
            weight_bytes = touched * 3 * inter * hidden * 2
            flops = 6.0 * ids.numel() * hidden * inter
            ref = backends["torch"](x, ids, weights, w13, w2)
            row = {"shape": shape, "tokens": tokens, "experts_touched": touched,
                   "tile": str(default_tile(ids.numel(), total))}
            for name, kernel in backends.items():
                out = kernel(x, ids, weights, w13, w2)
                row[f"{name}_rel_err"] = rel_err(out, ref)
                ms = bench_ms(lambda: kernel(x, ids, weights, w13, w2))
                row[f"{name}_ms"] = ms
                row[f"{name}_GBs"] = (weight_bytes + 2 * x.numel() * 2) / ms / 1e6
                row[f"{name}_TFLOPs"] = flops / ms / 1e9
            if tokens > 1:
                best = None
                for tile in sweep:
                    try:
                        err = rel_err(fused_moe(x, ids, weights, w13, w2, tile), ref)
                        ms = bench_ms(lambda: fused_moe(x, ids, weights, w13, w2, tile))
                    except Exception as exc:  # a tile that does not compile (shared memory) is skipped
                        row.setdefault("sweep_errors", []).append(f"{tile}: {exc!r}"[:200])
                        continue
                    row.setdefault("sweep", []).append({"tile": str(tile), "ms": ms, "rel_err": err})
                    if err < TOL_BF16 and (best is None or ms < best[1]):
                        best = (str(tile), ms)
                row["best_tile"] = best
            rows.append(row)
            print(json.dumps(row), flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    return {"rows": rows}


# ---- MLA decode ------------------------------------------------------------------------------------

def mla_part() -> dict:
    from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend
    from deepseek_pd.model.attention.triton_backend import decode_metadata
    from deepseek_pd.model.kernels.mla_decode import MLADecodeTile, mla_decode

    rank, rope, page = 512, 64, 64
    reference = TorchAttentionBackend()
    sweep = [MLADecodeTile(), MLADecodeTile(16, 32, max_splits=32, target_programs=264),
             MLADecodeTile(64, 16, num_warps=8), MLADecodeTile(128, 16, num_warps=8, value_splits=4),
             MLADecodeTile(64, 32, num_warps=4, value_splits=4), MLADecodeTile(64, 32, num_warps=4, value_splits=2)]
    rows = []
    for shape, heads in MLA_HEADS.items():
        for bs in (1, 32, 128):
            lengths = torch.randint(512, 4097, (bs,)).tolist()
            batch, cache = random_decode_batch(lengths, page, rank + rope)
            q_latent = torch.randn(heads, bs, rank, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
            q_pe = torch.randn(bs, heads, rope, device="cuda", dtype=torch.bfloat16)
            scale = 1.0 / (192 ** 0.5)
            ref = reference.mla_decode(q_latent, q_pe, cache, batch, rank, scale)
            table, seq_lens, max_len = decode_metadata(batch)
            nbytes = sum(lengths) * (rank + rope) * 2 + 2 * q_latent.numel() * 2 + q_pe.numel() * 2
            flops = 2.0 * heads * sum(lengths) * (2 * rank + rope)
            row = {"shape": shape, "heads": heads, "batch": bs, "sum_context": sum(lengths), "max_context": max_len}
            ms = bench_ms(lambda: reference.mla_decode(q_latent, q_pe, cache, batch, rank, scale))
            row.update(torch_ms=ms, torch_GBs=nbytes / ms / 1e6)
            for tile in sweep:
                try:
                    out = torch.full_like(ref, float("nan"))  # poison: an unwritten output fails the check
                    out.copy_(mla_decode(q_latent, q_pe, cache, table, seq_lens, max_len, scale, tile))
                    err = rel_err(out, ref)
                    ms = bench_ms(lambda: mla_decode(q_latent, q_pe, cache, table, seq_lens, max_len, scale, tile))
                except Exception as exc:
                    row.setdefault("sweep_errors", []).append(f"{tile}: {exc!r}"[:200])
                    continue
                row.setdefault("sweep", []).append({"tile": str(tile), "ms": ms, "rel_err": err,
                                                    "GBs": nbytes / ms / 1e6, "TFLOPs": flops / ms / 1e9})
            default = row["sweep"][0] if row.get("sweep") else {}
            row.update(triton_ms=default.get("ms"), triton_rel_err=default.get("rel_err"),
                       triton_GBs=default.get("GBs"))
            good = [s for s in row.get("sweep", []) if s["rel_err"] < TOL_BF16]
            row["best"] = min(good, key=lambda s: s["ms"]) if good else None
            rows.append(row)
            print(json.dumps(row), flush=True)
            del cache, batch
            torch.cuda.empty_cache()
    return {"rows": rows}


# ---- MHA prefill (flash) ---------------------------------------------------------------------------

FLASH_CASES = {  # name: (heads, new tokens per sequence, prefix keys per sequence (0 = causal), sequences)
    "v2lite_causal_8x2048": (16, 2048, 0, 8),
    "v3_causal_2x4096": (128, 4096, 0, 2),
    "v2lite_prefix_4x1024_over_4096": (16, 1024, 4096, 4),
}


def flash_part() -> dict:
    from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend
    from deepseek_pd.model.kernels.flash_prefill import FlashTile, flash_attention

    reference = TorchAttentionBackend()
    sweep = [FlashTile(128, 64, 8, 3), FlashTile(128, 128, 8, 3), FlashTile(64, 64, 4, 3), FlashTile(128, 32, 4, 3)]
    rows = []
    for name, (heads, new, prefix, seqs) in FLASH_CASES.items():
        qk, dv, scale = 192, 128, 192 ** -0.5
        q = torch.randn(seqs * new, heads, qk, device="cuda", dtype=torch.bfloat16)
        keys = seqs * (prefix or new)
        k = torch.randn(keys, heads, qk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(keys, heads, dv, device="cuda", dtype=torch.bfloat16)
        qo = tuple(range(0, seqs * new + 1, new))
        kvo = tuple(range(0, keys + 1, prefix or new))
        causal = prefix == 0
        if causal:
            ref, ref_lse = reference.mha_causal(q, k, v, qo, scale)
            flops = 2.0 * seqs * heads * (new * (new + 1) / 2) * (qk + dv)
        else:
            ref, ref_lse = reference.mha_cross(q, k, v, qo, kvo, scale)
            flops = 2.0 * seqs * heads * new * prefix * (qk + dv)
        q_off = torch.tensor(qo, dtype=torch.int32, device="cuda")
        kv_off = torch.tensor(kvo, dtype=torch.int32, device="cuda")
        row = {"case": name, "torch_ms": bench_ms(lambda: (reference.mha_causal(q, k, v, qo, scale) if causal
                                                            else reference.mha_cross(q, k, v, qo, kvo, scale)))}
        row["torch_TFLOPs"] = flops / row["torch_ms"] / 1e9
        for tile in sweep:
            try:
                out, lse = flash_attention(q, k, v, q_off, q_off if causal else kv_off, new, scale, causal, tile)
                err, lse_err = rel_err(out, ref), float((lse - ref_lse).abs().max())
                ms = bench_ms(lambda: flash_attention(q, k, v, q_off, q_off if causal else kv_off, new, scale,
                                                      causal, tile))
            except Exception as exc:
                row.setdefault("sweep_errors", []).append(f"{tile}: {exc!r}"[:200])
                continue
            row.setdefault("sweep", []).append({"tile": str(tile), "ms": ms, "rel_err": err, "lse_max_abs_err": lse_err,
                                                "TFLOPs": flops / ms / 1e9})
        default = row["sweep"][0] if row.get("sweep") else {}
        row.update(triton_ms=default.get("ms"), triton_rel_err=default.get("rel_err"),
                   triton_TFLOPs=default.get("TFLOPs"))
        good = [s for s in row.get("sweep", []) if s["rel_err"] < TOL_BF16]
        row["best"] = min(good, key=lambda s: s["ms"]) if good else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
    return {"rows": rows}


# ---- end to end ------------------------------------------------------------------------------------

@torch.inference_mode()
def e2e_part() -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from model_gpu import V2_LITE, build_ours, build_v2lite, measure_runner

    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    hf, ours_torch = build_v2lite()
    variants = {"torch": ours_torch}
    variants["triton"] = build_ours(hf, attention_backend="triton", moe_backend="triton", num_fused_shared_experts=2)
    del hf
    torch.cuda.empty_cache()
    result: dict = {}
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, V2_LITE["vocab_size"], (64,), generator=gen).tolist()
    logits = {}
    for name, model in variants.items():
        runner = ModelRunner.from_model(model, RunnerConfig(model="<v2lite>", page_size=64, num_pages=4096))
        pages = runner.kv_pool.alloc(2)
        steps = [runner.extend([ExtendSeq(prompt, 0, pages)])[0]]
        for i in range(4):  # teacher-forced decode steps on fixed tokens
            steps.append(runner.decode([DecodeSeq(prompt[i], len(prompt) + i, pages)])[0])
        runner.kv_pool.free(pages)
        logits[name] = steps
        start = time.perf_counter()
        result[name] = measure_runner(runner, torch.Generator().manual_seed(3))
        result[name]["wall_s"] = time.perf_counter() - start
        print(name, json.dumps(result[name]), flush=True)
        del runner
    result["triton_vs_torch_logits_rel_err"] = [rel_err(a.float(), b.float())
                                                for a, b in zip(logits["triton"], logits["torch"])]
    return result


def legacy_rows(results: dict) -> list[Row]:
    """The bf16 MoE / MLA decode / flash parts' JSON rows as table rows."""
    rows = []
    for r in results.get("moe", {}).get("rows", []):
        experts, shared, k, hidden, inter = MOE_SHAPES[r["shape"]]
        nbytes = r["experts_touched"] * 3 * inter * hidden * 2
        flops = 6.0 * r["tokens"] * (k + shared) * hidden * inter
        rows.append(Row("bf16 moe", f"{r['shape']} N={r['tokens']}", "triton", r.get("triton_ms"),
                        floor_ms(flops, nbytes), r.get("triton_rel_err"), "torch", r.get("torch_ms"),
                        f"best {r['best_tile'][0]} {r['best_tile'][1]:.3f}ms" if r.get("best_tile") else ""))
    for r in results.get("mla", {}).get("rows", []):
        ctx = r["sum_context"]
        flops = 2.0 * r["heads"] * ctx * (2 * 512 + 64)
        best = r.get("best") or {}
        rows.append(Row("mla decode", f"{r['shape']} H={r['heads']} bs={r['batch']} ctx={ctx}", "triton",
                        r.get("triton_ms"), floor_ms(flops, ctx * 576 * 2), r.get("triton_rel_err"), "torch",
                        r.get("torch_ms"), f"best {best.get('ms', float('nan')):.3f}ms" if best else ""))
    for r in results.get("flash", {}).get("rows", []):
        default = (r.get("sweep") or [{}])[0]
        flops = default.get("TFLOPs", 0) * default.get("ms", 0) * 1e9
        best = r.get("best") or {}
        rows.append(Row("flash prefill", r["case"], "triton", r.get("triton_ms"), floor_ms(flops) if flops else None,
                        r.get("triton_rel_err"), "torch", r.get("torch_ms"),
                        f"best {best.get('ms', float('nan')):.2f}ms" if best else ""))
    return rows


def e2e_lines(results: dict) -> list[str]:
    e2e = results.get("e2e", {})
    lines = [f"e2e {name}: " + ", ".join(f"{k}={v:.1f}" for k, v in e2e[name].items())
             for name in ("torch", "triton") if name in e2e]
    if "triton_vs_torch_logits_rel_err" in e2e:
        lines.append(f"e2e logits rel err triton vs torch: {e2e['triton_vs_torch_logits_rel_err']}")
    return lines


DEFAULT_PARTS = "fp8,fp8moe,small,moe,mla,flash,runner"
TINY_PARTS = ("fp8", "fp8moe", "small", "runner")  # the others are written for CUDA shapes only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=DEFAULT_PARTS)
    parser.add_argument("--out", default="kernels_gpu.json")
    parser.add_argument("--moe-tokens", default="1,128,16384", help="token counts of the moe part")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no new part after this many seconds (a device call is capped at 600 s)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on the CPU through Triton's interpreter (checks the script, not speed)")
    args = parser.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported (triton.jit reads it)
    device = "cpu" if args.tiny else "cuda"
    parts = [p for p in args.parts.split(",") if p]
    if args.tiny:
        parts = [p for p in parts if p in TINY_PARTS]
    from kernel_parts_fp8 import fp8_gemm_part, fp8_moe_part
    from kernel_parts_runner import runner_part
    from kernel_parts_small import small_part

    ctx = Context(device, args.tiny, Timer(device))
    table_parts = {"fp8": fp8_gemm_part, "fp8moe": fp8_moe_part, "small": small_part, "runner": runner_part}
    json_parts = {"moe": lambda: moe_part(tuple(int(n) for n in args.moe_tokens.split(","))),
                  "mla": mla_part, "flash": flash_part, "e2e": e2e_part}
    torch.manual_seed(int(time.time()))
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (tiny)",
                     "torch": torch.__version__, "parts": parts}
    rows: list[Row] = []
    began = time.perf_counter()
    for part in parts:
        if time.perf_counter() - began > args.budget_s:
            rows.append(Row(part, "SKIPPED", "-", None, None, note=f"--budget-s {args.budget_s:g} spent"))
            continue
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                if part in table_parts:
                    part_rows = table_parts[part](ctx)
                    rows += part_rows
                    print(format_table(part_rows), flush=True)  # in case a later part is cut off
                    results[part] = {"rows": [r.to_json() for r in part_rows]}
                else:
                    results[part] = json_parts[part]()
        except Exception as exc:  # keep the other parts' numbers when one fails
            traceback.print_exc()
            results[part] = {"error": repr(exc)}
            rows.append(Row(part, "ERROR", "-", None, None, float("nan"), note=repr(exc)[:120]))
        results[part]["wall_s"] = time.perf_counter() - start
        print(f"part {part}: {results[part]['wall_s']:.1f}s", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    rows = rows + legacy_rows(results)
    failed = [r for r in rows if not r.ok()]
    for line in e2e_lines(results):
        print(line)
    print(f"\n{len(rows)} rows, {len(failed)} failed checks (tolerance {TOL_BF16:g}); ceilings {COPY_GBS:,.0f} GB/s, "
          f"{BF16_TFLOPS:.0f} TFLOP/s bf16")
    print(format_table(rows))


if __name__ == "__main__":
    main()
