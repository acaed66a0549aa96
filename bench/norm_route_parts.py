"""Three parts of bench/fp8_prefill_gpu.py: the norm fusions added for the post-attention norm and
attention TP, and the MLA decode route behind attention backend "auto".

- `post_norm_quant`: a dense layer's post-attention norm (residual add + RMSNorm) then gate_up_proj
  (FP8, Triton backend): fused (`rms_norm_quant`, then the GEMM alone) against the norm, then the
  linear (its own quantisation + GEMM), at V3's (7168 -> 36864) and V2-Lite's (2048 -> 21888) shapes.
  The outputs must be equal.
- `tp_norm_quant`: the input norm under attention TP writes its quantised rows into the packed
  buffer the all-gather moves (fp8 bytes + scales per row, quant/norm_fp8_linear.py): that launch
  against the fused launch into fresh tensors and the plain norm; the bytes per gathered row, packed
  against the model dtype's; and the first input projection (q_a + kv_a, or V2-Lite's q_proj)
  reading the gathered rows through their row stride against contiguous ones. One GPU: no collective.
- `mla_route`: absorbed-MLA decode at V3's 128 and V2-Lite's 16 heads for batch 1..128: Triton,
  FlashInfer (where it runs here; its host plan timed apart), and which one `MLADecodeRoute` picks;
  `route_right` says whether that was the faster kernel. Errors against the torch backend.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_batch import random_decode_batch  # noqa: E402

DENSE_GATE_UP = {"V3": (7168, 36864), "V2-Lite": (2048, 21888)}
INPUT_PROJ = {"V3": (7168, 2112), "V2-Lite": (2048, 3072)}  # q_a + kv_a; V2-Lite's q_proj


def _fp8_linear(bench, dim: int, out: int):
    from fp8_prefill_gpu import random_fp8_weight

    from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
    from deepseek_pd.model.quant.fp8_linear import Fp8Linear

    linear = Fp8Linear(dim, out, Fp8BlockQuantConfig(128, 128), "triton", bench.device)
    linear.weight.data, linear.weight_scale_inv.data = random_fp8_weight(out, dim, bench.device)
    return linear


def _norm_inputs(bench, m: int, d: int):
    dtype = torch.float32 if bench.tiny else torch.bfloat16
    x = torch.randn(m, d, device=bench.device, dtype=dtype)
    return x, torch.randn_like(x), (1 + 0.1 * torch.randn(d, device=bench.device)).to(dtype)


def _shapes(bench, table: dict) -> list[tuple[str, int, int, int]]:
    if bench.tiny:
        return [("tiny", 3, 256, 96), ("tiny", 5, 128, 64)]
    return [(name, m, *table[name]) for name in table if name in bench.models for m in bench.counts if m >= 128]


def post_norm_quant_part(bench, rows: list[dict]) -> None:
    from deepseek_pd.model.kernels.rmsnorm import rms_norm
    from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant

    for name, m, d, out in _shapes(bench, DENSE_GATE_UP):
        if bench.over_budget():
            break
        x, residual, weight = _norm_inputs(bench, m, d)
        linear = _fp8_linear(bench, d, out)

        def unfused():
            normed, _ = rms_norm(x, weight, 1e-6, residual)
            return linear(normed)

        def fused():
            q, s, _ = rms_norm_quant(x, weight, 1e-6, 128, residual)
            return linear.forward_quantised(q, s, x.dtype)

        equal = torch.equal(fused(), unfused())
        fused_ms, unfused_ms = bench.ms(fused), bench.ms(unfused)
        rows.append({"model": name, "m": m, "d": d, "out": out, "equal": equal, "fused_ms": fused_ms,
                     "unfused_ms": unfused_ms, "speedup": unfused_ms / fused_ms})
        bench.save()
        print(f"post_norm_quant {name} {m}x{d}->{out}: fused {fused_ms:.3f} ms vs norm + linear {unfused_ms:.3f} ms "
              f"= {unfused_ms / fused_ms:.2f}x, equal {equal}", flush=True)


def tp_norm_quant_part(bench, rows: list[dict]) -> None:
    from deepseek_pd.model.kernels.rmsnorm import rms_norm
    from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant
    from deepseek_pd.model.quant.norm_fp8_linear import packed_rows, unpacked

    for name, m, d, out in _shapes(bench, INPUT_PROJ):
        if bench.over_budget():
            break
        x, residual, weight = _norm_inputs(bench, m, d)
        packed = packed_rows(m, d, 128, bench.device)
        parts = unpacked(packed, d, 128)
        linear = _fp8_linear(bench, d, out)

        def into_packed():
            return rms_norm_quant(x, weight, 1e-6, 128, residual, out=parts)

        def fresh():
            return rms_norm_quant(x, weight, 1e-6, 128, residual)

        def norm_only():
            return rms_norm(x, weight, 1e-6, residual)

        q, s, _ = fresh()
        into_packed()
        equal = torch.equal(parts[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(parts[1], s)
        gemm_equal = torch.equal(linear.forward_quantised(*parts, x.dtype), linear.forward_quantised(q, s, x.dtype))
        row = {"model": name, "m": m, "d": d, "equal": equal and gemm_equal,
               "packed_row_bytes": packed.shape[1], "model_dtype_row_bytes": d * x.element_size(),
               "into_packed_ms": bench.ms(into_packed), "fresh_ms": bench.ms(fresh), "norm_only_ms": bench.ms(norm_only),
               "gemm_strided_ms": bench.ms(lambda: linear.forward_quantised(*parts, x.dtype)),
               "gemm_contiguous_ms": bench.ms(lambda: linear.forward_quantised(q, s, x.dtype))}
        rows.append(row)
        bench.save()
        print(f"tp_norm_quant {name} {m}x{d}: packed write {row['into_packed_ms']:.3f} ms (fresh {row['fresh_ms']:.3f}, "
              f"norm alone {row['norm_only_ms']:.3f}); gathered bytes/row {row['packed_row_bytes']} vs "
              f"{row['model_dtype_row_bytes']}; GEMM strided {row['gemm_strided_ms']:.3f} vs contiguous "
              f"{row['gemm_contiguous_ms']:.3f} ms; equal {row['equal']}", flush=True)


def _decode_batch(bench, heads: int, batch: int, context: int, page_size: int, dtype: torch.dtype):
    lengths = [max(1, context + int(torch.randint(-context // 4, context // 4 + 1, ()).item())) for _ in range(batch)]
    fb, cache = random_decode_batch(lengths, page_size, 576, dtype=dtype, device=bench.device)
    q_latent = torch.randn(heads, batch, 512, dtype=dtype, device=bench.device).transpose(0, 1)
    q_pe = torch.randn(batch, heads, 64, dtype=dtype, device=bench.device)
    return fb, cache, q_latent, q_pe, sum(lengths)


def mla_route_part(bench, rows: list[dict]) -> None:
    from fp8_prefill_gpu import errors

    from deepseek_pd.model.attention import ATTENTION_BACKENDS
    from deepseek_pd.model.kernels.flashinfer_mla import flashinfer_mla_available, flashinfer_mla_blocker
    from deepseek_pd.model.kernels.mla_decode_route import MLADecodeRoute

    route = MLADecodeRoute()
    cases = [(4, 2, 20), (4, 9, 12)] if bench.tiny else \
        [(heads, batch, 2048) for heads in (128, 16) for batch in (1, 4, 8, 16, 32, 128)]
    dtype = torch.float32 if bench.tiny else torch.bfloat16  # the interpreter runs no bf16 correctly
    page_size = 4 if bench.tiny else 64
    triton = ATTENTION_BACKENDS.build("triton")
    torch_ref = ATTENTION_BACKENDS.build("torch")
    flashinfer = None
    if flashinfer_mla_available():
        flashinfer = ATTENTION_BACKENDS.build("flashinfer", MLADecodeRoute(min_batch_many_heads=1, min_batch_few_heads=1))
    why_not = None if flashinfer else (flashinfer_mla_blocker() or "no Hopper GPU")
    for heads, batch, context in cases:
        if bench.over_budget():
            break
        fb, cache, q_latent, q_pe, tokens = _decode_batch(bench, heads, batch, context, page_size, dtype)
        scale = 192 ** -0.5
        ref = torch_ref.mla_decode(q_latent, q_pe, cache, fb, 512, scale)
        row = {"heads": heads, "batch": batch, "tokens": tokens, "route": "flashinfer" if
               route.uses_library(heads, batch) else "triton", "flashinfer": why_not or "ran"}
        row["triton_ms"] = bench.ms(lambda: triton.mla_decode(q_latent, q_pe, cache, fb, 512, scale))
        row["triton_err"] = errors(triton.mla_decode(q_latent, q_pe, cache, fb, 512, scale), ref)
        if flashinfer is not None:
            from deepseek_pd.model.kernels.flashinfer_mla import plan_decode

            row["flashinfer_err"] = errors(flashinfer.mla_decode(q_latent, q_pe, cache, fb, 512, scale), ref)
            row["flashinfer_ms"] = bench.ms(lambda: flashinfer.mla_decode(q_latent, q_pe, cache, fb, 512, scale))
            row["flashinfer_plan_ms"] = bench.ms(lambda: plan_decode(
                fb.page_table, fb.seq_lens, heads, 512, 64, page_size, scale, dtype, page_lists=fb.page_lists))
            faster = "flashinfer" if row["flashinfer_ms"] < row["triton_ms"] else "triton"
            row["route_right"] = faster == row["route"]
        rows.append(row)
        bench.save()
        fi = (f"flashinfer {row['flashinfer_ms']:.3f} ms (+ plan {row['flashinfer_plan_ms']:.3f} ms host), "
              f"route right {row['route_right']}") if flashinfer is not None else f"flashinfer: {why_not}"
        print(f"mla_route {heads} heads x {batch} ({tokens} tokens): route -> {row['route']}; triton "
              f"{row['triton_ms']:.3f} ms (err {row['triton_err']['rel']:.1e}); {fi}", flush=True)
