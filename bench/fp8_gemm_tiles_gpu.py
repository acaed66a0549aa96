"""Block-scaled FP8 GEMM at DeepSeek-V3's linear shapes: Triton tiles swept, and torch's cuBLAS
blockwise `scaled_mm` (1x128 activations, 128x128 weights) where this torch has it, each against
bf16 `F.linear` on the same (dequantised) weights in the same run.

    python bench/fp8_gemm_tiles_gpu.py [--out tiles.json]

The operands are quantised once, outside the timing (`block_fp8_matmul` and `scaled_mm` alone, no
activation quantisation), so the rows compare the GEMMs. Each result is checked against the
fp32 reference (`block_fp8_matmul_ref`) before it is timed.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from deepseek_pd.model.quant.fp8_ops import block_fp8_matmul_ref, dequant_weight
from deepseek_pd.model.kernels.fp8_gemm import Fp8GemmTile, block_fp8_matmul, default_tile
from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant

SHAPES = {"q_a+kv_a": (2112, 7168), "q_b": (24576, 1536), "o_proj": (7168, 16384),
          "dense gate_up": (36864, 7168), "dense down": (7168, 18432)}
TILES = [Fp8GemmTile(128, 128, 8, 3), Fp8GemmTile(128, 128, 4, 4), Fp8GemmTile(128, 128, 8, 4),
         Fp8GemmTile(128, 256, 8, 3), Fp8GemmTile(256, 128, 8, 3), Fp8GemmTile(64, 128, 4, 4),
         Fp8GemmTile(128, 64, 4, 4), Fp8GemmTile(128, 128, 8, 3, group_m=16)]
SMALL_TILES = [Fp8GemmTile(16, 64, 4, 4), Fp8GemmTile(16, 128, 4, 4), Fp8GemmTile(32, 64, 4, 4),
               Fp8GemmTile(16, 64, 2, 5), Fp8GemmTile(64, 64, 4, 4), Fp8GemmTile(64, 128, 4, 3)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def cublas_blockwise(x_fp8, x_scale, w, w_scale, out_dtype):
    """torch's blockwise scaled_mm: activations 1x128 (scales M-major), weight 128x128 (as w.t())."""
    m, k = x_fp8.shape
    pad_m = -m % 4
    if pad_m:
        x_fp8 = torch.cat([x_fp8, x_fp8.new_zeros(pad_m, k)])
        x_scale = torch.cat([x_scale, x_scale.new_ones(pad_m, x_scale.shape[1])])
    kb = w_scale.shape[1]
    scale_b = F.pad(w_scale, (0, -kb % 4)) if kb % 4 else w_scale
    out = F.scaled_mm(x_fp8, w.t(), x_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                      scale_b.t(), F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return out[:m]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fp8_tiles.json")
    parser.add_argument("--ms", default="1,64,128,4096,8192")
    args = parser.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") * 16).to(torch.float8_e4m3fn)
        w_scale = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 2.5e-3 + 1.25e-4
        w_bf16 = dequant_weight(w, w_scale, 128, 128).to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_fp8, x_scale = per_token_group_quant(x, 128)
            ref = block_fp8_matmul_ref(x_fp8, x_scale, w, w_scale, 128, 128, torch.float32)
            row = {"shape": name, "m": m, "n": n, "k": k,
                   "bf16_ms": triton.testing.do_bench(lambda: F.linear(x, w_bf16)),
                   "default_tile": str(default_tile(m)), "tiles": {}}
            for tile in (SMALL_TILES if m <= 128 else TILES):
                try:
                    out = block_fp8_matmul(x_fp8, x_scale, w, w_scale, 128, 128, torch.bfloat16, tile)
                    err = rel_err(out, ref)
                    ms_ = triton.testing.do_bench(
                        lambda: block_fp8_matmul(x_fp8, x_scale, w, w_scale, 128, 128, torch.bfloat16, tile))
                    row["tiles"][str(tile)] = {"ms": ms_, "err": err}
                except Exception as exc:  # a tile that does not fit (shared memory, registers)
                    row["tiles"][str(tile)] = {"error": repr(exc)[:200]}
            try:
                out = cublas_blockwise(x_fp8, x_scale, w, w_scale, torch.bfloat16)
                row["cublas"] = {"err": rel_err(out, ref), "ms": triton.testing.do_bench(
                    lambda: cublas_blockwise(x_fp8, x_scale, w, w_scale, torch.bfloat16))}
            except Exception as exc:
                row["cublas"] = {"error": repr(exc)[:300]}
            timed = {key: value["ms"] for key, value in row["tiles"].items() if "ms" in value}
            best = min(timed, key=timed.get) if timed else None
            line = (f"{name:14s} M={m:5d}: bf16 {row['bf16_ms']:.3f} ms; default {timed.get(row['default_tile'], float('nan')):.3f}; "
                    f"best triton {best} {timed.get(best, float('nan')):.3f} ms "
                    f"({row['bf16_ms'] / timed[best]:.2f}x bf16)" if best else f"{name} M={m}: no tile ran")
            if "ms" in row["cublas"]:
                line += f"; cublas blockwise {row['cublas']['ms']:.3f} ms ({row['bf16_ms'] / row['cublas']['ms']:.2f}x bf16, err {row['cublas']['err']:.1e})"
            else:
                line += f"; cublas: {row['cublas']['error'][:120]}"
            print(line, flush=True)
            rows.append(row)
        del w, w_scale, w_bf16
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
