"""The decode engine's step against the bare runner's, in one process: where a serving step's time goes.

DeepSeek-V2-Lite's shape with random bf16 weights (no checkpoint on disk), Triton backends, the two
shared experts fused, page 64, CUDA graphs. For each batch size B:
- runner: `runner.decode` (graph replay) plus greedy argmax, timed back to back — the engine's floor;
- engine: B colocated requests (prompt `--context` tokens, `ignore_eos`, `--new-tokens` each) driven
  through the decode worker's `WorkerEngine.generate`, the way the servicer drives it, but without gRPC.
  All B prompts are prefilled first; the step time is the median gap between consecutive tokens of a
  request once every request is decoding (so prefill rounds are not counted).
The ratio engine/runner is the engine's own overhead (sampling, host packing, scheduling, event
delivery). With `--profile`, a torch profiler trace of a few steady-state engine steps and the top
host-side ops go under --out.

Usage (on the GPU):  python bench/decode_engine_gpu.py --out $OUT [--batches 16,64,128]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def runner_step_ms(runner, batch: int, context: int, steps: int = 32) -> float:
    """Median ms of one graph decode step plus argmax at `batch` sequences of `context` tokens."""
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq

    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    pages = [pool.alloc(pool.pages_for_tokens(context + steps + 1)) for _ in range(batch)]
    for lo in range(0, batch, 16):
        runner.extend([ExtendSeq(torch.randint(0, vocab, (context,), generator=gen).tolist(), 0, pages[i])
                       for i in range(lo, min(batch, lo + 16))])
    tokens = torch.randint(0, vocab, (batch,), generator=gen).tolist()
    times = []
    for step in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.decode([DecodeSeq(tokens[i], context + step, pages[i]) for i in range(batch)]).argmax(-1).tolist()
        times.append(time.perf_counter() - start)
    for p in pages:
        pool.free(p)
    return statistics.median(times[4:]) * 1e3


async def engine_step_ms(engine, batch: int, context: int, new_tokens: int, vocab: int,
                         profile_dir: str | None) -> dict:
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.workers.engine.interface import Finished, GenerateRequest, TokenChunk

    gen = torch.Generator().manual_seed(1000 + batch)
    arrivals: list[list[float]] = [[] for _ in range(batch)]

    async def one(i: int) -> None:
        request = GenerateRequest(f"r{batch}-{i}", tuple(torch.randint(0, vocab, (context,), generator=gen).tolist()),
                                  SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
        async for event in engine.generate(request):
            if isinstance(event, TokenChunk):
                arrivals[i].extend([time.perf_counter()] * len(event.token_ids))
            elif not isinstance(event, Finished):
                raise RuntimeError(f"request {i}: {event}")

    profiler = None
    if profile_dir:
        from torch.profiler import ProfilerActivity, profile
        profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    async def start_profiler_when_decoding() -> None:
        while profiler is not None and min(len(a) for a in arrivals) < 8:
            await asyncio.sleep(0.001)
        if profiler is not None:
            profiler.__enter__()
            await asyncio.sleep(0.25)
            profiler.__exit__(None, None, None)

    start = time.perf_counter()
    await asyncio.gather(start_profiler_when_decoding(), *(one(i) for i in range(batch)))
    wall = time.perf_counter() - start
    # Steady state: after every request has its first token (all prompts prefilled).
    all_decoding = max(a[0] for a in arrivals)
    gaps = [b - a for arr in arrivals for a, b in zip(arr, arr[1:]) if a > all_decoding]
    row = {"step_ms": statistics.median(gaps) * 1e3 if gaps else float("nan"),
           "step_p90_ms": sorted(gaps)[int(0.9 * len(gaps))] * 1e3 if gaps else float("nan"),
           "wall_s": wall, "tokens": sum(len(a) for a in arrivals)}
    if profiler is not None:
        profiler.export_chrome_trace(os.path.join(profile_dir, f"engine_bs{batch}.json"))
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        with open(os.path.join(profile_dir, f"engine_bs{batch}_ops.txt"), "w") as f:
            f.write(table)
        row["profile_top"] = table.splitlines()[:12]
    return row


def build_engine(model, batch_max: int, max_context: int):
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
    from deepseek_pd.workers.transport.worker_config import WorkerConfig
    from deepseek_pd.workers.decode.engine import DecodeEngine

    runner = ModelRunner.from_model(model, RunnerConfig(
        model="<v2lite-random>", page_size=64, num_pages=4096, cuda_graph=True,
        cuda_graph_max_batch=batch_max, cuda_graph_max_context=max_context))
    config = WorkerConfig(kv_transport="fake", scheduler=SchedulerConfig(
        max_running_requests=batch_max, chunked_prefill_size=8192))
    return runner, DecodeEngine(runner, config, tokenizer=None)


async def run(args) -> dict:
    from cuda_graph_gpu import build_random_v2lite

    batches = tuple(int(b) for b in args.batches.split(","))
    model = build_random_v2lite()
    runner, engine = build_engine(model, max(batches), args.context + args.new_tokens + 64)
    await engine.start()
    results: dict = {"context": args.context, "new_tokens": args.new_tokens}
    try:
        for batch in batches:
            row = {"runner_step_ms": runner_step_ms(runner, batch, args.context)}
            row.update(await engine_step_ms(engine, batch, args.context, args.new_tokens,
                                            runner.model_config.vocab_size,
                                            args.out if args.profile and batch == 64 else None))
            row["ratio"] = row["step_ms"] / row["runner_step_ms"]
            results[f"bs{batch}"] = row
            print(batch, json.dumps({k: v for k, v in row.items() if k != "profile_top"}), flush=True)
    finally:
        await engine.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="16,64,128")
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        results.update(asyncio.run(run(args)))
    except Exception as exc:  # keep what was measured
        import traceback
        traceback.print_exc()
        results["error"] = repr(exc)
    with open(os.path.join(args.out, "decode_engine.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'batch':>6} {'runner ms':>10} {'engine ms':>10} {'p90 ms':>8} {'ratio':>6}")
    for key, row in results.items():
        if key.startswith("bs"):
            print(f"{key[2:]:>6} {row['runner_step_ms']:10.2f} {row['step_ms']:10.2f} {row['step_p90_ms']:8.2f} "
                  f"{row['ratio']:6.2f}")
    for key, row in results.items():
        if key.startswith("bs") and "profile_top" in row:
            print("\n".join(row["profile_top"]))


if __name__ == "__main__":
    main()
