"""The prefill worker's host time for one prompt against its runner's extend, split by cause (issue 25).

    .venv/bin/python bench/prefill_host_overhead.py                   # CPU: V2-Lite's op count, tiny dims
    python bench/prefill_host_overhead.py --device cuda --model DIR   # a checkpoint on the GPU
    python bench/prefill_host_overhead.py --device cuda --write-v2-lite   # writes serving_gpu.py's V2-Lite

On the GPU the prefill worker is host-bound (session 15, H100: its round's launch + prepare 55 ms
where the runner's whole synced extend of the same 789-token prompt took 33.9 ms). One process, one
model, one prompt; each repeat runs every stage once, in turn, so they see the same machine, and
each stage adds one thing the worker's round does over the stage before it:

    runner         `runner.extend` + a device sync, the runner built as bench/runner_steps.py builds it
    worker_config  the same, the runner built from the config `serve prefill` resolves from
                   bench/serving_gpu.py's worker flags (only run when that config differs)
    first_token    `run_extend` (workers/engine/extend_step.py): + the first token's sampling and its
                   one host copy
    round_clock    + the round's `RoundClock` (its per-layer progress wrapper, no listener)
    layer_events   + `LayerEvents` per layer through a `LayerRelay` to an event loop (layer-wise KV
                   transfer's notices; the loop's drain does nothing more)
    model_thread   `PrefillRounds.forward` as the worker runs it: from the event loop, through the
                   `ModelThread` (its executor hop both ways, inference mode)
    busy_thread    + a thread running Python beside it all the while (the worker's event loop, gRPC and
                   send threads at their busiest), at the process's GIL switch interval
    busy_<X>ms     the same at a GIL switch interval of X ms (`--switch-ms`): whether a shorter one
                   would give the model thread its launches back (`sys.setswitchinterval`)
    worker_engine  the real thing in this process (bench/prefill_step_ratio.py's pairs): a
                   `PrefillEngine` and a `DecodeEngine` sharing the weights, over the bootstrap
                   service on loopback, the gRPC KV path as `up` on one GPU (direct copies on CUDA),
                   one request at a time; its step as the worker's metric reports it, and the runner
                   alone right before each request (`engine_runner`), so its ratio is paired

Prints each stage's median seconds, its ratio to `runner` and what it adds over the stage before,
the configs' differences, the torch ops each of `runner` and `layer_events` issues (counted under a
TorchDispatchMode, in the calling thread) and, on CUDA, each stage's host syncs and cudaMalloc/Free
calls (a hidden wait inside `launch` would show there). The CPU shape `ops` is V2-Lite's layer and expert
count (27 layers, 64 experts, top-6) at tiny widths, so host overhead dominates as on the GPU.
`--budget-s` bounds the run: repeats stop when it is spent.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir  # noqa: E402
from deepseek_pd.model.config import ModelConfig  # noqa: E402
from deepseek_pd.model.kv.layer_progress import LayerEvents  # noqa: E402
from deepseek_pd.model.runner import ExtendSeq, ModelRunner  # noqa: E402
from deepseek_pd.model.sampling.params import SamplingParams  # noqa: E402
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState  # noqa: E402
from deepseek_pd.workers.engine.extend_step import run_extend  # noqa: E402
from deepseek_pd.workers.engine.model_thread import ModelThread  # noqa: E402
from deepseek_pd.workers.engine.prefill_planner import PromptProgress  # noqa: E402
from deepseek_pd.workers.engine.prefill_round import PrefillRounds, RoundHooks  # noqa: E402
from deepseek_pd.workers.engine.round_clock import RoundClock  # noqa: E402
from deepseek_pd.workers.prefill.layer_relay import LayerRelay  # noqa: E402
from random_checkpoint import V2_MINI, ensure_random_checkpoint, v2_lite_config  # noqa: E402
from serving_configs import (config_differences, forwards_differ, runner_bench_config,  # noqa: E402
                             serving_plan, worker_runner_config)

STAGES = ("runner", "worker_config", "first_token", "round_clock", "layer_events", "model_thread", "busy_thread")
# V2-Lite's op count (layers, experts, top-k) at the miniature's widths: host overhead dominates.
OPS_SHAPE = {**V2_MINI, "num_hidden_layers": 27, "n_routed_experts": 64, "num_experts_per_tok": 6}
V2_LITE_DIR = Path("/tmp/deepseek-pd-bench/v2-lite-random")  # bench/serving_gpu.py's checkpoint
OPS_DIR = Path("/tmp/deepseek-pd-bench/v2-lite-ops-random")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--device, --model, --write-v2-lite and --tokens, which `model_dir` and the default lengths read
    (bench/prefill_thread_cpu.py takes the same)."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the CPU's `ops` shape)")
    parser.add_argument("--write-v2-lite", action="store_true",
                        help=f"use (writing it first if absent, ~45 s on a GPU) the V2-Lite checkpoint at {V2_LITE_DIR}")
    parser.add_argument("--tokens", type=int, default=None, help="prompt length (default 789 on CUDA, 128 on the CPU)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--repeats", type=int, default=None, help="rounds of every stage (default 20 CUDA, 10 CPU)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop repeating once this is spent")
    parser.add_argument("--switch-ms", type=float, action="append", default=None,
                        help="also the busy_thread stage at this GIL switch interval (repeatable; default 0.5)")
    parser.add_argument("--engine-requests", type=int, default=None,
                        help="worker_engine's requests (default: --repeats; 0 leaves the stage out)")
    parser.add_argument("--layerwise", choices=["on", "off"], default="on",
                        help="worker_engine's layer-wise KV transfer (the worker's default: on; direct copies "
                             "on CUDA send per chunk regardless)")
    parser.add_argument("--busy-cap-s", type=float, default=5.0,
                        help="the busy stages' spinner stops after this long (their figure is then a lower bound)")
    parser.add_argument("--seed", type=int, default=None, help="the prompt's seed (default: drawn and printed)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.tokens = args.tokens or (789 if cuda else 128)
    args.repeats = args.repeats or (20 if cuda else 10)
    args.seed = random.randrange(1 << 30) if args.seed is None else args.seed
    args.switch_ms = [0.5] if args.switch_ms is None else args.switch_ms
    args.engine_requests = args.repeats if args.engine_requests is None else args.engine_requests
    return args


def model_dir(args) -> Path:
    if args.model:
        return resolve_model_dir(args.model)  # "tiny" too
    if args.write_v2_lite:
        ensure_random_checkpoint(V2_LITE_DIR, v2_lite_config(), device=args.device)
        return V2_LITE_DIR
    ensure_random_checkpoint(OPS_DIR, dict(OPS_SHAPE), device="cpu")
    return OPS_DIR


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched in this thread while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Owner:
    def __init__(self, sampling: SamplingState) -> None:
        self.sampling, self.ended, self.in_flight = sampling, False, 0


class _RelayHooks(RoundHooks):
    """The prefill worker's layer-wise notices (engine.py `_PushHooks.layer_progress`), delivered to
    the loop, where nothing more is done with them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, device: str) -> None:
        self.loop, self.device, self.delivered = loop, device, 0

    def layer_progress(self, plan):
        def on_loop(layer, ready) -> None:
            self.delivered += 1
        return LayerEvents(self.device, LayerRelay(self.loop, on_loop).notice)


