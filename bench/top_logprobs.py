"""What top logprobs cost a sampling step: none asked, one row asking k, every row asking k.

    python bench/top_logprobs.py                               # cuda when present, V = 129280
    python bench/top_logprobs.py --device cpu --vocab 2000 --batches 1,8

Each measurement is the step a worker runs: `SamplingBatch.sample` on the same random logits
(greedy rows, V = DeepSeek-V3's vocabulary by default), `sampled_host.pack`, the one
device-to-host copy and `unpack`. The rows without top logprobs share the batch's one `topk` at
the widest k, so "one asks" is the price of the feature for everyone else in the batch. Ratios are
against "none" in this one run. No asserts: this measures, tests check. The table is printed last.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from deepseek_pd.model.sampling.sampled_host import pack, unpack
from deepseek_pd.model.sampling.sampler import SamplingBatch, SamplingState
from deepseek_pd.model.sampling.params import MAX_TOP_LOGPROBS, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from step_timing import per_step, sync  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--batches", default="1,32,128", help="comma-separated batch sizes")
    parser.add_argument("--k", type=int, default=MAX_TOP_LOGPROBS, help="top logprobs per asking row")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    return parser.parse_args(argv)


def measure(batch_size: int, asking: int, k: int, vocab: int, device: torch.device, steps: int, warmup: int) -> float:
    """Seconds per step with `asking` of the `batch_size` rows asking for `k` top logprobs."""
    batch = SamplingBatch(vocab, device)
    for i in range(batch_size):
        batch.add(SamplingState.create(SamplingParams(temperature=0.0, top_logprobs_num=k if i < asking else 0),
                                       [], vocab, device=device))
    logits = torch.randn(batch_size, vocab, device=device) * 3

    def step() -> None:
        out = batch.sample(logits)
        unpack(pack(out).cpu(), out.top_counts)

    return per_step(step, steps, warmup, device)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = []
    with torch.inference_mode():
        for batch_size in (int(b) for b in args.batches.split(",")):
            times = {name: measure(batch_size, asking, args.k, args.vocab, device, args.steps, args.warmup)
                     for name, asking in (("none", 0), ("one", 1), ("all", batch_size))}
            rows.append({"batch": batch_size, **{f"{n}_ms": t * 1e3 for n, t in times.items()},
                         "one/none": times["one"] / times["none"], "all/none": times["all"] / times["none"]})
            print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nsampling step ms (sample + pack + copy + unpack) on {name}, V={args.vocab}, k={args.k}, greedy rows")
    print(f"{'B':>5}{'none':>10}{'one asks':>10}{'all ask':>10}{'one/none':>10}{'all/none':>10}")
    for r in rows:
        print(f"{r['batch']:>5}{r['none_ms']:>10.3f}{r['one_ms']:>10.3f}{r['all_ms']:>10.3f}"
              f"{r['one/none']:>10.2f}{r['all/none']:>10.2f}")


if __name__ == "__main__":
    main()
