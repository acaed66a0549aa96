"""What a decode step gains from a high-priority CUDA stream while a prefill load runs on the same GPU.

A decode-shaped step (a CUDA graph of `--layers` pairs of GEMMs at `--decode-batch` rows, V2-Lite's
hidden and dense intermediate sizes: launch- and bandwidth-bound, as a decode step is) is replayed
and timed (host wall time to its end, p50/p90 over `--seconds`) in these cases:
    alone                 nothing else on the GPU
    load, same priority   a prefill-shaped load (GEMMs of `--prefill-tokens` rows, back to back)
                          runs; the step's stream has the default priority
    load, greatest        the same load; the step's stream has the device's greatest priority,
                          as a decode worker's model thread (workers/engine/model_stream.py)
The load runs in another thread of the same process (`--mode threads`: one CUDA context, where
stream priorities act) or in another process (`--mode processes`: two contexts, which time-slice
the GPU unless the MPS daemon runs: the serving arrangement of `up` 1P1D on one GPU). Run it once
plain and once under `nvidia-cuda-mps-control -d` to see both (bench/serving_mps_session.sh does
the end-to-end A/B).

    python3 bench/stream_priority.py --mode threads,processes --json $OUT/stream_priority.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path

import torch

HIDDEN, INTERMEDIATE = 2048, 10944  # V2-Lite's hidden size and dense MLP width


def _decode_graph(args: argparse.Namespace, stream: torch.cuda.Stream):
    """A captured decode-shaped step, replayed on `stream`; it holds its weights and input (the
    graph reads their memory, which must outlive it)."""
    weights = [(torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16) * 0.02,
                torch.randn(INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02)
               for _ in range(args.layers)]
    x = torch.randn(args.decode_batch, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step():
        h = x
        for up, down in weights:
            h = h + torch.relu(h @ up) @ down
        return h

    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    torch.cuda.synchronize()
    graph.held = (weights, x)
    return graph


def _time_steps(graph, stream: torch.cuda.Stream, seconds: float) -> list[float]:
    times = []
    end = time.perf_counter() + seconds
    with torch.cuda.stream(stream):
        while time.perf_counter() < end:
            began = time.perf_counter()
            graph.replay()
            stream.synchronize()
            times.append((time.perf_counter() - began) * 1e3)
    return times[3:]


def _load(tokens: int, stop, ready) -> None:
    """The prefill-shaped load on this thread's default stream (priority 0, as a prefill worker's),
    until `stop` is set; at most a few GEMMs queued ahead, as a forward's launches are."""
    a = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    ready.set()
    stream = torch.cuda.current_stream()
    while not stop.is_set():
        for _ in range(8):
            a @ w
        stream.synchronize()  # its own stream only: a device sync would wait for the decode steps too


def _load_process(tokens: int, stop, ready) -> None:
    _load(tokens, stop, ready)


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"p50_ms": statistics.median(ordered), "p90_ms": ordered[int(len(ordered) * 0.9)], "steps": len(ordered)}


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    _least, greatest = torch.cuda.Stream.priority_range()
    streams = {"same": torch.cuda.Stream(priority=0), "greatest": torch.cuda.Stream(priority=greatest)}
    graphs = {name: _decode_graph(args, stream) for name, stream in streams.items()}
    results = {"alone": _summary(_time_steps(graphs["same"], streams["same"], args.seconds))}
    if mode == "threads":
        stop, ready = threading.Event(), threading.Event()
        worker = threading.Thread(target=_load, args=(args.prefill_tokens, stop, ready), daemon=True)
    else:
        context = mp.get_context("spawn")
        stop, ready = context.Event(), context.Event()
        worker = context.Process(target=_load_process, args=(args.prefill_tokens, stop, ready), daemon=True)
    worker.start()
    ready.wait(120)
    try:
        for name in ("same", "greatest"):
            results[f"load, {name} priority"] = _summary(_time_steps(graphs[name], streams[name], args.seconds))
    finally:
        stop.set()
        worker.join(60)
    alone = results["alone"]["p50_ms"]
    for row in results.values():
        row["vs_alone"] = row["p50_ms"] / alone
    results["stream_priorities"] = {"greatest": greatest, "decode_stream": streams["greatest"].priority}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="threads,processes", help="threads, processes or both (comma-separated)")
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=4.0, help="timed replays per case")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), **{mode: run_mode(mode, args) for mode in args.mode.split(",")}}
    for mode in args.mode.split(","):
        for case, row in report[mode].items():
            if "p50_ms" in row:
                print(f"{mode:9} {case:24} p50 {row['p50_ms']:7.3f} ms  p90 {row['p90_ms']:7.3f} ms  "
                      f"x{row['vs_alone']:.2f} of alone  ({row['steps']} steps)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