class Stages:
    """Every stage of the module docstring over one prompt and its pages; each returns seconds."""

    def __init__(self, runners: dict[str, ModelRunner], prompt: list[int], loop: asyncio.AbstractEventLoop,
                 busy_cap_s: float = 5.0) -> None:
        self.runners, self.prompt, self.loop = runners, prompt, loop
        self.worker = runners["worker_config"]
        self.device = str(self.worker.model.options.device)
        self.sampler = Sampler()
        self.hooks = _RelayHooks(loop, self.device)
        self.rounds = PrefillRounds(self.worker, self.sampler, len(prompt), self.hooks)
        self.thread = ModelThread("bench-model")
        self.stop_busy = threading.Event()
        self.busy_cap_s = busy_cap_s
        self.capped = 0  # busy rounds whose spinner was stopped before the round ended

    def _state(self) -> SamplingState:
        params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
        return SamplingState.create(params, self.prompt, self.worker.model_config.vocab_size, device=self.device)

    def _pages(self, runner: ModelRunner) -> list[int]:
        return runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(self.prompt)))

    def extend(self, runner: ModelRunner) -> float:
        pages = self._pages(runner)
        try:
            with torch.inference_mode():
                sync(self.device)
                began = time.perf_counter()
                runner.extend([ExtendSeq(self.prompt, 0, pages)])
                sync(self.device)
                return time.perf_counter() - began
        finally:
            runner.kv_pool.free(pages)

    def sampled(self, clock: bool, events: bool) -> float:
        pages = self._pages(self.worker)
        progress = self.hooks.layer_progress(None) if events else None
        try:
            with torch.inference_mode():
                sync(self.device)
                began = time.perf_counter()
                run_extend(self.worker, self.sampler, [ExtendSeq(self.prompt, 0, pages)], [0], [self._state()],
                           progress, RoundClock() if clock else None)
                return time.perf_counter() - began
        finally:
            self.worker.kv_pool.free(pages)

    async def round(self) -> float:
        """`PrefillRounds.run_in` without the role: the plan, the hop, the forward, the commit."""
        pages = self._pages(self.worker)
        try:
            queue = [PromptProgress(self.prompt, pages, owner=_Owner(self._state()))]
            clock_seen: list = []
            self.rounds.on_phases = clock_seen.append
            sync(self.device)
            began = time.perf_counter()
            await self.rounds.run_in(self.thread, queue)
            return time.perf_counter() - began
        finally:
            self.worker.kv_pool.free(pages)

    async def busy(self) -> float:
        """`round` beside the spinner, which stops after `busy_cap_s` even if the round has not ended
        (at CPython's 5 ms a launch-bound forward beside it can take many seconds): then the
        stage's figure is a lower bound (`capped`)."""
        self.stop_busy.clear()
        spinner = threading.Thread(target=_spin, args=(self.stop_busy,), daemon=True)
        timer = threading.Timer(self.busy_cap_s, self.stop_busy.set)
        spinner.start()
        timer.start()
        try:
            return await self.round()
        finally:
            self.capped += self.stop_busy.is_set()
            self.stop_busy.set()
            timer.cancel()
            spinner.join(timeout=10)

    async def busy_at(self, switch_s: float) -> float:
        default = sys.getswitchinterval()
        sys.setswitchinterval(switch_s)
        try:
            return await self.busy()
        finally:
            sys.setswitchinterval(default)

    async def run(self, stage: str) -> float:
        if stage.startswith("busy_") and stage.endswith("ms"):
            return await self.busy_at(float(stage[len("busy_"):-len("ms")]) / 1e3)
        if stage in ("runner", "worker_config"):
            return self.extend(self.runners[stage])
        if stage in ("first_token", "round_clock", "layer_events"):
            seconds = self.sampled(clock=stage != "first_token", events=stage == "layer_events")
            await asyncio.sleep(0)  # the relay's drain runs on this loop
            return seconds
        return await (self.round() if stage == "model_thread" else self.busy())


