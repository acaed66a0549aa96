"""Which threads of the prefill worker run while its model thread runs a forward, in `up`'s real
process layout (issue 25), against the runner alone.

    .venv/bin/python bench/prefill_thread_cpu.py                   # CPU: the `ops` shape, 128 tokens
    python bench/prefill_thread_cpu.py --device cuda --write-v2-lite --levels 1,16

First the runner alone in this process (`runner.extend`, synced: its wall time and its thread's
CPU time, at one prompt and at the largest round the levels make), then `deepseek-pd up` (one
prefill and one decode process and the real router) whose prefill worker carries
bench/thread_cpu_probe.py, and at each concurrency level prefill-only requests (seed-drawn prompts
of `--tokens`, one output token) through the router. For every forward the probe records each
thread's CPU time, its time runnable without a CPU and its context switches; this prints, per
level, the forward's wall time against the runner's at the same round's tokens, the model thread's
CPU and its waits, and each other thread (grouped by role: the event loop that runs gRPC and the
KV push, the KV transport's threads, gRPC's poller and core) with the CPU it used per forward, as
a share of the model thread's. A Python thread's CPU during the forward is time the
model thread may have waited for the GIL: a forward gives the GIL up at every torch op, and a
thread that wants it takes it then (bench/gil_switch.py: a busy one slows the forward 3.7-24x).

On the CPU the workers and the runner run one torch thread (OMP_NUM_THREADS=1): the forward's ops
then run in the model thread itself, as a GPU forward's launches do, and its CPU time is its host
time (with two OpenMP threads the forward's wall would mix in their barriers on a shared machine).
`--stacks` also samples what the other threads' Python was doing (it slows the forward).
`--worker-arg` passes a flag to every worker (e.g. `--engine-opt=layerwise_transfer=false`).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from deepseek_pd.model.config import ModelConfig  # noqa: E402
from deepseek_pd.model.runner import ExtendSeq, ModelRunner  # noqa: E402
from prefill_host_overhead import add_model_args, model_dir  # noqa: E402  (the same checkpoints: `ops` on the CPU)
from serving_configs import serving_plan, worker_runner_config  # noqa: E402
from up_process import UpProcess, UpSpec  # noqa: E402

PROBE = f"{BENCH / 'thread_cpu_probe.py'}:build"
# Roles whose CPU is not the worker's Python: the model thread itself, the probe's own sampler,
# and threads Python did not start (gRPC core, OpenMP), which never hold the GIL.
NOT_PYTHON = ("model", "probe", "grpc core", "native (not Python)")
ROUND_TOKENS = 8192  # the largest round the runner alone is measured at


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--levels", default="1,4", help="concurrency levels, comma-separated")
    parser.add_argument("--rounds", type=int, default=8, help="requests per level: this many x its concurrency")
    parser.add_argument("--runner-repeats", type=int, default=8)
    parser.add_argument("--worker-arg", action="append", default=[], help="a flag for every worker (repeatable)")
    parser.add_argument("--stacks", action="store_true", help="sample the other threads' Python stacks")
    parser.add_argument("--seed", type=int, default=None, help="the prompts' seed (default: drawn and printed)")
    parser.add_argument("--log-dir", type=Path, default=None, help="up's logs (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.tokens = args.tokens or (789 if cuda else 128)
    args.seed = random.randrange(1 << 30) if args.seed is None else args.seed
    args.levels = [int(c) for c in args.levels.split(",")]
    return args


def prompts(rng: random.Random, vocab: int, tokens: int, count: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(tokens)] for _ in range(count)]


def runner_alone(directory: Path, device: str, batches: list[list[list[int]]], repeats: int) -> list[dict]:
    """(main() runs it in a spawned process.) Per batch of prompts (one `runner.extend` of all of them: a round), the median wall and
    calling-thread CPU seconds of a synced extend (the worker's config, one untimed call first);
    the runner is gone when this returns."""
    page_size = serving_plan(device).page_size
    pages_needed = max(sum(-(-len(p) // page_size) for p in batch) for batch in batches)
    runner = ModelRunner(worker_runner_config(directory, device, pages_needed + 4))
    out = []
    try:
        with torch.inference_mode():
            for batch in batches:
                walls, cpus = [], []
                for i in range(repeats + 1):
                    seqs = [ExtendSeq(p, 0, runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(p))))
                            for p in batch]
                    _sync(device)
                    wall, cpu = time.perf_counter(), time.thread_time()
                    runner.extend(seqs)
                    _sync(device)
                    if i:
                        walls.append(time.perf_counter() - wall)
                        cpus.append(time.thread_time() - cpu)
                    for seq in seqs:
                        runner.kv_pool.free(seq.pages)
                out.append({"tokens": sum(map(len, batch)), "wall_s": statistics.median(walls),
                            "cpu_s": statistics.median(cpus)})
    finally:
        del runner
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def runner_at(runs: list[dict], tokens: float) -> dict:
    """The runner's wall and CPU seconds at a round of `tokens`, linear between the measured rounds
    (`runner_alone`'s, by tokens; held at the ends)."""
    runs = sorted(runs, key=lambda r: r["tokens"])
    lo = max([r for r in runs if r["tokens"] <= tokens] or runs[:1], key=lambda r: r["tokens"])
    hi = min([r for r in runs if r["tokens"] >= tokens] or runs[-1:], key=lambda r: r["tokens"])
    if hi["tokens"] == lo["tokens"]:
        return {**lo, "tokens": tokens}
    at = (tokens - lo["tokens"]) / (hi["tokens"] - lo["tokens"])
    return {"tokens": tokens, **{key: lo[key] + at * (hi[key] - lo[key]) for key in ("wall_s", "cpu_s")}}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate(url: str, served: str, input_ids: list[int]) -> None:
    body = json.dumps({"model": served, "input_ids": input_ids,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}})
    request = urllib.request.Request(f"{url}/generate", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        reply.read()


def run_level(url: str, served: str, batch: list[list[int]], concurrency: int) -> None:
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda ids: generate(url, served, ids), batch))


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def thread_shares(records: list[dict]) -> dict:
    """Over the forwards `records` (thread_cpu_probe.py's lines): per thread role the mean CPU
    seconds a forward and its share of the model thread's CPU, and the other Python threads' share
    together (`other_python_share`: what the forward may have waited for through the GIL)."""
    per_role: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(records))
    for i, record in enumerate(records):
        for thread in record["threads"].values():
            per_role[thread["role"]][i] += thread["cpu_s"]
    model_cpu = statistics.mean(per_role["model"])
    roles = {role: {"cpu_ms": 1e3 * statistics.mean(values), "share": statistics.mean(values) / model_cpu}
             for role, values in sorted(per_role.items(), key=lambda kv: -sum(kv[1]))}
    return {"roles": roles,
            "other_python_share": sum(v["share"] for role, v in roles.items() if role not in NOT_PYTHON)}


