"""Per-layer small ops and the prefill-with-prefix attention pieces for `bench/kernels_gpu.py`.

Each against the torch reference it replaced in the profile (RMSNorm + residual, RoPE + cache
write, the MoE sort for prefill batches, the chunked-prefix merge, absorbed-MLA extend over a
short prefix), timed against its bytes at copy bandwidth (or FLOPs at the bf16 peak).
"""
from __future__ import annotations

import torch

from kernel_table import Context, Row, floor_ms, poisoned_copy, rel_err


def _norm_rope_rows(ctx: Context, dtype: torch.dtype) -> list[Row]:
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
    from deepseek_pd.model.norm_rope import NORM_ROPE_BACKENDS
    from deepseek_pd.model.rope import RotaryEmbedding

    ref, fused = NORM_ROPE_BACKENDS.build("torch"), NORM_ROPE_BACKENDS.build("triton")
    rows = []
    tokens, hidden = (64, 64) if ctx.tiny else (8192, 2048)
    x, residual = (torch.randn(tokens, hidden, device=ctx.device, dtype=dtype) for _ in range(2))
    weight = torch.ones(hidden, device=ctx.device, dtype=dtype)
    err = rel_err(poisoned_copy(fused.rms_norm(x, weight, 1e-6, residual)[0]), ref.rms_norm(x, weight, 1e-6, residual)[0])
    nbytes = 4 * x.numel() * x.element_size()
    rows.append(Row("small ops", f"add+RMSNorm {tokens}x{hidden}", "triton", ctx.timer(
        lambda: fused.rms_norm(x, weight, 1e-6, residual)), floor_ms(nbytes=nbytes), err, "torch ops",
        ctx.timer(lambda: ref.rms_norm(x, weight, 1e-6, residual))))

    rotary = RotaryEmbedding(ModelConfig.from_hf(resolve_model_dir("tiny") / "config.json")).to(ctx.device)
    heads, d, rank = (4, rotary.dim, 32) if ctx.tiny else (16, rotary.dim, 512)
    q = torch.randn(tokens, heads, 128 + d, device=ctx.device, dtype=dtype)[..., 128:]
    latent = torch.randn(tokens, rank + d, device=ctx.device, dtype=dtype)
    positions = torch.randint(0, 4000, (tokens,), device=ctx.device)
    slots = torch.randperm(tokens, device=ctx.device)
    caches = [torch.zeros(tokens, rank + d, device=ctx.device, dtype=dtype) for _ in range(2)]
    args = (rotary, positions, q, latent[:, rank:], latent[:, :rank])
    want = ref.rope_and_write(*args, caches[0], slots)
    got = fused.rope_and_write(*args, caches[1], slots)
    err = max(rel_err(got[0], want[0]), rel_err(caches[1], caches[0]))
    nbytes = (2 * q.numel() + 3 * latent.numel()) * q.element_size()
    rows.append(Row("small ops", f"RoPE+cache write T={tokens} H={heads}", "triton",
                    ctx.timer(lambda: fused.rope_and_write(*args, caches[1], slots)), floor_ms(nbytes=nbytes), err,
                    "torch ops", ctx.timer(lambda: ref.rope_and_write(*args, caches[0], slots))))
    return rows


def _align_rows(ctx: Context) -> list[Row]:
    from deepseek_pd.model.kernels.moe_align import align_by_expert
    from deepseek_pd.model.kernels.moe_align_large import align_by_expert_large

    experts, k, tokens = (8, 2, 300) if ctx.tiny else (66, 8, 8192)
    ids = torch.rand(tokens, experts, device=ctx.device).topk(k, dim=1).indices.to(torch.int32)
    want, got = align_by_expert(ids, experts, 64), align_by_expert_large(ids, experts, 64)
    same = (torch.equal(got.block_expert, want.block_expert) and torch.equal(
        got.sorted_pair_ids.view(-1, 64).sort(1).values, want.sorted_pair_ids.view(-1, 64).sort(1).values))
    return [Row("small ops", f"MoE sort {tokens}x{k} pairs, {experts} experts", "triton (3 launches)",
                ctx.timer(lambda: align_by_expert_large(ids, experts, 64)), floor_ms(nbytes=ids.numel() * 4 * 3),
                0.0 if same else float("nan"), "torch (~30 ops)", ctx.timer(lambda: align_by_expert(ids, experts, 64)),
                "err 0 = same blocks")]


