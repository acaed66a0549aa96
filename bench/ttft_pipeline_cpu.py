"""Issue 25's c = 1 TTFT stage by stage, in `up`'s real layout behind the real gateway, against
the runner's prefill of the same prompt measured in the same run.

    .venv/bin/python bench/ttft_pipeline_cpu.py                    # CPU: the `ops` shape, 128 tokens
    python bench/ttft_pipeline_cpu.py --device cuda --write-v2-lite  # 789 tokens

First the runner alone (`runner.extend` of one seed-drawn prompt, synced, in a spawned process:
bench/prefill_thread_cpu.py's `runner_alone`), then `deepseek-pd up` (one prefill and one decode
worker, smg) and `--requests` streamed `/generate` requests one at a time (greedy, two tokens).
The client's TTFT is its first streamed token. The stages come from what the workers already
keep (bench/worker_metrics.py: their /metrics scraped before and after, so no new always-on
cost): each worker's own TTFT, decode's KV receive (handshake to checked TransferDone), the
prefill request's phases (until decode's handshake, until its first token, until TransferDone is
through) and the prefill round's phases. These are means per request; the client's TTFT is shown
as its p50 and its mean, and the pipeline part (client TTFT − the prefill round) is the part that
is not the step:

    gateway + HTTP        = client TTFT − decode worker's TTFT
    decode, outside KV    = decode worker's TTFT − its KV receive (its Generate to its handshake,
                            TransferDone to its first token out)
    prefill handshake     (prefill's Generate until decode's handshake arrives)
    prefill to 1st token  (of which the prefill round's phases; the rest is scheduling and hops)
    prefill finish        (first token until TransferDone is through)

On the CPU the workers run one torch thread (OMP_NUM_THREADS=1, as prefill_thread_cpu.py's), so
the step is small and the rest is the same code as on the GPU.
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
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from deepseek_pd.model.config import ModelConfig  # noqa: E402
from prefill_host_overhead import add_model_args, model_dir  # noqa: E402
from prefill_thread_cpu import _worker_flags, prompts, runner_alone  # noqa: E402
from up_process import UpProcess, UpSpec  # noqa: E402
import worker_metrics  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--requests", type=int, default=30, help="c = 1 requests measured")
    parser.add_argument("--runner-repeats", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=2,
                        help="tokens per request (1: decode runs no step after the first token)")
    parser.add_argument("--worker-arg", action="append", default=[], help="a flag for every worker (repeatable)")
    parser.add_argument("--seed", type=int, default=None, help="the prompts' seed (default: drawn and printed)")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (789 if args.device.startswith("cuda") else 128)
    args.seed = random.randrange(1 << 30) if args.seed is None else args.seed
    return args


def stream_ttft(url: str, served: str, input_ids: list[int], max_new_tokens: int = 2) -> float:
    """Seconds from sending a streamed greedy /generate to its first token's event; the stream is
    then read to its end."""
    body = json.dumps({"model": served, "input_ids": input_ids, "stream": True,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})
    request = urllib.request.Request(f"{url}/generate", body.encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply:
            if ttft is None and line.startswith(b"data:") and b"output_ids" in line:
                event = json.loads(line[5:]) if line[5:].strip() != b"[DONE]" else {}
                if event.get("output_ids"):
                    ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft


def stages(rows: dict[str, dict], client_mean_ms: float) -> list[tuple[str, float]]:
    """The stage table (ms, means per request) from worker_metrics.breakdown's rows."""
    prefill = next(row for name, row in rows.items() if name.startswith("prefill"))
    decode = next(row for name, row in rows.items() if name.startswith("decode"))
    request = prefill.get("prefill_request_phases_ms", {})
    phases = prefill.get("prefill_phases_ms", {})
    step = prefill.get("prefill_step_ms", 0.0)
    to_first = request.get("prefill", 0.0)
    out = [("gateway + HTTP (client − decode TTFT)", client_mean_ms - decode.get("ttft_ms", 0.0)),
           ("decode outside KV receive", decode.get("ttft_ms", 0.0) - decode.get("kv_ms", 0.0)),
           ("prefill: until decode's handshake", request.get("handshake", 0.0)),
           ("prefill: to first token, not the step", to_first - step),
           ("prefill: the step (round)", step)]
    out += [(f"    round phase {phase}", ms) for phase, ms in worker_metrics._in_order(phases)]
    out += [("prefill: first token to TransferDone", request.get("finish", 0.0))]
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    directory = model_dir(args)
    config = ModelConfig.from_hf(directory / "config.json")
    print(f"ttft_pipeline_cpu: model {directory}, device {args.device}, {args.tokens} tokens, "
          f"{args.requests} requests at c = 1, seed {args.seed}", flush=True)
    if not args.device.startswith("cuda"):  # the forward's ops in the model thread (module doc)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    rng = random.Random(args.seed)
    batch = prompts(rng, config.vocab_size, args.tokens, 1)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as apart:
        runner = apart.submit(runner_alone, directory, args.device, [batch], args.runner_repeats).result()[0]
    runner_ms = runner["wall_s"] * 1e3
    print(f"runner alone, {args.tokens} tokens: {runner_ms:.2f} ms", flush=True)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="ttft-pipeline-")) / "logs"
    flags = [f for f in _worker_flags(args.device) if not f.startswith("--num-pages")] + args.worker_arg
    with UpProcess(UpSpec(directory, log_dir, worker_args=tuple(flags))) as up:
        served = directory.name
        for ids in prompts(rng, config.vocab_size, args.tokens, 3):  # untimed: first calls
            stream_ttft(up.url, served, ids)
        urls = worker_metrics.metrics_urls(log_dir)
        before = worker_metrics.scrape(urls)
        ttfts = [stream_ttft(up.url, served, ids, args.max_new_tokens) * 1e3
                 for ids in prompts(rng, config.vocab_size, args.tokens, args.requests)]
        rows = worker_metrics.breakdown(before, worker_metrics.scrape(urls))
    p50, mean = statistics.median(ttfts), statistics.mean(ttfts)
    table = stages(rows, mean)
    print(f"{'stage (means per request)':<42} {'ms':>8}")
    for name, ms in table:
        print(f"{name:<42} {ms:8.2f}")
    top = sum(ms for name, ms in table if not name.startswith(" "))
    step = dict(table)["prefill: the step (round)"]
    print(f"{'sum of the stages':<42} {top:8.2f}   (client TTFT mean {mean:.2f}, p50 {p50:.2f})")
    print(f"TTFT p50 − runner prefill: {p50 - runner_ms:+.2f} ms (runner {runner_ms:.2f} ms); "
          f"the pipeline around the step (client mean − step): {mean - step:.2f} ms")
    print(worker_metrics.describe(rows))
    result = {"seed": args.seed, "tokens": args.tokens, "device": args.device, "runner_ms": runner_ms,
              "ttft_ms": ttfts, "ttft_p50_ms": p50, "ttft_mean_ms": mean, "stages": table, "workers": rows,
              "worker_flags": flags}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
