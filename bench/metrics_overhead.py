"""What the workers' Prometheus metrics cost, against one decode step measured in the same run.

The engines call `WorkerMetrics.observe_step` once per step for the whole batch and the servicer
`observe_request` once per request (workers/metrics/worker_metrics.py); the decode engine's
`observe_inter_token_latency` takes a step's gaps (one per row) in one call, next to what
prometheus_client's `Histogram.observe` would cost for the same rows one at a time. This prints the per-call costs and one scrape (`generate_latest`, gauges read from a
`Loads` source) next to a decode step of the model runner at the given batch, as ratios.

    python bench/metrics_overhead.py                          # tiny model, CPU, batch 8
    python bench/metrics_overhead.py --model DIR --device cuda --dtype bfloat16 --batch 64
"""
from __future__ import annotations

import argparse
import statistics
import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from deepseek_pd.workers.engine.interface import Loads
from deepseek_pd.workers.metrics.worker_metrics import ITL_BUCKETS, MetricLabels, WorkerMetrics


def per_call_us(fn, calls: int) -> float:
    runs = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(runs)


def decode_step_us(model: str, device: str, dtype: str, batch: int, context: int, steps: int) -> float:
    """Median wall time of `runner.decode` for `batch` sequences of `context` cached tokens."""
    import torch

    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    page = 16
    pages_per_seq = (context + steps) // page + 1
    runner = ModelRunner(RunnerConfig(model=model, device=device, dtype=dtype, page_size=page,
                                      num_pages=batch * pages_per_seq + 2))
    vocab = runner.model_config.vocab_size
    tables = [runner.kv_pool.alloc(pages_per_seq) for _ in range(batch)]
    runner.extend([ExtendSeq([1 + (i + j) % (vocab - 1) for j in range(context)], 0, t) for i, t in enumerate(tables)])
    times = []
    for step in range(steps):
        seqs = [DecodeSeq(1 + (i + step) % (vocab - 1), context + step, t) for i, t in enumerate(tables)]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        began = time.perf_counter()
        runner.decode(seqs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)

    metrics = WorkerMetrics(MetricLabels("decode", "bench", 0))
    metrics.watch_loads(lambda: Loads(args.batch, 3, 1000, 4096, cached_pages=10))
    metrics.watch_paths("decode", lambda: {"cuda_graph": 10, "eager": 1})
    metrics.watch_paths("extend", lambda: {"cuda_graph": 10, "eager": 1})
    step = decode_step_us(args.model, args.device, args.dtype, args.batch, args.context, args.steps)
    gaps = [0.001 * (1 + i % 40) for i in range(args.batch)]
    one_by_one = Histogram("itl", "", buckets=ITL_BUCKETS, registry=CollectorRegistry())

    def per_value() -> None:
        for gap in gaps:
            one_by_one.observe(gap)
    rows = [
        ("observe_step (once per step)", per_call_us(lambda: metrics.observe_step("decode", 0.01, args.batch,
                                                                                  args.batch), args.calls)),
        (f"observe_inter_token_latency ({args.batch} gaps/step)", per_call_us(
            lambda: metrics.observe_inter_token_latency(gaps), args.calls // 10)),
        (f"  vs Histogram.observe x {args.batch}", per_call_us(per_value, args.calls // 10)),
        ("observe_request (once per request)", per_call_us(lambda: metrics.observe_request(
            "length", 100, 20, 0, 0.1, 0.5), args.calls)),
        ("observe_kv_transfer (once per request)", per_call_us(lambda: metrics.observe_kv_transfer(
            "grpc", 1 << 20, 0.01), args.calls)),
        ("one scrape (generate_latest)", per_call_us(lambda: generate_latest(metrics.registry), 200)),
    ]
    print(f"decode step: {args.model} on {args.device} ({args.dtype}), batch {args.batch}, "
          f"context {args.context}: {step:.0f} us (median of {args.steps - 1})")
    print(f"{'call':<44} {'us/call':>9} {'x decode step':>14}")
    for name, us in rows:
        print(f"{name:<44} {us:>9.2f} {us / step:>14.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
