"""The V2-Lite runner end to end for `bench/kernels_gpu.py`: bf16 and FP8-kept weights, same values.

One random FP8 block-scaled V2-Lite-shaped model (e4m3 weights, 128×128 scales, every `auto`
backend = Triton, 2 shared experts fused); a bf16 model holding exactly its dequantised weights.
For both: one-sequence prefill of 1k / 4k / 8k tokens and CUDA-graph decode steps at batch 1 / 64
/ 128 over a 512-token context; the FP8 model's logits against the bf16 model's (issue 9: within
2e-2 relative). Floors: prefill = matmul FLOPs (2 x active parameters per token) + causal
attention FLOPs at the bf16 (or FP8) peak; decode = weights touched per step (all non-expert
weights, the expected distinct experts under uniform routing) + the KV read, at copy bandwidth.
`--tiny`: the tiny V3 checkpoint's shape in FP8 on the CPU (interpreter), prefill 8, batch 1 / 2, eager
(its FP8-vs-bf16 logits error was 1.5e-2 to 2.6e-2 on the CPU, 2026-12-03). Random weights are not a real
checkpoint: the logits row is indicative; every FP8 kernel is also checked against its exact reference.
"""
from __future__ import annotations

import torch

from kernel_table import BF16_TFLOPS, FP8_TFLOPS, Context, Row, floor_ms, rel_err
from param_reads import active_values, decode_weight_bytes

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _models(ctx: Context, backend: str = "triton"):
    """{"bf16": model, "fp8": model} with the same weight values, every backend `backend`."""
    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.deepseek import DeepseekForCausalLM
    from deepseek_pd.model.quant.fp8_linear import fp8_blocks
    from deepseek_pd.model.quant.fp8_ops import dequant_weight

    if ctx.tiny:
        from deepseek_pd.model.checkpoint.loader import read_hf_config
        from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir

        raw = read_hf_config(resolve_model_dir("tiny"))
        dtype, fused = torch.float32, 1
    else:
        from model_gpu import V2_LITE

        raw, dtype, fused = dict(V2_LITE), torch.bfloat16, 2
    kw = dict(dtype=dtype, device=ctx.device, attention_backend=backend, moe_backend=backend,
              norm_rope_backend=backend, num_fused_shared_experts=fused)
    fp8 = DeepseekForCausalLM(ModelConfig.from_hf({**raw, "quantization_config": QUANT}),
                              BuildOptions(**kw, fp8_backend=backend))
    plain_raw = {key: value for key, value in raw.items() if key != "quantization_config"}
    bf16 = DeepseekForCausalLM(ModelConfig.from_hf(plain_raw), BuildOptions(**kw))
    blocks, fp8_params = fp8_blocks(fp8), dict(fp8.named_parameters())
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in fp8_params.items():
            if name in blocks:
                param.copy_((torch.randn(param.shape, device=ctx.device) * 16).to(param.dtype))
            elif name.endswith("_scale_inv"):
                param.uniform_(0.2 / 16 * 0.05, 0.2 / 16 * 0.15)  # dequantised std ~0.02
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
        for name, param in bf16.named_parameters():
            src = fp8_params[name]
            if name in blocks:
                block = blocks[name]
                src = dequant_weight(src, fp8_params[name + "_scale_inv"], block.block_out, block.block_in)
            param.copy_(src)
    return {"bf16": bf16.eval(), "fp8": fp8.eval()}


def _decode_floor_ms(model, batch: int, context: int) -> float:
    """Bytes one decode step must read: the weights by bench/param_reads.py's rule (each in its
    stored dtype, FP8 ones 1 byte; routed experts as far as `batch` tokens touch them under uniform
    routing; the embedding's rows only), plus the latent KV of the context."""
    cfg = model.config
    kv = batch * context * cfg.num_hidden_layers * cfg.kv_cache_dim * 2
    return floor_ms(nbytes=decode_weight_bytes(model, batch) + kv)


def _prefill_floor_ms(model, tokens: int, tflops: float) -> float:
    """2 FLOPs per active weight per token (lm_head for the last token only) at `tflops`, plus causal
    attention (qk 192 + v 128 per key) at the bf16 peak."""
    cfg = model.config
    active = active_values(model)  # bench/param_reads.py
    attn = (cfg.num_hidden_layers * cfg.num_attention_heads * tokens * (tokens + 1) / 2
            * (cfg.qk_head_dim + cfg.v_head_dim) * 2)
    return 2.0 * active * tokens / tflops / 1e9 + attn / BF16_TFLOPS / 1e9


def runner_part(ctx: Context) -> list[Row]:
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    models = _models(ctx)
    prefill_lens = (8,) if ctx.tiny else (1024, 4096, 8192)
    batches = (1, 2) if ctx.tiny else (1, 64, 128)
    context, page = (16, 4) if ctx.tiny else (512, 64)
    gen = torch.Generator().manual_seed(1)
    vocab = models["bf16"].config.vocab_size
    rows, logits = [], {}
    probe = torch.randint(0, vocab, (64,), generator=gen).tolist()  # the same prompt for both models
    for name, model in models.items():
        runner = ModelRunner.from_model(model, RunnerConfig(
            model=f"<random-{name}>", page_size=page, num_pages=400 if ctx.tiny else 3000,
            cuda_graph=ctx.device == "cuda", cuda_graph_max_batch=max(batches), cuda_graph_max_context=1024))
        pool = runner.kv_pool
        probe_pages = pool.alloc(pool.pages_for_tokens(len(probe) + 1))
        logits[name] = [runner.extend([ExtendSeq(probe, 0, probe_pages)]),
                        runner.decode([DecodeSeq(probe[0], len(probe), probe_pages)])]
        pool.free(probe_pages)
        tflops = FP8_TFLOPS if name == "fp8" else BF16_TFLOPS
        for n in prefill_lens:
            prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
            pages = pool.alloc(pool.pages_for_tokens(n))
            ms = ctx.timer(lambda: runner.extend([ExtendSeq(prompt, 0, pages)]))
            pool.free(pages)
            rows.append(Row("runner", f"prefill {n} tokens", name, ms, _prefill_floor_ms(model, n, tflops),
                            note=f"{n / ms * 1e3:,.0f} tok/s"))
        for bs in batches:
            seqs_pages = [pool.alloc(pool.pages_for_tokens(context + 1)) for _ in range(bs)]
            for lo in range(0, bs, 16):
                runner.extend([ExtendSeq(torch.randint(0, vocab, (context,), generator=gen).tolist(), 0, seqs_pages[i])
                               for i in range(lo, min(bs, lo + 16))])
            step = [DecodeSeq(1, context, p) for p in seqs_pages]
            ms = ctx.timer(lambda: runner.decode(step))
            for p in seqs_pages:
                pool.free(p)
            rows.append(Row("runner", f"decode bs={bs} ctx={context}", name + (" graph" if runner.graphs else ""), ms,
                            _decode_floor_ms(model, bs, context),
                            note=f"{bs / ms * 1e3:,.0f} tok/s"))
        del runner
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
    errs = [rel_err(a.float(), b.float()) for a, b in zip(logits["fp8"], logits["bf16"])]
    rows.append(Row("runner", "logits fp8 vs bf16 (prefill 64, 1 decode)", "fp8", None, None, max(errs),
                    note="issue 9 target <= 2e-2; " + ", ".join(f"{e:.1e}" for e in errs)))
    return rows
