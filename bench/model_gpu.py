"""GPU baseline: the plain-torch backends in bf16 on CUDA, against HF transformers on the same weights.

Two parts, each selectable:
- `smoke`: the tiny checkpoint, greedy 16 steps, CUDA bf16 vs CPU fp32 — the tokens must agree.
- `v2lite`: DeepSeek-V2-Lite's shape with random bf16 weights shared by both implementations:
  prefill 8x2048 and decode at batch 1 and 128 (context 512), HF `forward`/`generate` timed in the
  same process on the same weights. Also reports the prefill logits' relative error ours vs HF.

Usage (on the lent GPU):  python bench/model_gpu.py --out results.json [--parts smoke,v2lite]
Prints a table last; writes every number to --out.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from deepseek_pd.operator.known_models import KNOWN_MODELS

V2_LITE = {**KNOWN_MODELS["DeepSeek-V2-Lite"],  # ../shared/FACTS.md: 15.71B parameters
           "rms_norm_eps": 1e-6, "bos_token_id": 100000, "eos_token_id": 100001}


def cuda_time(fn, warmup: int = 1, repeat: int = 3) -> float:
    """Median seconds of `fn()` measured with a device synchronise around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def greedy(runner, prompt: list[int], steps: int) -> list[int]:
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq

    pages = runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(prompt) + steps))
    out = [int(runner.extend([ExtendSeq(prompt, 0, pages)]).argmax(-1)[0])]
    for i in range(steps - 1):
        logits = runner.decode([DecodeSeq(out[-1], len(prompt) + i, pages)])
        out.append(int(logits.argmax(-1)[0]))
    runner.kv_pool.free(pages)
    return out


def smoke() -> dict:
    """Greedy tokens of the tiny checkpoints: CPU fp32 vs CUDA fp32 and CUDA bf16."""
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("v3", "v2"):
            path = str(make_tiny_model(f"{tmp}/{arch}", arch=arch, seed=0))
            prompt = list(range(3, 40))
            torch_backends = dict(attention_backend="torch", moe_backend="torch")  # the baseline
            runs = {name: greedy(ModelRunner(RunnerConfig(model=path, dtype=dtype, device=device, **torch_backends)),
                                 prompt, 16)
                    for name, dtype, device in (("cpu_fp32", "float32", "cpu"), ("cuda_fp32", "float32", "cuda"),
                                                ("cuda_bf16", "bfloat16", "cuda"))}
            runs["cuda_fp32_equal"] = runs["cuda_fp32"] == runs["cpu_fp32"]
            runs["cuda_bf16_equal"] = runs["cuda_bf16"] == runs["cpu_fp32"]
            result[arch] = runs
    return result


def build_v2lite():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    hf_kwargs = {k: v for k, v in V2_LITE.items() if k not in ("architectures", "model_type", "torch_dtype")}
    rope = hf_kwargs.pop("rope_scaling")
    hf_config = DeepseekV2Config(**hf_kwargs, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                                 **{k: v for k, v in rope.items() if k != "type"}))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = DeepseekV2ForCausalLM(hf_config).eval()
    torch.set_default_dtype(torch.float32)
    # HF's default init (std 0.02) makes activations vanish over 27 layers; both models share the weights anyway.
    return hf, build_ours(hf)


def build_ours(hf, **option_overrides):
    """Our V2-Lite model with HF's weights; `option_overrides` go to BuildOptions (e.g. backends)."""
    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.deepseek import DeepseekForCausalLM

    options = BuildOptions(dtype=torch.bfloat16, device="cuda", **option_overrides)
    ours = DeepseekForCausalLM(ModelConfig.from_hf(V2_LITE), options)
    ours.load_weights((k, v) for k, v in hf.state_dict().items())
    return ours.eval()


