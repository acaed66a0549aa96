"""A DeepSeek-V3 slice on one GPU: V3's full width, 4 layers (1 dense, 3 MoE), FP8 block-scaled.

Issue 21's V3 measurements without a 700 GB checkpoint: the model is built in memory at V3's
width (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, 256 routed experts top-8 plus 1 shared,
vocab 129,280; ~38 GB with FP8 experts) with random weights at realistic scales, and driven
through `ModelRunner` as the workers drive it:
- prefill of one 4,096-token and one 8,192-token prompt;
- decode steps at batch 1, 32 and 128 over ~2.3k tokens of context each, with the attention
  backends "triton", "flashinfer" and "flashmla" (each where it imports), with CUDA graphs and eager;
- where a step's time goes: the torch profiler's CUDA kernel times of one step, grouped by
  kernel, for prefill 4,096 and decode batch 128 (each backend, eager);
- each step against its floor: decode reads every weight it touches (FP8 1 byte) and the KV, at
  the card's HBM bandwidth; prefill's GEMM FLOPs at the FP8 peak.

`--tiny` runs the same code at a miniature width on whatever device is present (a CPU smoke test).
Results: JSON lines (--out) and a table on stdout, with the card and the commit.
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
from param_reads import active_values, decode_weight_bytes  # noqa: E402

from deepseek_pd.operator.known_models import KNOWN_MODELS  # noqa: E402

# DeepSeek-V3's shape (operator/known_models.py) cut to one dense layer and three MoE ones, without its
# MTP layer, with a random tokenizer's special ids.
V3_SLICE = {**{k: v for k, v in KNOWN_MODELS["DeepSeek-V3"].items() if k != "num_nextn_predict_layers"},
            "num_hidden_layers": 4, "first_k_dense_replace": 1, "rms_norm_eps": 1e-6,
            "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu"}
TINY = {**V3_SLICE, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 128,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 16,
        "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "torch_dtype": "float32"}
CARDS = {"H200": (1979e12, 4.8e12), "H100": (1979e12, 3.35e12)}  # dense FP8 FLOP/s, HBM bytes/s


def build_model(raw: dict, device: str, dtype: torch.dtype):
    """The model with random weights: FP8 blocks drawn chunk by chunk (a 256-expert tensor drawn at
    once in fp32 would need 15 GB), scales so that dequantised weights have std ~0.02."""
    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.deepseek import DeepseekForCausalLM
    from deepseek_pd.model.quant.fp8_linear import fp8_blocks

    backend = "triton" if device == "cuda" else "torch"
    model = DeepseekForCausalLM(ModelConfig.from_hf(raw), BuildOptions(
        dtype=dtype, device=device, attention_backend=backend, moe_backend=backend, norm_rope_backend=backend,
        fp8_backend=backend, num_fused_shared_experts=raw["n_shared_experts"]))
    blocks = fp8_blocks(model)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.data.view(-1)
            step = 1 << 26
            for lo in range(0, flat.numel(), step):
                part = flat[lo:lo + step]
                if name in blocks:
                    part.copy_((torch.randn(part.shape, device=device, generator=gen) * 16).to(param.dtype))
                elif name.endswith("_scale_inv"):
                    part.uniform_(0.2 / 16 * 0.05, 0.2 / 16 * 0.15, generator=gen)
                elif param.dim() == 1 and "bias" not in name:
                    part.fill_(1.0)
                else:
                    part.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def synced_ms(fn, reps: int) -> float:
    """Median wall milliseconds of `fn()` with the device synchronised around each call."""
    times = []
    for i in range(reps + 2):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= 2:  # two warm-up calls (Triton compiles, FlashInfer plans its first shape)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def kernel_profile(fn, top: int = 15) -> list[dict]:
    """CUDA kernel time of one `fn()` call, grouped by kernel name, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:90], "ms": e.device_time_total / 1e3, "calls": e.count}
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return [{"total_ms": total}] + rows[:top]


def decode_floor_ms(model, batch: int, context: int, bw: float) -> float:
    """Bytes one decode step must read: the weights by bench/param_reads.py's rule (stored dtype,
    routed experts as far as `batch` tokens touch them under uniform routing, the embedding's rows
    only), plus the latent KV."""
    cfg = model.config
    kv = batch * context * cfg.num_hidden_layers * cfg.kv_cache_dim * 2
    return (decode_weight_bytes(model, batch) + kv) / bw * 1e3


