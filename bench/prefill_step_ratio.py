"""The prefill worker's step against its runner's, measured in one run (issue 25).

    .venv/bin/python bench/prefill_step_ratio.py --tiny                          # CPU, tiny model
    python bench/prefill_step_ratio.py --device cuda --shape v2-lite --tokens 789 --json $OUT/step.json

One process, one set of weights (a prefill and a decode runner with their own KV pools), built from
the config `serve prefill` resolves from bench/serving_gpu.py's worker flags (bench/serving_configs.py):
1. the runner alone: `runner.extend` of one prompt of `--tokens` and a device sync (what
   `bench/runner_steps.py` calls the prefill), in the worker's model thread right before each
   request of 2 with the same prompt, so each pair sees the same machine;
2. the prefill worker: a `PrefillEngine` and a `DecodeEngine` over the real bootstrap service on
   loopback, fed prompts of the same length one at a time (concurrency 1, one output token on
   decode), after one untimed request. Its step is what its metrics report (`step_seconds`,
   mode prefill: the scheduler's `run_in`, from handing the round to the model thread to having
   its result back on the event loop), split by instruments in the model thread into
     hop       step - model thread's part (executor hand-off both ways, the event loop's wake-up);
     forward   `runner.extend` with its sync (run_extend's), as in 1;
     first tok the rest of the model thread's part: the first-token sample and its host copy;
   and the event loop's own busy time during each step (out of its poll: callbacks that take the
   GIL from the model thread).
Prints step / runner (the median of the pairs' ratios; target <= `TARGET`) and the split;
`--json` writes it all. `--also-without-inference-mode` measures the model thread as before too
(the model's no_grad only), its pairs taking turns with the others on each prompt. `--trace DIR`
writes a torch.profiler trace of the last pairs, every thread (the GPU's idle time inside a step
shows there), with each window's split (bench/step_attribution.py: GPU busy and idle, host
syncs, launches, other threads' CPU time) printed and in DIR/prefill_step_attribution.json.
`--profile FILE` writes cProfile's top functions of the model thread's rounds and of the event
loop during the worker's requests.

Caveat: both engines share this process (and its GIL) where `up` runs two, so the worker's
figure here is conservative; the split says which part grew.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import contextlib
import dataclasses
import gzip
import io
import json
import pstats
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig  # noqa: E402
from deepseek_pd.model.sampling.params import SamplingParams  # noqa: E402
from deepseek_pd.workers.decode.engine import DecodeEngine  # noqa: E402
from deepseek_pd.workers.engine import model_thread as model_thread_module  # noqa: E402
from deepseek_pd.workers.engine.interface import DisaggParams, Finished, GenerateRequest  # noqa: E402
from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig  # noqa: E402
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig  # noqa: E402
from deepseek_pd.workers.transport.worker_config import WorkerConfig  # noqa: E402
from deepseek_pd.workers.prefill.engine import PrefillEngine  # noqa: E402
from deepseek_pd.workers.transport import TransportConfig  # noqa: E402
from target_check import check  # noqa: E402
import step_attribution  # noqa: E402
from serving_configs import worker_runner_config  # noqa: E402
import worker_metrics  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from torch.profiler import record_function  # noqa: E402

TARGET = 1.1  # issue 25: the worker at >= 0.9 of its runner


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (a quick check)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=["tiny", "v2-lite"], default="tiny")
    parser.add_argument("--model", default=None, help="a checkpoint directory (overrides --shape)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--tokens", type=int, default=None, help="prompt length (default 789 on CUDA, 96 on the CPU)")
    parser.add_argument("--chunk", type=int, default=8192, help="chunked_prefill_size (the prompt fits one round)")
    parser.add_argument("--page-size", type=int, default=None, help="default 64 on CUDA, 16 on the CPU")
    parser.add_argument("--repeats", type=int, default=None, help="default 20 on CUDA, 10 on the CPU")
    parser.add_argument("--layerwise", choices=["on", "off"], default="on",
                        help="layer-wise KV transfer (on channels that stream layers: the byte stream)")
    parser.add_argument("--same-host-direct", choices=["auto", "on", "off"], default="auto",
                        help="grpc: direct device copies into the decode pool (CUDA pools by default)")
    parser.add_argument("--no-inference-mode", action="store_true",
                        help="run the worker's model thread as before 2026-12-06 (the model's no_grad only), "
                             "to see what inference mode gives (the runner alone keeps it)")
    parser.add_argument("--also-without-inference-mode", action="store_true",
                        help="also pairs with the model thread as before, in turn with the others on each prompt")
    parser.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="torch.profiler over the last 3 pairs: a Chrome trace and the ops' table in DIR")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="every request's (1: none); with one, both workers open penalised requests "
                             "(their sampling tables built on the model thread, not the event loop)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the GIL's switch interval in this process (default: CPython's 5 ms, as the workers)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE",
                        help="write cProfile's top functions of the worker's model thread and event loop")
    args = parser.parse_args(argv)
    if args.tiny:
        args.device, args.shape = "cpu", "tiny"
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.tokens = args.tokens or (789 if cuda else 96)
    args.page_size = args.page_size or (64 if cuda else 16)
    args.repeats = args.repeats or (20 if cuda else 10)
    return args


def model_path(args) -> str:
    if args.model:
        return args.model
    if args.shape == "tiny":
        return "tiny"
    from random_checkpoint import ensure_random_checkpoint, v2_lite_config
    directory = Path("/tmp/deepseek-pd-bench/v2-lite-random")  # serving_gpu.py's: reused when it wrote it
    ensure_random_checkpoint(directory, v2_lite_config(), device=args.device)
    return str(directory)


def runner_config(args, path: str, pages: int) -> RunnerConfig:
    """The serving benchmark's prefill worker's runner (bench/serving_configs.py: its backends and
    fused shared experts), with this run's dtype, page size and pool."""
    return dataclasses.replace(worker_runner_config(Path(path), args.device, pages), dtype=args.dtype,
                               page_size=args.page_size)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def runner_alone(runner: ModelRunner, prompt: list[int], device: str) -> float:
    """Seconds of `runner.extend` of `prompt` + a device sync (in the caller's thread)."""
    pool = runner.kv_pool
    pages = pool.alloc(pool.pages_for_tokens(len(prompt)))
    try:
        with torch.inference_mode():
            sync(device)
            began = time.perf_counter()
            with record_function("pd::runner_alone"):  # a window of --trace's attribution
                type(runner).extend(runner, [ExtendSeq(prompt, 0, pages)])  # not the worker's instrumented one
                sync(device)
            return time.perf_counter() - began
    finally:
        pool.free(pages)


