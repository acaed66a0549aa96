"""Sampler time per decode step: the old per-row path against the persistent `SamplingBatch`.

    python bench/sampling.py                                  # cuda when present, V = 102400
    python bench/sampling.py --device cpu --vocab 2000        # quick CPU check

For each batch size and request mix, on the same random logits:
- legacy: bench/sampling_legacy.py (the sampler before issue 7) + `.tolist()` + one `append` per
  row, as the decode loop did;
- batch: `SamplingBatch.sample` + `.tolist()` each step (the step's one device-to-host read);
- batch, no read: `--steps` samples back to back, synchronised once at the end: the GPU time per step
  when an overlap scheduler reads step N while step N+1 runs;
- host: the CPU time of one `sample` call (enqueueing only), what the overlap scheduler pays.
Ratios are legacy / batch, measured in this one run. No asserts: this measures, tests check.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Callable

import torch

from deepseek_pd.model.sampling.sampler import SamplingBatch, SamplingState
from deepseek_pd.model.sampling.params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_timing import per_step, sync  # noqa: E402

MIXES: dict[str, Callable[[int], SamplingParams]] = {
    "plain": lambda i: SamplingParams(temperature=1.0),
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "seeded top_p": lambda i: SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i),
    "seeded+penalties top_k": lambda i: SamplingParams(temperature=0.8, top_k=50, repetition_penalty=1.1,
                                                       frequency_penalty=0.2, seed=1000 + i),
    "mixed": lambda i: [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.95),
                        SamplingParams(temperature=0.9, seed=i, presence_penalty=0.5)][i % 3],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=102400)
    parser.add_argument("--batches", default="1,32,64,128", help="comma-separated batch sizes")
    parser.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, of: {', '.join(MIXES)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="also write the rows as JSON here")
    return parser.parse_args()


def measure(batch_size: int, mix: str, vocab: int, device: torch.device, steps: int, warmup: int) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sampling_legacy import LegacyRow, legacy_sample

    params = [MIXES[mix](i) for i in range(batch_size)]
    prompts = [[random.randrange(vocab) for _ in range(64)] for _ in params]
    logits = torch.randn(batch_size, vocab, device=device) * 3

    legacy_rows = [LegacyRow.create(p, prompt, vocab, device) for p, prompt in zip(params, prompts)]

    def legacy_step() -> None:
        tokens, _ = legacy_sample(logits, legacy_rows)
        for row, token in zip(legacy_rows, tokens.tolist()):
            row.append(token)

    batch = SamplingBatch(vocab, device)
    for p, prompt in zip(params, prompts):
        batch.add(SamplingState.create(p, prompt, vocab, device=device))

    def batch_step() -> None:
        batch.sample(logits).token_ids.tolist()

    def batch_no_read() -> None:
        batch.sample(logits)

    legacy = per_step(legacy_step, steps, warmup, device)
    read = per_step(batch_step, steps, warmup, device)
    no_read = per_step(batch_no_read, steps, warmup, device)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        batch.sample(logits)
    host = (time.perf_counter() - start) / steps
    sync(device)
    return {"batch": batch_size, "mix": mix, "legacy_ms": legacy * 1e3, "batch_ms": read * 1e3,
            "batch_no_read_ms": no_read * 1e3, "host_ms": host * 1e3, "speedup": legacy / read}


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    for mix in mixes:
        if mix not in MIXES:
            raise SystemExit(f"unknown mix {mix!r}; choose from {', '.join(MIXES)}")
    rows = []
    with torch.inference_mode():
        for batch_size in (int(b) for b in args.batches.split(",")):
            for mix in mixes:
                rows.append(measure(batch_size, mix, args.vocab, device, args.steps, args.warmup))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "vocab": args.vocab, "rows": rows}, f, indent=1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nsampler ms/step on {name}, V={args.vocab}")
    header = f"{'B':>4}  {'mix':<24}{'legacy':>9}{'batch':>9}{'no read':>9}{'host':>8}{'legacy/batch':>14}"
    print(header)
    for r in rows:
        print(f"{r['batch']:>4}  {r['mix']:<24}{r['legacy_ms']:>9.3f}{r['batch_ms']:>9.3f}"
              f"{r['batch_no_read_ms']:>9.3f}{r['host_ms']:>8.3f}{r['speedup']:>13.1f}x")


if __name__ == "__main__":
    main()
