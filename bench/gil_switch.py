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

The runner is the serving benchmark's prefill worker's (bench/serving_configs.py). Every line is
flushed as it is known; `--budget-s` bounds the whole run, so a session's timeout never kills it
silently: an interval whose share ran out reports the pairs it has, and a pair whose spinner had to
be stopped before the forward ended reports its ratio as a lower bound (">=").
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepseek_pd.errors import UserError  # noqa: E402
from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir  # noqa: E402
from deepseek_pd.model.runner import ExtendSeq, ModelRunner  # noqa: E402
from serving_configs import worker_runner_config  # noqa: E402


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


@dataclass
class BusyRatio:
    """Median of the pairs' (beside / alone) at one interval; `capped`: in some pair the spinner was
    stopped before the work ended (its time share ran out), so the figure is a lower bound."""

    ratio: float
    pairs: int
    capped: bool

    def __str__(self) -> str:
        bound = ">= " if self.capped else ""
        return f"{bound}{self.ratio:.2f} (median of {self.pairs} pairs)"


def busy_ratio(work: Callable[[], float], pairs: int, deadline: float) -> BusyRatio:
    """Pairs of `work()` (its seconds) beside a Python-busy thread / alone, at this process's current
    switch interval, until `pairs` are done or `deadline` (time.monotonic) passes (at least one
    pair). The spinner stops at the deadline even if `work` has not ended: at CPython's 5 ms a
    launch-bound forward beside it can take minutes (session 15: no figure within 150 s)."""
    ratios, capped = [], False
    while len(ratios) < pairs and (not ratios or time.monotonic() < deadline):
        alone = work()
        stop = threading.Event()

        def spin() -> None:
            total = 0
            while not stop.is_set():
                for i in range(2000):  # pure Python: holds the GIL until the interval forces it off
                    total += i
        thread = threading.Thread(target=spin, daemon=True)
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop.set)
        thread.start()
        timer.start()
        try:
            beside = work()
        finally:
            capped |= stop.is_set()
            stop.set()
            timer.cancel()
            thread.join()
        ratios.append(beside / alone)
    return BusyRatio(statistics.median(ratios), len(ratios), capped)


def main(argv=None) -> dict[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--pairs", type=int, default=15, help="at most, per interval")
    parser.add_argument("--intervals-ms", default="5,1,0.5,0.2", help="CPython's default is 5")
    parser.add_argument("--small-ops", action="store_true", help="also 2,000 tiny torch ops per pair")
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="the whole run, model load included: each interval gets an equal share of what is "
                             "left after the load, and stops its pairs (and its spinner) when the share is spent")
    args = parser.parse_args(argv)
    started = time.monotonic()
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    try:
        directory = resolve_model_dir(args.model)
    except UserError as exc:
        sys.exit(f"gil_switch: {exc}")
    print(f"gil_switch: loading {directory} on {args.device} (budget {args.budget_s:g} s)", flush=True)
    page = 64 if cuda else 16
    config = worker_runner_config(directory, args.device, 2 * (-(-args.tokens // page)) + 4)
    runner = ModelRunner(dataclasses.replace(config, dtype="bfloat16" if cuda else "float32", page_size=page))
    ids = [2 + i % (runner.model_config.vocab_size - 2) for i in range(args.tokens)]
    for _ in range(3):
        _extend_seconds(runner, ids)
    print(f"gil_switch: loaded in {time.monotonic() - started:.0f} s; extend alone "
          f"{_extend_seconds(runner, ids) * 1e3:.2f} ms", flush=True)
    intervals = [float(ms) for ms in args.intervals_ms.split(",")]
    before, results = sys.getswitchinterval(), {}
    try:
        for index, ms in enumerate(intervals):
            share = (started + args.budget_s - time.monotonic()) / (len(intervals) - index)
            sys.setswitchinterval(ms / 1e3)
            extend = busy_ratio(lambda: _extend_seconds(runner, ids),
                                args.pairs, time.monotonic() + share * (0.7 if args.small_ops else 1.0))
            results[ms] = extend.ratio
            print(f"switch interval {ms:g} ms: extend beside a Python-busy thread / alone = {extend} "
                  f"({args.tokens} tokens, {args.model}, {args.device})", flush=True)
            if args.small_ops:
                deadline = started + args.budget_s - share * (len(intervals) - index - 1)
                print(f"switch interval {ms:g} ms: 2,000 small ops beside / alone = "
                      f"{busy_ratio(small_ops, args.pairs, deadline)}", flush=True)
    finally:
        sys.setswitchinterval(before)
    return results


if __name__ == "__main__":
    main()