@dataclasses.dataclass
class WorkerTimes:
    alone: list[float] = dataclasses.field(default_factory=list)  # the runner alone, before each request
    step: list[float] = dataclasses.field(default_factory=list)  # the metric's seconds per round
    model_thread: list[float] = dataclasses.field(default_factory=list)  # rounds.forward, in the thread
    forward: list[float] = dataclasses.field(default_factory=list)  # runner.extend (+ run_extend's sync)
    loop_busy: list[float] = dataclasses.field(default_factory=list)  # the event loop out of its poll, per step


class LoopBusy:
    """Seconds the running event loop spent outside its selector's poll (running callbacks: the
    GIL's other taker while the model thread runs a forward), read as a running total."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._polled = 0.0
        self._since = time.perf_counter()
        selector = loop._selector  # noqa: SLF001 (a bench's look inside asyncio's loop)
        select = selector.select

        def timed_select(timeout=None):
            began = time.perf_counter()
            try:
                return select(timeout)
            finally:
                self._polled += time.perf_counter() - began
        selector.select = timed_select

    def total(self) -> float:
        return time.perf_counter() - self._since - self._polled


def instrument(engine: PrefillEngine, holder: list[WorkerTimes], profiler: cProfile.Profile | None) -> None:
    """Times the engine's rounds at the levels of the module docstring into `holder[0]` (the mode
    being measured) and profiles the model thread's part."""
    rounds, runner = engine.rounds, engine.runner
    on_step, forward, extend = rounds.on_step, rounds.forward, runner.extend
    busy = LoopBusy(asyncio.get_running_loop())
    run_in = rounds.run_in

    async def timed_run_in(*args, **kwargs):
        before = busy.total()
        plan = await run_in(*args, **kwargs)
        if plan.items:  # a round ran (an empty plan returns at once and is no step)
            holder[0].loop_busy.append(busy.total() - before)
        return plan

    def timed_step(seconds, prompts, tokens):
        holder[0].step.append(seconds)
        on_step(seconds, prompts, tokens)

    first_token: list[record_function] = []  # --trace's window from the extend's end to the round's

    def timed_forward(*args, **kwargs):
        if profiler is not None:
            profiler.enable()
        began = time.perf_counter()
        try:
            with record_function("pd::worker_round"):
                return forward(*args, **kwargs)
        finally:
            while first_token:
                first_token.pop().__exit__(None, None, None)
            holder[0].model_thread.append(time.perf_counter() - began)
            if profiler is not None:
                profiler.disable()

    def timed_extend(*args, **kwargs):
        began = time.perf_counter()
        with record_function("pd::extend"):
            out = extend(*args, **kwargs)
            sync(str(out.device))  # run_extend syncs right after: the same wait, counted here
        holder[0].forward.append(time.perf_counter() - began)
        first_token.append(record_function("pd::first_token"))
        first_token[-1].__enter__()
        return out
    rounds.on_step, rounds.forward, runner.extend, rounds.run_in = timed_step, timed_forward, timed_extend, timed_run_in


