"""Model throughput on CPU (or any device): prefill and decode tokens/s through `ModelRunner`.

    .venv/bin/python bench/model_cpu.py                     # tiny V3, fp32, 1 thread
    .venv/bin/python bench/model_cpu.py --model DIR --batch 8 --prompt-len 512 --threads 2

Prefill runs `--batch` random prompts of `--prompt-len` tokens as one extend (chunked by
`--chunked-prefill-size`); decode then runs `--decode-steps` steps over the paged cache with the
whole batch. Each phase is repeated `--repeats` times and the best run is reported (the least
disturbed by other processes on a shared machine). No asserts: this measures, tests check.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny' (default)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)
    parser.add_argument("--attention-method", default="auto", choices=["auto", "mha", "mha_chunked_kv", "mla"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    return parser.parse_args()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from deepseek_pd.workers.engine.offline import Engine
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq

    engine = Engine(args.model, dtype=args.dtype, device=args.device, attention_method=args.attention_method,
                    max_total_tokens=args.batch * (args.prompt_len + args.decode_steps + 16))
    runner, pool = engine.runner, engine.runner.kv_pool
    rng = random.Random(0)
    prompts = [[rng.randrange(engine.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    prefill_s, decode_s = float("inf"), float("inf")
    for _ in range(args.repeats):
        pages = [pool.alloc(pool.pages_for_tokens(args.prompt_len + args.decode_steps)) for _ in prompts]
        try:
            _sync(args.device)
            start = time.perf_counter()
            for offset in range(0, args.prompt_len, args.chunked_prefill_size):
                logits = runner.extend([ExtendSeq(p[offset:offset + args.chunked_prefill_size], offset, pg)
                                        for p, pg in zip(prompts, pages)])
            _sync(args.device)
            prefill_s = min(prefill_s, time.perf_counter() - start)
            tokens = logits.argmax(-1).tolist()
            start = time.perf_counter()
            for step in range(args.decode_steps):
                logits = runner.decode([DecodeSeq(t, args.prompt_len + step, pg) for t, pg in zip(tokens, pages)])
                tokens = logits.argmax(-1).tolist()
            _sync(args.device)
            decode_s = min(decode_s, time.perf_counter() - start)
        finally:
            for pg in pages:
                pool.free(pg)
    cfg = engine.model_config
    figures = {
        "model": str(engine.model_path), "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
        "dtype": str(pool.dtype).replace("torch.", ""), "device": args.device, "threads": args.threads,
        "batch": args.batch, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
        "prefill_tok_s": args.batch * args.prompt_len / prefill_s,
        "decode_tok_s": args.batch * args.decode_steps / decode_s,
        "decode_step_ms": 1000 * decode_s / args.decode_steps,
        "kv_bytes_per_token": pool.bytes_per_token,
    }
    print(f"model {figures['model']} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{figures['dtype']}, {args.device}, {args.threads} thread(s))")
    print(f"KV bytes per token: {pool.bytes_per_token} ({cfg.num_hidden_layers} layers x {cfg.kv_cache_dim} x "
          f"{pool.buffers[0].element_size()} B)")
    print(f"prefill: {figures['prefill_tok_s']:10.1f} tok/s   ({args.batch} x {args.prompt_len} tokens, "
          f"best of {args.repeats})")
    print(f"decode:  {figures['decode_tok_s']:10.1f} tok/s   ({args.batch} sequences, "
          f"{figures['decode_step_ms']:.2f} ms/step, best of {args.repeats})")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
