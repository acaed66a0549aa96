"""A forward beside a Python-busy thread, against the same forward alone, at a GIL switch interval.

    .venv/bin/python bench/gil_switch.py                       # tiny model, CPU: 5, 1, 0.5, 0.2 ms
    python bench/gil_switch.py --device cuda --model DIR       # a checkpoint on the GPU

The model thread releases the GIL in every op and takes it back for the next; a thread running
Python meanwhile (a worker's event loop, the transport's threads) holds it until the switch interval
forces it off: 5 ms by default, so a forward of thousands of launches may wait up to that long per
launch while the GPU idles (the GIL's "convoy effect"). Each pair times `runner.extend` of one
prompt (with a device sync) alone, then with one thread spinning in Python; the figure is the
median of the pairs' ratios, per interval, all in one run. `small_ops` is the same pair over 2,000 tiny torch
ops, host-bound as a forward's launches are on a GPU, without the model's CPU compute.

Measured here (2 shared cores under other runs' load, so each figure swings from run to run): small
ops 1.5-4.9x at 5 ms, 2.2x at 1 ms, 1.0-2.2x at 0.5 ms, 2.0x at 0.1 ms; the tiny model's extend
2.8-3.2x at 5 ms, 2.4-4.3x at 0.5 ms: no conclusion on this machine. A worker could shorten its
interval (`sys.setswitchinterval`) if the GPU shows a forward's host time grow beside a busy
thread at 5 ms and not at 0.5 ms. `--small-ops` adds their pairs to the run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Callable

import torch

from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig


def _extend_seconds(runner: ModelRunner, ids: list[int]) -> float:
    pool = runner.kv_pool
    pages = pool.alloc(pool.pages_for_tokens(len(ids)))
    try:
        with torch.inference_mode():
            began = time.perf_counter()
            out = runner.extend([ExtendSeq(ids, 0, pages)])
            if out.is_cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - began
    finally:
        pool.free(pages)


def small_ops(count: int = 2000) -> float:
    """Seconds of `count` tiny torch ops, each of which releases the GIL and takes it back."""
    one = torch.ones(64)
    began, x = time.perf_counter(), one
    for _ in range(count):
        x = torch.add(x, one)
    return time.perf_counter() - began


def busy_ratio(work: Callable[[], float], pairs: int) -> float:
    """Median over `pairs` of `work()` (its seconds) beside a Python-busy thread / alone, at this
    process's current switch interval."""
    ratios = []
    for _ in range(pairs):
        alone = work()
        stop = threading.Event()

        def spin() -> None:
            total = 0
            while not stop.is_set():
                for i in range(2000):  # pure Python: holds the GIL until the interval forces it off
                    total += i
        thread = threading.Thread(target=spin, daemon=True)
        thread.start()
        try:
            beside = work()
        finally:
            stop.set()
            thread.join()
        ratios.append(beside / alone)
    return statistics.median(ratios)


def main(argv=None) -> dict[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--intervals-ms", default="5,1,0.5,0.2", help="CPython's default is 5")
    parser.add_argument("--small-ops", action="store_true", help="also 2,000 tiny torch ops per pair")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    page = 64 if cuda else 16
    runner = ModelRunner(RunnerConfig(model=args.model, device=args.device, dtype="bfloat16" if cuda else "float32",
                                      page_size=page, num_pages=2 * (-(-args.tokens // page)) + 4))
    ids = [2 + i % (runner.model_config.vocab_size - 2) for i in range(args.tokens)]
    for _ in range(3):
        _extend_seconds(runner, ids)
    before, results = sys.getswitchinterval(), {}
    try:
        for ms in map(float, args.intervals_ms.split(",")):
            sys.setswitchinterval(ms / 1e3)
            results[ms] = busy_ratio(lambda: _extend_seconds(runner, ids), args.pairs)
            print(f"switch interval {ms:g} ms: extend beside a Python-busy thread / alone = {results[ms]:.2f} "
                  f"(median of {args.pairs} pairs, {args.tokens} tokens, {args.model}, {args.device})", flush=True)
            if args.small_ops:
                print(f"switch interval {ms:g} ms: 2,000 small ops beside / alone = "
                      f"{busy_ratio(small_ops, args.pairs):.2f}", flush=True)
    finally:
        sys.setswitchinterval(before)
    return results


if __name__ == "__main__":
    main()