def _attention_rows(ctx: Context, dtype: torch.dtype) -> list[Row]:
    from deepseek_pd.model.attention import ATTENTION_BACKENDS
    from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend
    from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
    from deepseek_pd.model.kv.pool import KVPool

    ref, fast = TorchAttentionBackend(), ATTENTION_BACKENDS.build("triton")
    rows = []
    tokens, heads, dv = (40, 2, 16) if ctx.tiny else (8192, 16, 128)
    out_a, out_b = (torch.randn(tokens, heads, dv, device=ctx.device, dtype=dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(tokens, heads, device=ctx.device) for _ in range(2))
    err = rel_err(fast.merge_states(out_a, lse_a, out_b, lse_b)[0], ref.merge_states(out_a, lse_a, out_b, lse_b)[0])
    rows.append(Row("prefill attn", f"merge_states T={tokens} H={heads}", "triton",
                    ctx.timer(lambda: fast.merge_states(out_a, lse_a, out_b, lse_b)),
                    floor_ms(nbytes=3 * out_a.numel() * out_a.element_size()), err, "torch ops",
                    ctx.timer(lambda: ref.merge_states(out_a, lse_a, out_b, lse_b))))

    rank, rope, page = (32, 8, 4) if ctx.tiny else (512, 64, 64)
    prefix, new = (10, 20) if ctx.tiny else (200, 800)  # the short-prefix extend the policy sends to MLA
    pool = KVPool(1, -(-(prefix + new) // page) + 1, page, rank + rope, dtype=dtype, device=ctx.device)
    pool.buffers[0].normal_()
    pages = list(range(pool.num_pages - 1))
    batch = ForwardBatch.build(ForwardMode.EXTEND, [[0] * new], [prefix], [pages], pool, vocab_size=1,
                               device=ctx.device)
    q_latent = torch.randn(new, heads, rank, device=ctx.device, dtype=dtype)
    q_pe = torch.randn(new, heads, rope, device=ctx.device, dtype=dtype)
    cache, scale = pool.buffers[0], (rank + rope) ** -0.5
    err = rel_err(poisoned_copy(fast.mla_extend(q_latent, q_pe, cache, batch, rank, scale)),
                  ref.mla_extend(q_latent, q_pe, cache, batch, rank, scale))
    keys = new * prefix + new * (new + 1) / 2
    flops = 2.0 * heads * keys * (2 * rank + rope)
    mla_ms = ctx.timer(lambda: fast.mla_extend(q_latent, q_pe, cache, batch, rank, scale))
    rows.append(Row("prefill attn", f"mla_extend {new} new over {prefix} cached, H={heads}", "triton", mla_ms,
                    floor_ms(flops), err, "torch (was the fallback)",
                    ctx.timer(lambda: ref.mla_extend(q_latent, q_pe, cache, batch, rank, scale))))
    rows.append(_chunked_equivalent(ctx, fast, heads, rank, rope, prefix, new, dtype, mla_ms))
    return rows


def _chunked_equivalent(ctx: Context, fast, heads: int, rank: int, rope: int, prefix: int, new: int,
                        dtype: torch.dtype, mla_ms: float) -> Row:
    """The same extend as MHA_CHUNKED_KV would run it: causal flash over the new tokens, the prefix
    up-projected (w_kc/w_vc) and attended, one merge. If it beats `mla_extend`, lower
    `mha_chunked_kv_threshold` (policy.py) for the Triton backend."""
    nope, v_dim = (16, 16) if ctx.tiny else (128, 128)
    dev = ctx.device
    q = torch.randn(new, heads, nope + rope, device=dev, dtype=dtype)
    k, v = torch.randn(new, heads, nope + rope, device=dev, dtype=dtype), torch.randn(new, heads, v_dim, device=dev,
                                                                                      dtype=dtype)
    latent = torch.randn(prefix, rank + rope, device=dev, dtype=dtype)
    w_k = torch.randn(heads * nope, rank, device=dev, dtype=dtype) * rank ** -0.5
    w_v = torch.randn(heads * v_dim, rank, device=dev, dtype=dtype) * rank ** -0.5
    scale = (nope + rope) ** -0.5

    def chunked():
        out, lse = fast.mha_causal(q, k, v, (0, new), scale)
        k_nope = (latent[:, :rank] @ w_k.T).view(prefix, heads, nope)
        pk = torch.cat([k_nope, latent[:, None, rank:].expand(-1, heads, -1)], dim=-1)
        pv = (latent[:, :rank] @ w_v.T).view(prefix, heads, v_dim)
        part, part_lse = fast.mha_cross(q, pk, pv, (0, new), (0, prefix), scale)
        return fast.merge_states(out, lse, part, part_lse)

    flops = 2.0 * heads * (new * (new + 1) / 2 + new * prefix) * (nope + rope + v_dim)
    return Row("prefill attn", "same extend as MHA_CHUNKED_KV (flash+up-proj+merge)", "triton", ctx.timer(chunked),
               floor_ms(flops), None, "mla_extend (row above)", mla_ms,
               "speed-up > 1: prefer chunked KV for short prefixes")


def small_part(ctx: Context) -> list[Row]:
    dtype = torch.float32 if ctx.tiny else torch.bfloat16
    return _norm_rope_rows(ctx, dtype) + _align_rows(ctx) + _attention_rows(ctx, dtype)