def summarise(records: list[dict], runs: list[dict]) -> dict:
    """Per level: `thread_shares`, the forward's wall and the model thread's own figures (medians
    over forwards) against the runner alone at the same round's tokens (`runner_at`), and the
    sampled stacks by role."""
    if not records:
        return {"forwards": 0}
    runner = runner_at(runs, statistics.median(r["tokens"] for r in records))
    model = [next(t for t in r["threads"].values() if t["role"] == "model") for r in records]
    wall = statistics.median(r["wall_s"] for r in records)
    model_cpu = statistics.median(t["cpu_s"] for t in model)
    stacks: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        for role, frames in record.get("stacks", {}).items():
            for frame, n in frames.items():
                stacks[role][frame] += n
    return {"forwards": len(records), "tokens": statistics.median(r["tokens"] for r in records), "runner": runner,
            "prompts": statistics.median(r["prompts"] for r in records), "wall_ms": 1e3 * wall,
            "wall_vs_runner": wall / runner["wall_s"], "model_cpu_ms": 1e3 * model_cpu,
            "model_cpu_vs_runner": model_cpu / runner["cpu_s"],
            "model_cpu_of_wall": statistics.median(t["cpu_s"] / r["wall_s"] for t, r in zip(model, records)),
            "model_voluntary": statistics.median(t["voluntary"] for t in model),
            "model_runnable_ms": 1e3 * statistics.median(t["wait_s"] for t in model),
            **thread_shares(records),
            "stacks": {role: dict(sorted(f.items(), key=lambda kv: -kv[1])[:6]) for role, f in stacks.items()}}