@torch.inference_mode()
def v2lite(decode_steps: int = 16, context: int = 512) -> dict:
    from deepseek_pd.model.runner import ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    hf, ours = build_v2lite()
    runner = ModelRunner.from_model(ours, RunnerConfig(model="<v2lite>", page_size=64, num_pages=4096))
    vocab = V2_LITE["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    result: dict = {}

    # Logits agreement on one short prompt (bf16 both sides).
    ids = torch.randint(0, vocab, (1, 64), generator=gen)
    pages = runner.kv_pool.alloc(1)
    ours_logits = runner.extend([ExtendSeq(ids[0].tolist(), 0, pages)])[0]
    runner.kv_pool.free(pages)
    hf_logits = hf(ids.cuda()).logits[0, -1].float()
    result["prefill_logits_rel_err_vs_hf"] = float((ours_logits - hf_logits).norm() / hf_logits.norm())

    result.update(measure_runner(runner, gen, decode_steps, context))

    # HF: prefill 8 x 2048 and decode at batch 1 and 128 over the same context length.
    batch, length = 8, 2048
    hf_ids = torch.randint(0, vocab, (batch, length), generator=gen).cuda()
    t = cuda_time(lambda: hf(hf_ids, use_cache=False, logits_to_keep=1))
    result["hf_prefill_8x2048_tok_s"] = batch * length / t
    for bs in (1, 128):
        hf_ids = torch.randint(0, vocab, (bs, context), generator=gen).cuda()

        def hf_generate():
            hf.generate(hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=decode_steps,
                        min_new_tokens=decode_steps, do_sample=False)

        t_total = cuda_time(hf_generate, warmup=1, repeat=1)
        t_prefill = cuda_time(lambda: hf(hf_ids, use_cache=False, logits_to_keep=1), warmup=0, repeat=1)
        result[f"hf_generate_bs{bs}_tok_s"] = bs * decode_steps / max(t_total - t_prefill, 1e-9)
    return result


@torch.inference_mode()
def measure_runner(runner, gen: torch.Generator, decode_steps: int = 16, context: int = 512,
                   batch_sizes: tuple[int, ...] = (1, 128)) -> dict:
    """Our runner's prefill 8x2048 and decode throughput at `batch_sizes` over a `context`-token prompt."""
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq

    vocab = runner.model_config.vocab_size
    page = runner.kv_pool.page_size
    result: dict = {}
    batch, length = 8, 2048
    prompts = torch.randint(0, vocab, (batch, length), generator=gen)
    pages = [runner.kv_pool.alloc(-(-length // page)) for _ in range(batch)]

    def prefill():
        runner.extend([ExtendSeq(prompts[i].tolist(), 0, pages[i]) for i in range(batch)])

    result["ours_prefill_8x2048_tok_s"] = batch * length / cuda_time(prefill)
    for p in pages:
        runner.kv_pool.free(p)
    for bs in batch_sizes:
        prompts = torch.randint(0, vocab, (bs, context), generator=gen)
        seq_pages = [runner.kv_pool.alloc(-(-(context + decode_steps) // page)) for _ in range(bs)]
        for start in range(0, bs, 16):
            runner.extend([ExtendSeq(prompts[i].tolist(), 0, seq_pages[i]) for i in range(start, min(bs, start + 16))])
        tokens = [1] * bs

        def decode():
            for step in range(decode_steps):
                runner.decode([DecodeSeq(tokens[i], context + step, seq_pages[i]) for i in range(bs)]).argmax(-1)

        result[f"ours_decode_bs{bs}_tok_s"] = bs * decode_steps / cuda_time(decode, warmup=1, repeat=1)
        for p in seq_pages:
            runner.kv_pool.free(p)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="smoke,v2lite")
    parser.add_argument("--out", default="model_gpu.json")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for part in args.parts.split(","):
        start = time.perf_counter()
        try:
            results[part] = {"smoke": smoke, "v2lite": v2lite}[part]()
        except Exception as exc:  # keep the other part's numbers when one part fails
            import traceback
            traceback.print_exc()
            results[part] = {"error": repr(exc)}
        results[part]["wall_s"] = time.perf_counter() - start
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
