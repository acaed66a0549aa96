"""The runner's extend eager against piecewise extend graphs (model/extend_graph.py), in one process.

One runner with `extend_cuda_graph` (the same weights for both paths: eager is the same runner with
its extend graphs set aside), one prompt of each `--lengths` and a batch of `--batch` prompts
(`COUNTxLEN`), each timed `--repeats` times per path: `wall_ms`, the call plus a device sync, and
`host_ms`, until the call returns (the host's share, what piecewise graphs cut). Medians, and the
ratios eager / graphs, are printed per case; the logits of both paths are compared (relative
error, greedy argmax). The model: a random-weight V2-Lite checkpoint (bench/random_checkpoint.py,
written once under /tmp) or `--model DIR`.

    python bench/extend_graph_gpu.py --out extend_graph.json               # H100/H200, < 5 min
    python bench/extend_graph_gpu.py --device cpu                          # tiny model: the pieces as plain calls

On the CPU the graphs cannot be captured: the tiny model's runner gets `ExtendGraphRunner(capture=False)`,
so the same pieces run as plain calls over the padded rows (the path's overhead, no speed-up).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # random_checkpoint, when run from elsewhere

from deepseek_pd.model.extend_graph import ExtendGraphRunner  # noqa: E402
from deepseek_pd.model.runner import ExtendSeq, ModelRunner  # noqa: E402
from deepseek_pd.model.runner_config import RunnerConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: random V2-Lite on CUDA, "
                                                       "tiny on the CPU)")
    parser.add_argument("--lengths", default=None, help="one-prompt cases, comma-separated (GPU: 256,789,2048)")
    parser.add_argument("--batch", default=None, help="a batch case, COUNTxLEN (GPU: 8x240)")
    parser.add_argument("--max-tokens", type=int, default=None, help="extend_graph_max_tokens (GPU: 2048)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, metavar="FILE", help="the results as JSON")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.lengths = [int(n) for n in (args.lengths or ("256,789,2048" if cuda else "40,100")).split(",")]
    count, length = (args.batch or ("8x240" if cuda else "3x30")).split("x")
    args.batch = (int(count), int(length))
    args.max_tokens = args.max_tokens or (2048 if cuda else 128)
    args.repeats = args.repeats or (10 if cuda else 3)
    return args


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if not args.device.startswith("cuda"):
        return "tiny"
    from random_checkpoint import ensure_random_checkpoint, v2_lite_config

    directory = Path("/tmp/deepseek-pd-bench/v2-lite-random")  # serving_gpu.py's: reused when it wrote it
    ensure_random_checkpoint(directory, v2_lite_config(), device=args.device)
    return str(directory)


def build_runner(args: argparse.Namespace) -> ModelRunner:
    cuda = args.device.startswith("cuda")
    config = RunnerConfig(model=model_path(args), device=args.device, dtype="bfloat16" if cuda else "float32",
                          page_size=64 if cuda else 16, num_pages=512 if cuda else 256,
                          extend_cuda_graph=cuda, extend_graph_max_tokens=args.max_tokens)
    runner = ModelRunner(config)
    if not cuda:  # no capture off CUDA: the same pieces as plain calls
        runner.extend_graphs = ExtendGraphRunner(runner.model, runner.kv_pool, args.max_tokens,
                                                 runner.kv_pool.alloc(1)[0], capture=False)
    return runner


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_case(runner: ModelRunner, graphs: ExtendGraphRunner, prompts: list[list[int]], repeats: int,
              device: str) -> dict:
    """Both paths over the same prompts (fresh pages per case, reused per call: each call rewrites them)."""
    pool = runner.kv_pool
    pages = [pool.alloc(pool.pages_for_tokens(len(p))) for p in prompts]
    seqs = [ExtendSeq(p, 0, sp) for p, sp in zip(prompts, pages)]
    result: dict = {"tokens": sum(map(len, prompts)), "sequences": len(prompts)}
    logits = {}
    try:
        with torch.inference_mode():
            for path in ("eager", "graphs"):
                runner.extend_graphs = graphs if path == "graphs" else None
                for _ in range(2):  # compile, plan, settle the allocator
                    logits[path] = runner.extend(seqs)
                _sync(device)
                walls, hosts = [], []
                for _ in range(repeats):
                    began = time.perf_counter()
                    runner.extend(seqs)
                    returned = time.perf_counter()
                    _sync(device)
                    walls.append((time.perf_counter() - began) * 1e3)
                    hosts.append((returned - began) * 1e3)
                result[path] = {"wall_ms": statistics.median(walls), "host_ms": statistics.median(hosts)}
    finally:
        runner.extend_graphs = graphs
        for seq_pages in pages:
            pool.free(seq_pages)
    eager, graphed = logits["eager"].float(), logits["graphs"].float()
    result["logits_rel_err"] = float((graphed - eager).norm() / eager.norm())
    result["argmax_equal"] = bool(torch.equal(graphed.argmax(-1), eager.argmax(-1)))
    result["wall_ratio"] = result["eager"]["wall_ms"] / result["graphs"]["wall_ms"]
    result["host_ratio"] = result["eager"]["host_ms"] / result["graphs"]["host_ms"]
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    runner = build_runner(args)
    graphs = runner.extend_graphs
    built_s = time.perf_counter() - started
    vocab = runner.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    cases = {f"1x{n}": [prompt(n)] for n in args.lengths}
    count, length = args.batch
    cases[f"{count}x{length}"] = [prompt(length) for _ in range(count)]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"device": device_name, "model": runner.config.model, "buckets": list(graphs.buckets),
              "build_s": round(built_s, 1), "cases": {}}
    print(f"{device_name}; extend graphs for {list(graphs.buckets)} tokens, runner built in {built_s:.1f} s")
    print(f"{'case':>9} {'tokens':>6} | {'eager wall':>10} {'graph wall':>10} {'ratio':>5} | "
          f"{'eager host':>10} {'graph host':>10} {'ratio':>5} | rel err  argmax")
    for name, prompts in cases.items():
        r = time_case(runner, graphs, prompts, args.repeats, args.device)
        report["cases"][name] = r
        e, g = r["eager"], r["graphs"]
        print(f"{name:>9} {r['tokens']:>6} | {e['wall_ms']:>8.2f}ms {g['wall_ms']:>8.2f}ms {r['wall_ratio']:>5.2f} | "
              f"{e['host_ms']:>8.2f}ms {g['host_ms']:>8.2f}ms {r['host_ratio']:>5.2f} | "
              f"{r['logits_rel_err']:.1e}  {'equal' if r['argmax_equal'] else 'DIFFER'}")
    print(f"extend paths: {runner.extend_paths}")
    report["extend_paths"] = dict(runner.extend_paths)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