# The model thread's call, in inference mode (as now) and as before (the model's no_grad alone).
MODES = {"inference": model_thread_module.model_call, "as_before": lambda fn, *args, stream=None: fn(*args)}


async def worker_steps(prefill_runner, decode_runner, prompts, args, modes: list[str],
                       thread_profiler: cProfile.Profile | None, loop_profiler: cProfile.Profile | None
                       ) -> tuple[dict[str, WorkerTimes], dict]:
    """Per mode of `modes`, the pairs of module docstring's 1 and 2; the modes take turns on each
    prompt, so they see the same machine too. Also the worker's own metrics over all the pairs
    (bench/worker_metrics.py's breakdown: what a serving run's scrape would say of them)."""
    config = WorkerConfig(kv_transport="grpc",
                          transport=TransportConfig(send_timeout_s=60, same_host_direct=args.same_host_direct),
                          bootstrap=BootstrapConfig(port=0),
                          scheduler=SchedulerConfig(chunked_prefill_size=args.chunk, prefix_cache=False,
                                                    layerwise_transfer=args.layerwise == "on"))
    prefill, decode = PrefillEngine(prefill_runner, config), DecodeEngine(decode_runner, config)
    await prefill.start()
    await decode.start()
    results = {mode: WorkerTimes() for mode in modes}
    holder = [results[modes[0]]]
    rooms = iter(range(1, 1 << 30))
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True,
                                repetition_penalty=args.repetition_penalty)

        async def one(prompt: list[int]) -> None:
            room = next(rooms)
            base = GenerateRequest(rid="r", input_ids=tuple(prompt), sampling=params,
                                   disagg=DisaggParams("127.0.0.1", prefill.bootstrap_port, room))

            async def drain(engine, request):
                last = None
                async for event in engine.generate(request):
                    last = event
                if not isinstance(last, Finished):
                    raise RuntimeError(f"{request.rid} ended with {last}")
            await asyncio.gather(drain(prefill, dataclasses.replace(base, rid=f"p{room}")),
                                 drain(decode, dataclasses.replace(base, rid=f"d{room}")))

        # Warm-up: connections, the peer's pool, first kernels (the runner's too).
        await prefill.model_thread.run(runner_alone, prefill_runner, prompts[0], args.device)
        await one(prompts[0])
        instrument(prefill, holder, thread_profiler)
        scraped = {"prefill-0": worker_metrics.parse(generate_latest(prefill.metrics.registry).decode())}
        traced = torch_trace(args) if args.trace else contextlib.nullcontext()
        for index, prompt in enumerate(prompts[1:]):
            if index == max(0, len(prompts) - 1 - TRACED_PAIRS):
                traced.__enter__()
            for mode in modes:
                model_thread_module.model_call = MODES[mode]
                holder[0] = results[mode]
                # The runner alone right before each request, in the worker's model thread and idle
                # engines: each pair sees the same machine (a shared CPU's load drifts within a run).
                holder[0].alone.append(await prefill.model_thread.run(runner_alone, prefill_runner, prompt,
                                                                      args.device))
                if loop_profiler is not None:
                    loop_profiler.enable()
                await one(prompt)
                if loop_profiler is not None:
                    loop_profiler.disable()
        if args.trace:
            traced.__exit__(None, None, None)
        after = {"prefill-0": worker_metrics.parse(generate_latest(prefill.metrics.registry).decode())}
        metrics = worker_metrics.breakdown(scraped, after)
    finally:
        model_thread_module.model_call = MODES["inference"]
        await decode.stop()
        await prefill.stop()
    return results, metrics


TRACED_PAIRS = 3  # --trace: the last pairs (runner alone, then the request) go into the trace


