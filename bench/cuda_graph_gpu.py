"""Decode throughput, eager vs CUDA-graph replay: DeepSeek-V2-Lite's shape, bf16, Triton backends.

Random weights (no HF model: only our runner is timed; the Triton MoE routes on random router
logits, so experts are hit about uniformly), the 2 shared experts fused, page 64. Per batch size:
prefill `--context`-token random prompts, then time `--steps` teacher-forced decode steps with
`runner.decode_eager` and with `runner.decode` (graph replay), as `measure_runner` in
`model_gpu.py` does (no per-step host sync). Also records capture time and the graph-vs-eager
logits error of one step.

Usage (on the GPU):  python bench/cuda_graph_gpu.py --out cuda_graph.json [--batches 1,32,128]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def build_random_v2lite(**options):
    """Our V2-Lite model with random weights (std 0.02, norms 1), Triton backends, shared experts fused;
    `options`: other `BuildOptions` fields (bench/decode_bs1_gpu.py: the small-batch fusions)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from model_gpu import V2_LITE

    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.deepseek import DeepseekForCausalLM

    options = BuildOptions(dtype=torch.bfloat16, device="cuda", attention_backend="triton", moe_backend="triton",
                           num_fused_shared_experts=2, **options)
    model = DeepseekForCausalLM(ModelConfig.from_hf(V2_LITE), options)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # RMSNorm weights (V2 has no score-correction bias)
            else:
                param.normal_(0.0, 0.02)
    return model.eval()


@torch.inference_mode()
def run(batches: tuple[int, ...], context: int, steps: int, max_context: int) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from model_gpu import cuda_time

    from deepseek_pd.model.graph_inputs import bucket_for
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    start = time.perf_counter()
    model = build_random_v2lite()
    torch.cuda.synchronize()
    result: dict = {"build_s": time.perf_counter() - start}
    start = time.perf_counter()
    runner = ModelRunner.from_model(model, RunnerConfig(
        model="<v2lite-random>", page_size=64, num_pages=3000, cuda_graph=True,
        cuda_graph_max_batch=max(batches), cuda_graph_max_context=max_context))
    result["capture_s"] = time.perf_counter() - start
    result["buckets"] = list(runner.graphs.buckets)
    print(json.dumps(result), flush=True)
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(3)
    for bs in batches:
        prompts = torch.randint(0, vocab, (bs, context), generator=gen)
        pages = [pool.alloc(pool.pages_for_tokens(context + steps)) for _ in range(bs)]
        for lo in range(0, bs, 16):
            runner.extend([ExtendSeq(prompts[i].tolist(), 0, pages[i]) for i in range(lo, min(bs, lo + 16))])
        tokens = torch.randint(0, vocab, (bs,), generator=gen).tolist()

        def loop(decode):
            def go():
                for step in range(steps):
                    decode([DecodeSeq(tokens[i], context + step, pages[i]) for i in range(bs)]).argmax(-1)
            return go

        seqs = [DecodeSeq(tokens[i], context, pages[i]) for i in range(bs)]
        eager_logits = runner.decode_eager(seqs)
        graph_logits = runner.decode(seqs)
        row = {
            "graph_vs_eager_rel_err": float((graph_logits - eager_logits).norm() / eager_logits.norm()),
            "argmax_agree": float((graph_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean()),
            "eager_tok_s": bs * steps / cuda_time(loop(runner.decode_eager), warmup=1, repeat=3),
            "graph_tok_s": bs * steps / cuda_time(loop(runner.decode), warmup=1, repeat=3),
        }
        # Host cost of one graph step without the GPU: the packing alone.
        inputs = runner.graphs._inputs[bucket_for(runner.graphs.buckets, bs)]
        t0 = time.perf_counter()
        for _ in range(20):
            inputs.pack([s.token_id for s in seqs], [s.position for s in seqs], [s.pages for s in seqs])
        row["pack_ms"] = (time.perf_counter() - t0) / 20 * 1e3
        row["speedup"] = row["graph_tok_s"] / row["eager_tok_s"]
        result[f"bs{bs}"] = row
        print(bs, json.dumps(row), flush=True)
        for p in pages:
            pool.free(p)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=1024, help="captured context (page-table width)")
    parser.add_argument("--out", default="cuda_graph.json")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        results.update(run(tuple(int(b) for b in args.batches.split(",")), args.context, args.steps,
                           args.max_context))
    except Exception as exc:  # keep what was measured
        import traceback
        traceback.print_exc()
        results["error"] = repr(exc)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