def _spin(stop: threading.Event) -> None:
    """Python that never blocks, bounded by `stop` (set by the caller within one round)."""
    total = 0
    while not stop.is_set():
        total += sum(range(200))


def count_ops(stages: Stages) -> dict:
    """Aten ops of one `runner` and one `layer_events` call, in this thread."""
    out = {}
    for stage, call in (("runner", lambda: stages.extend(stages.runners["runner"])),
                        ("layer_events", lambda: stages.sampled(clock=True, events=True))):
        with OpCounter() as counter:
            call()
        out[stage] = counter.ops
    extra = out["layer_events"] - out["runner"]
    return {"runner": sum(out["runner"].values()), "layer_events": sum(out["layer_events"].values()),
            "extra_in_layer_events": dict(extra.most_common(12))}


async def device_counts(stages: Stages, stages_run: list[str]) -> dict | None:
    """CUDA only: per stage, over one call, the host syncs torch reports (its sync debug mode's
    warnings, the explicit syncs around each stage included alike) and the caching allocator's
    cudaMalloc calls and freeing retries (each synchronises the device: a hidden wait in `launch`)."""
    if not stages.device.startswith("cuda"):
        return None
    out = {}
    for stage in stages_run:
        if stage.startswith("busy"):
            continue  # the spinner changes no sync or allocation
        before = torch.cuda.memory_stats()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                await stages.run(stage)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        after = torch.cuda.memory_stats()
        out[stage] = {"syncs": sum("synchroniz" in str(w.message) for w in caught),
                      **{key: after.get(key, 0) - before.get(key, 0)
                         for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")}}
    return out


async def measure(args, runners: dict[str, ModelRunner], prompt: list[int], stages_run: list[str]) -> dict:
    stages = Stages(runners, prompt, asyncio.get_running_loop(), args.busy_cap_s)
    try:
        for stage in stages_run:  # warm-up: first kernels, the thread, the relay
            await stages.run(stage)
        ops = count_ops(stages)
        device = await device_counts(stages, stages_run)
        times: dict[str, list[float]] = {stage: [] for stage in stages_run}
        deadline = args.ladder_deadline
        for _ in range(args.repeats):
            for stage in stages_run:
                times[stage].append(await stages.run(stage))
            if time.monotonic() > deadline:
                print(f"the stages' share of --budget-s is spent after {len(times['runner'])} repeats", flush=True)
                break
        return {"seconds": {stage: statistics.median(values) for stage, values in times.items()},
                "repeats": len(times["runner"]), "ops": ops, "layer_notices": stages.hooks.delivered,
                "busy_capped": stages.capped, "device_counts": device}
    finally:
        stages.thread.close()


def engine_stage(args, runner: ModelRunner, tokens: int, rng: random.Random) -> dict:
    """worker_engine (module docstring): bench/prefill_step_ratio.py's pairs over `runner`, fresh
    prompts of `tokens` each (its first request untimed)."""
    import prefill_step_ratio

    vocab = runner.model_config.vocab_size
    pages = 2 * runner.kv_pool.pages_for_tokens(tokens) + 8
    prefill = ModelRunner.from_model(runner.model, dataclasses.replace(runner.config, num_pages=pages))
    decode = ModelRunner.from_model(runner.model, dataclasses.replace(runner.config, num_pages=pages))
    prompts = [[rng.randrange(3, vocab) for _ in range(tokens)] for _ in range(args.engine_requests + 1)]
    options = argparse.Namespace(chunk=max(8192, tokens), same_host_direct="auto", layerwise=args.layerwise,
                                 repetition_penalty=1.0, device=args.device, trace=None)
    runs, _ = asyncio.run(prefill_step_ratio.worker_steps(prefill, decode, prompts, options, ["inference"],
                                                          None, None))
    times = runs["inference"]
    return {"engine_runner": statistics.median(times.alone), "worker_engine": statistics.median(times.step),
            "engine_ratio": statistics.median(s / a for s, a in zip(times.step, times.alone)),
            "engine_forward": statistics.median(times.forward),
            "engine_loop_busy": statistics.median(times.loop_busy)}


def report(result: dict) -> str:
    seconds, lines = result["seconds"], []
    base = seconds["runner"]
    lines.append(f"{'stage':<14} {'ms':>9} {'x runner':>9} {'adds ms':>9}")
    previous = None
    for stage, value in seconds.items():
        adds = "" if previous is None else f"{(value - previous) * 1e3:9.2f}"
        lines.append(f"{stage:<14} {value * 1e3:9.2f} {value / base:9.3f} {adds:>9}")
        previous = value
    if result["busy_capped"]:
        lines.append(f"(busy stages: the spinner was stopped before the round ended in {result['busy_capped']} "
                     f"rounds (--busy-cap-s): their figures are lower bounds)")
    ops = result["ops"]
    lines.append(f"torch ops: runner {ops['runner']}, worker's extend_step {ops['layer_events']} "
                 f"(extra: {ops['extra_in_layer_events']})")
    for stage, counts in (result["device_counts"] or {}).items():
        lines.append(f"  {stage:<13} host syncs {counts['syncs']}, cudaMalloc {counts['num_device_alloc']}, "
                     f"cudaFree {counts['num_device_free']}, allocator retries {counts['num_alloc_retries']}")
    diff = result["config_differences"]
    verdict = "FORWARDS DIFFER" if forwards_differ(diff) else "the same forward"
    lines.append(f"worker config vs runner bench's: {verdict}" + (f" (fields: {json.dumps(diff)})" if diff else ""))
    return "\n".join(lines)


def engine_report(engine: dict) -> str:
    return (f"worker_engine  {engine['worker_engine'] * 1e3:9.2f} ms against the runner alone right before each "
            f"request {engine['engine_runner'] * 1e3:.2f} ms: paired ratio {engine['engine_ratio']:.3f} (its forward "
            f"+ sync {engine['engine_forward'] * 1e3:.2f} ms, event loop busy {engine['engine_loop_busy'] * 1e3:.2f} ms)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.monotonic()
    directory = model_dir(args)
    print(f"prefill_host_overhead: model {directory}, device {args.device}, {args.tokens} tokens, "
          f"seed {args.seed}", flush=True)
    model_config = ModelConfig.from_hf(directory / "config.json")
    page_size = serving_plan(args.device).page_size
    num_pages = -(-args.tokens // page_size) + 4
    configs = {"runner": runner_bench_config(directory, args.device, num_pages),
               "worker_config": worker_runner_config(directory, args.device, num_pages)}
    diff = config_differences(configs["runner"], configs["worker_config"], model_config)
    stages_run = [stage for stage in STAGES if stage != "worker_config" or forwards_differ(diff)]
    stages_run += [f"busy_{ms:g}ms" for ms in args.switch_ms]
    runners = {"worker_config": ModelRunner(configs["worker_config"])}
    runners["runner"] = ModelRunner(configs["runner"]) if "worker_config" in stages_run else runners["worker_config"]
    rng = random.Random(args.seed)
    prompt = [rng.randrange(3, model_config.vocab_size) for _ in range(args.tokens)]
    end = started + args.budget_s
    # The stages get most of what is left; worker_engine (3 threads, gRPC, a KV transfer a request)
    # as many requests as fit in the rest at ~4 runner extends each.
    args.ladder_deadline = time.monotonic() + 0.6 * max(0.0, end - time.monotonic())
    result = asyncio.run(measure(args, runners, prompt, stages_run))
    result.update(config_differences=diff, device=args.device, tokens=args.tokens, seed=args.seed,
                  model=str(directory), switch_interval_s=sys.getswitchinterval(),
                  device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu")
    print(report(result), flush=True)  # before worker_engine: a session's timeout keeps these
    write_json(args, result)
    # (on CUDA the engine first runs the worker's warm-up extends, as `serve` does: not timed)
    requests = min(args.engine_requests, int((end - time.monotonic()) / (4 * result["seconds"]["runner"])) - 2)
    if args.engine_requests > 0 and requests >= 3:
        args.engine_requests = requests
        result["engine"] = engine_stage(args, runners["worker_config"], args.tokens, rng)
        print(engine_report(result["engine"]), flush=True)
        write_json(args, result)
    elif args.engine_requests > 0:
        print("worker_engine left out: --budget-s is spent", flush=True)
    return result


def write_json(args, result: dict) -> None:
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