@contextlib.contextmanager
def torch_trace(args):
    """torch.profiler over the last `TRACED_PAIRS` pairs, every thread of the process: a Chrome
    trace (the GPU's idle gaps inside a worker's step against the runner's) and the ops' table."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    # The forwards run in the model thread, not this one: record the ops of every thread.
    with profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        yield prof
    args.trace.mkdir(parents=True, exist_ok=True)
    trace = args.trace / "prefill_step_trace.json"
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:  # Perfetto reads .json.gz
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    sort = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25)
    (args.trace / "prefill_step_ops.txt").write_text(table)
    attributed = step_attribution.attribute(prof.events())
    (args.trace / "prefill_step_attribution.json").write_text(json.dumps(attributed, indent=1))
    print(f"torch profiler: {trace}.gz (ui.perfetto.dev), ops in {args.trace}/prefill_step_ops.txt")
    print("where the traced steps' time goes (medians; bench/step_attribution.py):")
    print(step_attribution.table(attributed))


def top_functions(profiler: cProfile.Profile, limit: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def summary(worker: WorkerTimes, label: str, metrics: dict | None = None) -> dict:
    """Prints and returns one run of pairs: medians, the pairwise ratio, the split."""
    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    split = {"hop": ms([s - m for s, m in zip(worker.step, worker.model_thread)]),
             "forward": ms(worker.forward),
             "first_token": ms([m - f for m, f in zip(worker.model_thread, worker.forward)])}
    ratio = statistics.median(s / a for s, a in zip(worker.step, worker.alone))  # pairwise, then the median
    runner_ms, step_ms = ms(worker.alone), ms(worker.step)
    step_mean, step_max = statistics.mean(worker.step) * 1e3, max(worker.step) * 1e3
    print(f"-- {label}")
    print(f"{'runner extend + sync':<26} {runner_ms:>9.2f} ms")
    print(f"{'worker step (metrics)':<26} {step_ms:>9.2f} ms   ratio {ratio:.3f} (target <= {TARGET})")
    # The workers' /metrics (bench/worker_metrics.py) give means, runner_steps.py medians: a few slow
    # steps (a first-seen kernel specialisation, a full GC) move the one and not the other.
    print(f"{'  mean / max':<26} {step_mean:>9.2f} / {step_max:.2f} ms (runner alone: "
          f"{statistics.mean(worker.alone) * 1e3:.2f} / {max(worker.alone) * 1e3:.2f})")
    for part, value in split.items():
        print(f"{'  ' + part:<26} {value:>9.2f} ms")
    print(f"{'event loop busy in a step':<26} {ms(worker.loop_busy):>9.2f} ms   (callbacks run beside the forward)")
    if metrics:  # what a serving run's scrape says of the same rounds (bench/worker_metrics.py)
        print("the worker's own metrics over these rounds (every mode):\n" + worker_metrics.describe(metrics))
    return {"runner_ms": runner_ms, "step_ms": step_ms, "step_mean_ms": step_mean, "split_ms": split,
            "loop_busy_ms": ms(worker.loop_busy), "ratio": ratio, "seconds": dataclasses.asdict(worker)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    rng = random.Random(0)
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # OpenMP teams thrash on a shared CPU (and in the engines' threads)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    path = model_path(args)
    pages = 2 * (-(-args.tokens // args.page_size)) + 8
    prefill_runner = ModelRunner(runner_config(args, path, pages))
    decode_runner = ModelRunner.from_model(prefill_runner.model, dataclasses.replace(prefill_runner.config,
                                                                                     num_pages=pages))
    vocab = prefill_runner.model_config.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(2, vocab) for _ in range(args.tokens)] for _ in range(args.repeats + 1)]

    thread_profiler = cProfile.Profile() if args.profile else None
    loop_profiler = cProfile.Profile() if args.profile else None
    modes = ["as_before"] if args.no_inference_mode else ["inference"] + (
        ["as_before"] if args.also_without_inference_mode else [])
    runs, metrics = asyncio.run(worker_steps(prefill_runner, decode_runner, prompts(), args, modes, thread_profiler,
                                    loop_profiler))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\nprefill worker step vs runner: {args.tokens}-token prompts, {path}, {args.device} ({name}), "
          f"{args.dtype}, page {args.page_size}, layer-wise {args.layerwise}, same_host_direct {args.same_host_direct}, "
          f"repetition penalty {args.repetition_penalty}, GIL switch interval {sys.getswitchinterval() * 1e3:g} ms, "
          f"{args.repeats} requests at concurrency 1 per mode, the modes in turn (medians)")
    labels = {"inference": "model thread in inference mode", "as_before": "model thread without inference mode (as before)"}
    result = {"tokens": args.tokens, "model": path, "device": args.device, "device_name": name,
              "dtype": args.dtype, "page_size": args.page_size, "inference_mode": not args.no_inference_mode,
              "layerwise": args.layerwise, "same_host_direct": args.same_host_direct,
              "repetition_penalty": args.repetition_penalty, "switch_interval_s": sys.getswitchinterval(), **summary(runs[modes[0]], labels[modes[0]], metrics),
              "worker_metrics": metrics}
    result["check"] = check(f"prefill worker step / runner extend, {args.tokens} tokens, c=1", result["ratio"],
                            "<=", TARGET)
    if len(modes) > 1:
        result["without_inference_mode"] = summary(runs["as_before"], labels["as_before"])
    if args.profile:
        args.profile.write_text("model thread (rounds.forward)\n" + top_functions(thread_profiler)
                                + "\nevent loop\n" + top_functions(loop_profiler))
        print(f"profiles in {args.profile}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