def report(level: int, summary: dict) -> str:
    if not summary["forwards"]:
        return f"c={level}: no forward recorded (the probe did not load? see up's logs)"
    s = summary
    runner = s["runner"]
    lines = [f"c={level}: {s['forwards']} forwards of {s['tokens']:.0f} tokens ({s['prompts']:.0f} prompts); forward "
             f"{s['wall_ms']:.2f} ms = {s['wall_vs_runner']:.3f}x the runner alone ({runner['wall_s'] * 1e3:.2f} ms "
             f"wall, {runner['cpu_s'] * 1e3:.2f} ms CPU, at {runner['tokens']:.0f} tokens)",
             f"  model thread: CPU {s['model_cpu_ms']:.2f} ms ({s['model_cpu_vs_runner']:.3f}x the runner's), "
             f"{s['model_cpu_of_wall']:.2f} of the wall; {s['model_voluntary']:.0f} voluntary switches (GIL or "
             f"device waits), {s['model_runnable_ms']:.2f} ms runnable without a CPU",
             f"  other threads' Python during the forward: {s['other_python_share']:.3f} of the model thread's CPU",
             f"  {'thread role':<22} {'CPU ms/forward':>14} {'of model CPU':>13}"]
    for role, figures in s["roles"].items():
        lines.append(f"  {role:<22} {figures['cpu_ms']:14.2f} {figures['share']:13.3f}")
    for role, frames in s["stacks"].items():
        lines.append(f"  stacks of {role}: " + "; ".join(f"{frame} x{n}" for frame, n in frames.items()))
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    directory = model_dir(args)
    config = ModelConfig.from_hf(directory / "config.json")
    print(f"prefill_thread_cpu: model {directory}, device {args.device}, {args.tokens} tokens, levels "
          f"{args.levels}, seed {args.seed}", flush=True)
    if not args.device.startswith("cuda"):  # module docstring: the forward's ops in the model thread
        os.environ["OMP_NUM_THREADS"] = "1"  # the workers inherit it
        torch.set_num_threads(1)
    rng = random.Random(args.seed)
    # The runner alone at one prompt and at the largest round the levels can make (at most the GPU's
    # 8,192-token default round): each level's rounds are held against it at their own tokens.
    largest = max(1, min(max(args.levels), ROUND_TOKENS // args.tokens))
    batches = [prompts(rng, config.vocab_size, args.tokens, k) for k in sorted({1, largest})]
    # In a process of its own, as bench/serving_gpu.py runs its runner: its GPU memory is back before
    # the workers size their pools.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as apart:
        runs = apart.submit(runner_alone, directory, args.device, batches, args.runner_repeats).result()
    for run in runs:
        print(f"runner alone, {run['tokens']} tokens: {run['wall_s'] * 1e3:.2f} ms wall, "
              f"{run['cpu_s'] * 1e3:.2f} ms CPU", flush=True)
    work = Path(tempfile.mkdtemp(prefix="thread-cpu-"))
    log_dir = args.log_dir or work / "logs"
    flags = [f for f in _worker_flags(args.device) if not f.startswith("--num-pages")]
    flags += [f"--engine-factory={PROBE}", *args.worker_arg]
    os.environ["THREAD_PROBE_OUT"] = str(work / "forwards.jsonl")
    if args.stacks:
        os.environ["THREAD_PROBE_STACKS"] = "1"
    result = {"runner": runs, "levels": {}, "seed": args.seed, "tokens": args.tokens, "device": args.device,
              "worker_flags": flags, "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else "cpu"}
    with UpProcess(UpSpec(directory, log_dir, worker_args=tuple(flags))) as up:
        served = directory.name
        run_level(up.url, served, prompts(rng, config.vocab_size, args.tokens, 2), 1)  # untimed: first calls
        for level in args.levels:
            probe_out = Path(os.environ["THREAD_PROBE_OUT"])
            probe_out.unlink(missing_ok=True)
            run_level(up.url, served, prompts(rng, config.vocab_size, args.tokens, args.rounds * level), level)
            summary = summarise(read_records(probe_out), runs)
            result["levels"][level] = summary
            print(report(level, summary), flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    return result


def _worker_flags(device: str) -> list[str]:
    """bench/serving_gpu.py's worker flags for `device` (the config serving_configs.py resolves)."""
    import serving_gpu
    return serving_gpu.worker_flags(serving_plan(device), [])


if __name__ == "__main__":
    main()
