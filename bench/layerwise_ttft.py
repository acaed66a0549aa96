"""Layer-wise KV streaming vs per-chunk sends: PD TTFT against the prefill compute time, one run.

    .venv/bin/python bench/layerwise_ttft.py --tokens 512                      # CPU, tiny model
    .venv/bin/python bench/layerwise_ttft.py --device cuda --shape v2-lite     # the issue-7 target, 8k

In one process (one set of weights, two runners with their own KV pools): a prefill and a decode
engine over the real bootstrap service on loopback (grpc or mooncake). Measured for one prompt of
`--tokens`: the prefill compute alone (the runner's chunked extends + first-token sample, as the
engine runs them), then PD TTFT (both Generates sent at once -> decode's first token) with
layer-wise streaming on and off, each on one running pair of engines after one untimed warm-up
request (as a deployment runs; the first request's connections and staging are not the steady state). Caveat: both engines share one process and GIL (conservative).
On CUDA the grpc transport copies same-host pools directly, and a direct channel sends per chunk
whatever `layerwise_transfer` says (`SendChannel.streams_layers`): both rows then time the path a
deployment on one host takes. `--same-host-direct off` times the byte stream, where layer-wise pays.
Prints a table with TTFT / compute against the 1.1x target; `--json FILE` also writes the
seconds and the target check (`bench/target_check.py`) for `bench/serving_gpu.py`'s one table.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig  # noqa: E402
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState  # noqa: E402
from deepseek_pd.model.sampling.params import SamplingParams  # noqa: E402
from deepseek_pd.workers.engine.interface import DisaggParams, GenerateRequest, TokenChunk  # noqa: E402
from deepseek_pd.workers.engine.extend_step import run_extend  # noqa: E402
from deepseek_pd.workers.transport import TransportConfig  # noqa: E402
from deepseek_pd.workers.transport.base import SAME_HOST_DIRECT_MODES  # noqa: E402
from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig  # noqa: E402
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig  # noqa: E402
from deepseek_pd.workers.transport.worker_config import WorkerConfig  # noqa: E402
from deepseek_pd.workers.decode.engine import DecodeEngine  # noqa: E402
from deepseek_pd.workers.prefill.engine import PrefillEngine  # noqa: E402
from target_check import check  # noqa: E402

TARGET = 1.1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=["tiny", "v2-lite"], default="tiny")
    parser.add_argument("--model", default=None, help="a checkpoint directory (overrides --shape)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=8192, help="chunked_prefill_size")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--transport", default="grpc", choices=["grpc", "mooncake"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--same-host-direct", choices=SAME_HOST_DIRECT_MODES, default=TransportConfig.same_host_direct,
                        help="grpc: copy the decode pool directly when it is this process's (see above)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write every repeat's seconds and the target check to FILE")
    return parser.parse_args(argv)


def model_path(args) -> str:
    if args.model:
        return args.model
    if args.shape == "tiny":
        return "tiny"
    from random_checkpoint import ensure_random_checkpoint, v2_lite_config
    directory = Path("/tmp/deepseek-pd-v2-lite-random")
    ensure_random_checkpoint(directory, v2_lite_config(), device=args.device)
    return str(directory)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def compute_seconds(runner: ModelRunner, prompt: list[int], chunk: int, device: str) -> float:
    """The prefill's own work: the engine's chunked extends and the first-token sample."""
    pages = runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(prompt)))
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    try:
        sync(device)
        began = time.perf_counter()
        for start in range(0, len(prompt), chunk):
            last = start + chunk >= len(prompt)
            state = SamplingState.create(params, prompt, runner.model_config.vocab_size, device=runner.model.options.device)
            run_extend(runner, Sampler(), [ExtendSeq(prompt[start:start + chunk], start, pages)],
                       [0] if last else [], [state] if last else [])
        sync(device)
        return time.perf_counter() - began
    finally:
        runner.kv_pool.free(pages)


async def pd_ttfts(prefill_runner, decode_runner, prompts, args, layerwise: bool, room: int) -> list[float]:
    """PD TTFT of each of `prompts` (both Generates sent at once -> decode's first token) on one
    running prefill + decode pair, after one untimed warm-up request: what a running deployment
    pays, without the first request's one-time costs (connections, staging, opening the peer)."""
    config = WorkerConfig(kv_transport=args.transport,
                          transport=TransportConfig(send_timeout_s=60, same_host_direct=args.same_host_direct),
                          bootstrap=BootstrapConfig(port=0),
                          scheduler=SchedulerConfig(chunked_prefill_size=args.chunk, layerwise_transfer=layerwise,
                                                    prefix_cache=False))  # a cache hit would skip compute
    prefill, decode = PrefillEngine(prefill_runner, config), DecodeEngine(decode_runner, config)
    await prefill.start()
    await decode.start()
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)

        async def one(prompt: list[int], room: int) -> float:
            base = GenerateRequest(rid="r", input_ids=tuple(prompt), sampling=params,
                                   disagg=DisaggParams("127.0.0.1", prefill.bootstrap_port, room))
            first: list[float] = []

            async def drain(engine, request, note):
                async for event in engine.generate(request):
                    if note and isinstance(event, TokenChunk) and not first:
                        first.append(time.perf_counter())
            began = time.perf_counter()
            await asyncio.gather(drain(prefill, dataclasses.replace(base, rid=f"p{room}"), False),
                                 drain(decode, dataclasses.replace(base, rid=f"d{room}"), True))
            return first[0] - began

        await one(prompts[0], room)  # warm-up
        return [await one(prompt, room + 1 + i) for i, prompt in enumerate(prompts[1:])]
    finally:
        await decode.stop()
        await prefill.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # OpenMP teams thrash on a shared CPU (and in the engines' threads)
    path = model_path(args)
    pages = 2 * (-(-args.tokens // args.page_size)) + 8
    prefill_runner = ModelRunner(RunnerConfig(model=path, device=args.device, page_size=args.page_size, num_pages=pages))
    decode_runner = ModelRunner.from_model(prefill_runner.model, dataclasses.replace(prefill_runner.config, num_pages=pages))
    vocab = prefill_runner.model_config.vocab_size
    prompt = [random.randrange(2, vocab) for _ in range(args.tokens)]
    compute_seconds(prefill_runner, prompt, args.chunk, args.device)  # warm-up
    results = {"compute": [compute_seconds(prefill_runner, prompt, args.chunk, args.device)
                           for _ in range(args.repeats)]}
    for index, (name, layerwise) in enumerate((("layer-wise", True), ("per-chunk", False))):
        # Fresh prompts of the same length: the decode side's pages and the prefill's work are new each time.
        prompts = [[random.randrange(2, vocab) for _ in range(args.tokens)] for _ in range(args.repeats + 1)]
        results[name] = asyncio.run(pd_ttfts(prefill_runner, decode_runner, prompts, args, layerwise,
                                             1000 * (index + 1)))
    compute = statistics.median(results["compute"])
    print(f"\nlayer-wise TTFT: {args.tokens} tokens, {path}, {args.device}, {args.transport} "
          f"(same_host_direct {args.same_host_direct}), "
          f"chunk {args.chunk}, page {args.page_size}, {args.repeats} repeats (median)")
    print(f"{'what':<12} {'ms':>9} {'x compute':>10} {'target':>8}")
    for name, values in results.items():
        ms = statistics.median(values) * 1e3
        ratio = statistics.median(values) / compute
        verdict = "" if name == "compute" else ("ok" if ratio <= TARGET else "missed")
        print(f"{name:<12} {ms:>9.1f} {ratio:>10.3f} {verdict:>8}")
    if args.json:
        ratio = statistics.median(results["layer-wise"]) / compute
        args.json.write_text(json.dumps({
            "tokens": args.tokens, "model": path, "device": args.device, "transport": args.transport,
            "same_host_direct": args.same_host_direct,
            "chunk": args.chunk, "page_size": args.page_size, "seconds": results,
            "check": check(f"layer-wise PD TTFT / prefill compute, {args.tokens} tokens", ratio, "<=", TARGET)},
            indent=2))


if __name__ == "__main__":
    main()
