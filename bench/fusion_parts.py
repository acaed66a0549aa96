"""Two parts of bench/fp8_prefill_gpu.py: fusions of the prefill path, each against what it replaces.

- `norm_quant`: `kernels/rmsnorm_quant.py` (RMSNorm, with or without the residual add, and the 1x128
  e4m3 quantisation in one launch) against `rms_norm` then `per_token_group_quant`, at V3's hidden
  (7168, the input and post-attention norms) and q_lora (1536, q_a_layernorm -> q_b_proj) widths and
  V2-Lite's hidden (2048). Bytes equal or not, ms, GB/s of what the fused launch must move.
- `qk_split`: MHA prefill (causal, one sequence) with q and k handed as their no-rope and rope parts
  (`RopeSplit`, what MLA does now) against the concatenation before (`torch.cat` of q, of k with the
  rope part expanded over heads, then the kernel); the outputs must be equal; the cat alone is timed too.
"""
from __future__ import annotations

import torch


def norm_quant_part(bench, rows: list[dict]) -> None:
    from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
    from deepseek_pd.model.kernels.rmsnorm import rms_norm
    from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant

    shapes = [(3, 300, True), (5, 96, False)] if bench.tiny else \
        [(m, d, res) for m in bench.counts if m >= 512 for d, res in ((7168, True), (1536, False), (2048, True))]
    dtype = torch.float32 if bench.tiny else torch.bfloat16
    for m, d, with_residual in shapes:
        if bench.over_budget():
            break
        x = torch.randn(m, d, device=bench.device, dtype=dtype)
        residual = torch.randn_like(x) if with_residual else None
        weight = (1 + 0.1 * torch.randn(d, device=bench.device)).to(dtype)

        def unfused():
            normed, new_residual = rms_norm(x, weight, 1e-6, residual)
            return (*per_token_group_quant(normed, 128), new_residual)

        def fused():
            return rms_norm_quant(x, weight, 1e-6, 128, residual)

        (q, s, r), (uq, us, ur) = fused(), unfused()
        equal = torch.equal(q.view(torch.uint8), uq.view(torch.uint8)) and torch.equal(s, us) \
            and (r is None or torch.equal(r, ur))
        same_bytes = float((q.view(torch.uint8) == uq.view(torch.uint8)).float().mean())
        fused_ms, unfused_ms = bench.ms(fused), bench.ms(unfused)
        moved = x.numel() * x.element_size() * (3 if with_residual else 1) + q.numel() + s.numel() * 4
        row = {"m": m, "d": d, "residual": with_residual, "bytes_equal": equal, "same_bytes": same_bytes,
               "fused_ms": fused_ms, "unfused_ms": unfused_ms, "speedup": unfused_ms / fused_ms,
               "fused_GB/s": moved / fused_ms / 1e6}
        rows.append(row)
        bench.save()
        print(f"norm_quant {m}x{d}{' +res' if with_residual else ''}: fused {fused_ms:.3f} ms "
              f"({row['fused_GB/s']:.0f} GB/s) vs norm+quant {unfused_ms:.3f} ms = {row['speedup']:.2f}x, "
              f"equal {equal} ({same_bytes:.5f} of bytes)", flush=True)


def qk_split_part(bench, rows: list[dict]) -> None:
    from deepseek_pd.model.attention import ATTENTION_BACKENDS
    from deepseek_pd.model.attention.backend import RopeSplit

    # (name, heads, tokens): V3 at 128 heads (one rank, no TP), V2-Lite at 16
    cases = [("tiny", 2, 40)] if bench.tiny else \
        [(name, heads, t) for t in (2048, 8192) if t in bench.counts or t == 2048
         for name, heads in (("V3", 128), ("V2-Lite", 16))]
    nope, rope, dv = (32, 16, 32) if bench.tiny else (128, 64, 128)
    dtype = torch.float32 if bench.tiny else torch.bfloat16
    backend = ATTENTION_BACKENDS.build("triton")
    for name, heads, tokens in cases:
        if bench.over_budget():
            break
        dev = bench.device
        q_nope, q_pe = torch.randn(tokens, heads, nope + rope, device=dev, dtype=dtype).split([nope, rope], -1)
        k_nope = torch.randn(tokens, heads, nope, device=dev, dtype=dtype)
        k_pe = torch.randn(tokens, 512 + rope, device=dev, dtype=dtype)[:, 512:]  # a column slice of the latent
        v = torch.randn(tokens, heads, dv, device=dev, dtype=dtype)
        offsets, scale = (0, tokens), (nope + rope) ** -0.5

        def concat():
            return (torch.cat([q_nope, q_pe], -1),
                    torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, heads, -1)], -1))

        def joined():
            q, k = concat()
            return backend.mha_causal(q, k, v, offsets, scale)

        def split():
            return backend.mha_causal(RopeSplit(q_nope, q_pe), RopeSplit(k_nope, k_pe), v, offsets, scale)

        (out, lse), (ref, ref_lse) = split(), joined()
        equal = torch.equal(out, ref) and torch.equal(lse, ref_lse)
        split_ms, joined_ms, cat_ms = bench.ms(split), bench.ms(joined), bench.ms(concat)
        row = {"model": name, "heads": heads, "tokens": tokens, "equal": equal, "split_ms": split_ms,
               "concat_then_kernel_ms": joined_ms, "concat_ms": cat_ms, "speedup": joined_ms / split_ms}
        rows.append(row)
        bench.save()
        print(f"qk_split {name} {heads} heads x {tokens}: parts {split_ms:.3f} ms vs cat + kernel {joined_ms:.3f} ms "
              f"(cat alone {cat_ms:.3f}) = {row['speedup']:.2f}x, equal {equal}", flush=True)
