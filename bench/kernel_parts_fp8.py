"""FP8 parts of `bench/kernels_gpu.py`: the block-scaled GEMM at DeepSeek-V3's linear shapes and the
FP8 fused MoE at V3's expert shape, each against the torch reference and against its bf16 version.

GEMM floor: `2MNK` at the FP8 peak (1,325 TFLOP/s) or the FP8 weight + activations at copy
bandwidth. MoE floor: the touched experts' FP8 bytes at copy bandwidth (the weight-streaming
floor; issue 9 asks ≤ 1.3× of it at 64 tokens) or its FLOPs at the FP8 peak.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_table import FP8_TFLOPS, Context, Row, floor_ms, poisoned_copy, rel_err

V3_LINEARS = {  # name: (N, K) of DeepSeek-V3's FP8 linear layers (hidden 7168)
    "q_a+kv_a": (2112, 7168),
    "q_b": (24576, 1536),
    "o_proj": (7168, 16384),
    "dense gate_up": (36864, 7168),
    "dense down": (7168, 18432),
}
TINY_LINEARS = {"tiny a": (96, 128), "tiny b": (64, 200)}


def random_fp8_weight(n: int, k: int, device: str, lead: tuple[int, ...] = ()):
    """e4m3 values of std ~16 and block scales around 1/800: dequantised std ~0.02, as a model's."""
    w = (torch.randn(*lead, n, k, device=device) * 16).to(torch.float8_e4m3fn)
    scale = torch.rand(*lead, -(-n // 128), -(-k // 128), device=device) * 2.5e-3 + 1.25e-4
    return w, scale


def fp8_gemm_part(ctx: Context) -> list[Row]:
    from deepseek_pd.model.quant.fp8_linear import FP8_GEMM_BACKENDS
    from deepseek_pd.model.quant.fp8_ops import dequant_weight

    ref, triton_gemm = FP8_GEMM_BACKENDS.build("torch"), FP8_GEMM_BACKENDS.build("triton")
    dtype = torch.float32 if ctx.tiny else torch.bfloat16
    rows = []
    shapes = TINY_LINEARS if ctx.tiny else V3_LINEARS
    for name, (n, k) in shapes.items():
        w, scale = random_fp8_weight(n, k, ctx.device)
        w_bf16 = dequant_weight(w, scale, 128, 128).to(dtype)
        for m in ((1, 16) if ctx.tiny else (1, 64, 128, 4096, 8192)):
            x = torch.randn(m, k, device=ctx.device, dtype=dtype)
            err = rel_err(poisoned_copy(triton_gemm(x, w, scale, 128, 128)), ref(x, w, scale, 128, 128))
            ms = ctx.timer(lambda: triton_gemm(x, w, scale, 128, 128))
            base_ms = ctx.timer(lambda: F.linear(x, w_bf16))
            nbytes = n * k + m * k * 2 + m * n * 2 + scale.numel() * 4
            rows.append(Row("fp8 gemm", f"{name} M={m}", "triton fp8", ms, floor_ms(2.0 * m * n * k, nbytes, FP8_TFLOPS),
                            err, "bf16 F.linear", base_ms,
                            "target >= 1.5x bf16" if m >= 4096 else ""))
        del w, scale, w_bf16
    return rows


def _routing(tokens: int, experts: int, shared: int, k: int, device: str):
    ids = torch.rand(tokens, experts, device=device).topk(k, dim=1).indices
    weights = torch.rand(tokens, k, device=device)
    ids = torch.cat([ids, torch.arange(experts, experts + shared, device=device).expand(tokens, -1)], dim=1)
    weights = torch.cat([weights, torch.ones(tokens, shared, device=device)], dim=1)
    return ids, weights


def fp8_moe_part(ctx: Context) -> list[Row]:
    from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
    from deepseek_pd.model.quant.fp8_ops import dequant_weight
    from deepseek_pd.model.moe.experts import MOE_BACKENDS
    from deepseek_pd.model.quant.moe_scales import Fp8ExpertScales

    experts, shared, k, hidden, inter = (8, 1, 2, 128, 128) if ctx.tiny else (256, 1, 8, 7168, 2048)
    total = experts + shared
    block = Fp8BlockQuantConfig(128, 128)
    dtype = torch.float32 if ctx.tiny else torch.bfloat16
    w13, s13 = random_fp8_weight(2 * inter, hidden, ctx.device, (total,))
    w2, s2 = random_fp8_weight(hidden, inter, ctx.device, (total,))
    bf13, bf2 = torch.empty(w13.shape, dtype=dtype, device=ctx.device), torch.empty(w2.shape, dtype=dtype,
                                                                                     device=ctx.device)
    for e in range(total):  # one expert at a time: the fp32 intermediates of all of V3's would be ~60 GB
        bf13[e] = dequant_weight(w13[e], s13[e], 128, 128)
        bf2[e] = dequant_weight(w2[e], s2[e], 128, 128)
    ref, fp8 = MOE_BACKENDS.build("torch"), MOE_BACKENDS.build("triton")
    bf16 = MOE_BACKENDS.build("triton")
    rows = []
    for tokens in ((1, 20) if ctx.tiny else (1, 64, 128, 4096)):
        x = torch.randn(tokens, hidden, device=ctx.device, dtype=dtype)
        ids, weights = _routing(tokens, experts, shared, k, ctx.device)
        touched = int(torch.unique(ids).numel())
        args = (x, ids, weights, w13, w2, Fp8ExpertScales(s13, block, s2, block))
        err = rel_err(poisoned_copy(fp8(*args)), ref(*args))
        ms = ctx.timer(lambda: fp8(*args))
        base_ms = ctx.timer(lambda: bf16(x, ids, weights, bf13, bf2))
        nbytes = touched * 3 * inter * hidden + 4 * x.numel() * 2
        flops = 6.0 * ids.numel() * hidden * inter
        rows.append(Row("fp8 moe", f"{'tiny' if ctx.tiny else 'V3'} N={tokens} ({touched} experts)", "triton fp8", ms,
                        floor_ms(flops, nbytes, FP8_TFLOPS), err, "bf16 triton", base_ms,
                        "target <= 1.3x floor" if tokens == 64 else ""))
    return rows