def prefill_floor_ms(model, tokens: int, flops_peak: float) -> float:
    """2 FLOPs per active weight per token at the FP8 peak (attention's FLOPs left out: a floor)."""
    active = active_values(model)  # bench/param_reads.py
    return 2.0 * active * tokens / flops_peak * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/v3_slice.json")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--moe-layers", type=int, default=3, help="MoE layers of the slice (fewer on small cards)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    random.seed(seed)
    torch.manual_seed(seed)
    from deepseek_pd.model.attention import ATTENTION_BACKENDS
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    raw = dict(TINY if args.tiny else V3_SLICE, num_hidden_layers=1 + args.moe_layers)
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    flops_peak, bw = next((v for k, v in CARDS.items() if k in card), CARDS["H100"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    t0 = time.perf_counter()
    model = build_model(raw, device, torch.bfloat16 if device == "cuda" else torch.float32)
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(f"built {raw['num_hidden_layers']} layers, {weights_gb:.1f} GB of weights in {time.perf_counter() - t0:.0f} s",
          flush=True)
    page, context = (16, 40) if args.tiny else (64, 2300)
    prefill_lens = (32,) if args.tiny else (4096, 8192)
    batches = (1, 4) if args.tiny else (1, 32, 128)
    reps = 2 if args.tiny else 10
    num_pages = (max(batches) * -(-(context + 8) // page)) + max(prefill_lens) // page + 16
    variants = [("triton", True), ("triton", False)] if device == "cuda" else [("torch", False)]
    if device == "cuda":
        for optional in ("flashinfer", "flashmla"):  # each where it imports (FlashMLA: built, 64-token pages)
            try:
                ATTENTION_BACKENDS.build(optional)
                variants += [(optional, True), (optional, False)]
            except Exception as exc:
                print(f"{optional}: not available ({exc})", flush=True)
    rows: list[dict] = []
    vocab = raw["vocab_size"]
    sink = open(args.out, "w")

    def record(row: dict) -> None:
        rows.append(row)
        sink.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    for index, (backend, graphs) in enumerate(variants):
        for layer in model.model.layers if hasattr(model, "model") else model.layers:
            layer.self_attn.backend = ATTENTION_BACKENDS.build(backend)
        runner = ModelRunner.from_model(model, RunnerConfig(
            model="<v3-slice>", page_size=page, num_pages=num_pages, cuda_graph=graphs,
            cuda_graph_max_batch=max(batches), cuda_graph_max_context=context + 64))
        pool = runner.kv_pool
        label = backend + (" graph" if graphs else "")
        if index == 0:  # prefill does not depend on the decode variant: once
            for n in prefill_lens:
                prompt = [random.randrange(vocab) for _ in range(n)]
                pages = pool.alloc(pool.pages_for_tokens(n))
                ms = synced_ms(lambda: runner.extend([ExtendSeq(prompt, 0, pages)]), max(2, reps // 3))
                if device == "cuda" and n == prefill_lens[0]:
                    record({"kind": "profile", "step": f"prefill {n}",
                            "kernels": kernel_profile(lambda: runner.extend([ExtendSeq(prompt, 0, pages)]))})
                pool.free(pages)
                record({"kind": "prefill", "tokens": n, "ms": ms, "tok_s": n / ms * 1e3,
                        "floor_ms": prefill_floor_ms(model, n, flops_peak)})
        for bs in batches:
            seq_pages = [pool.alloc(pool.pages_for_tokens(context + 1)) for _ in range(bs)]
            with torch.no_grad():  # random latent KV: decode's cost does not depend on the values
                for buf in pool.buffers:
                    buf.normal_()
            step = [DecodeSeq(random.randrange(vocab), context, p) for p in seq_pages]
            run = (lambda: runner.decode(step)) if graphs else (lambda: runner.decode_eager(step))
            ms = synced_ms(run, reps)
            record({"kind": "decode", "backend": label, "batch": bs, "context": context, "ms": ms,
                    "ms_per_layer": ms / raw["num_hidden_layers"], "tok_s": bs / ms * 1e3,
                    "floor_ms": decode_floor_ms(model, bs, context, bw)})
            if device == "cuda" and bs == max(batches) and not graphs:
                record({"kind": "profile", "step": f"decode bs {bs} {label}", "kernels": kernel_profile(run)})
            for p in seq_pages:
                pool.free(p)
        del runner
        if device == "cuda":
            torch.cuda.empty_cache()
    sink.close()
    print(f"\nV3 slice ({raw['num_hidden_layers']} layers, {weights_gb:.1f} GB) on {card}, commit {commit}")
    for r in rows:
        if r["kind"] == "prefill":
            print(f"prefill {r['tokens']:>5} tokens: {r['ms']:8.2f} ms ({r['tok_s']:,.0f} tok/s), "
                  f"floor {r['floor_ms']:.2f} ms, {r['floor_ms'] / r['ms']:.2f} of it")
        elif r["kind"] == "decode":
            print(f"decode bs {r['batch']:>3} {r['backend']:<14}: {r['ms']:8.2f} ms ({r['ms_per_layer']:.3f} ms/layer, "
                  f"{r['tok_s']:,.0f} tok/s), floor {r['floor_ms']:.2f} ms, {r['floor_ms'] / r['ms']:.2f} of it")
        else:
            print(f"profile {r['step']}: " + ", ".join(f"{k['kernel'][:40]} {k['ms']:.2f}" for k in r["kernels"][1:8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
