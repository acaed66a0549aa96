"""Where the gRPC sender's staging time goes on a GPU: `PageGather.gather` alone, without gRPC.

    python bench/kv_stage_gpu.py                  # V2-Lite shape, 4k tokens, 4 MiB chunks
    python bench/kv_stage_gpu.py --busy-process   # ... while another process keeps the GPU busy

One request's pages (scattered page ids, as a transfer sees them) are gathered chunk by chunk, the
way `GrpcChannel` cuts them (`split_into_chunks`), by 1 and by `--threads` threads sharing one
`PageGather` of as many slots. Printed per variant: GB/s over the whole request and ms per chunk,
next to two ceilings measured in the same run: one pinned D2H copy of a chunk's bytes, and the
device gather (`index_select` per layer) of a chunk alone, both timed with CUDA events.

`--busy-process` starts a child process that runs matmuls on the same GPU for the whole run, as the
decode worker does when 1P1D share one GPU: two processes' kernels are time-sliced by the driver
(no MPS), so each host sync in the staging path can wait for the other context's time slice.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.page_io import PageGather
from deepseek_pd.workers.transport.plan import split_into_chunks


def _busy(stop: "multiprocessing.synchronize.Event", device: str) -> None:
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def _ms_events(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    num_pages = -(-args.tokens // args.page_size)
    pool = KVPool(num_layers=args.layers, num_pages=num_pages * 2 + 1, page_size=args.page_size,
                  kv_dim=args.kv_dim, dtype=torch.bfloat16, device=device)
    for buffer in pool.buffers:
        buffer.normal_()
    pages = random.Random(0).sample(range(1, pool.num_pages), num_pages)
    chunk_bytes = int(args.chunk_mb * 2**20)
    shapes = split_into_chunks(range(args.layers), range(num_pages), pool.bytes_per_page, chunk_bytes)
    total = args.layers * num_pages * pool.bytes_per_page
    one = shapes[0]
    one_pages = pages[one.page_begin:one.page_end]
    one_bytes = (one.layer_end - one.layer_begin) * len(one_pages) * pool.bytes_per_page
    result: dict = {"tokens": args.tokens, "bytes": total, "chunks": len(shapes), "chunk_bytes": one_bytes}

    host = torch.empty(one_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(one_bytes, dtype=torch.uint8, device=device)
    result["ceiling_d2h_ms"] = _ms_events(lambda: host.copy_(dev, non_blocking=True))
    index = torch.as_tensor(one_pages, device=device)
    staged = dev.view(torch.bfloat16).view(one.layer_end - one.layer_begin, len(one_pages), args.page_size,
                                           args.kv_dim)

    def device_gather() -> None:
        for offset, layer in enumerate(range(one.layer_begin, one.layer_end)):
            torch.index_select(pool.buffers[layer], 0, index, out=staged[offset])
    result["ceiling_gather_ms"] = _ms_events(device_gather)

    for threads in (1, args.threads):
        gather = PageGather(pool, chunk_bytes, threads)
        waits: list[float] = []

        def stage(shape) -> float:
            began = time.perf_counter()
            with gather.gather(range(shape.layer_begin, shape.layer_end), pages[shape.page_begin:shape.page_end],
                               on_slot_wait=waits.append) as data:
                took = time.perf_counter() - began
                assert data.nbytes > 0
            return took

        with ThreadPoolExecutor(threads) as executor:
            list(executor.map(stage, shapes))  # warm-up: the slots' pinned memory
            walls, per_chunk = [], []
            for _ in range(args.repeats):
                waits.clear()
                began = time.perf_counter()
                per_chunk += list(executor.map(stage, shapes))
                walls.append(time.perf_counter() - began)
        best = min(walls)
        result[f"threads_{threads}"] = {
            "gb_s": total / best / 1e9, "wall_ms": best * 1e3,
            "chunk_ms_median": statistics.median(per_chunk) * 1e3, "chunk_ms_max": max(per_chunk) * 1e3,
            "slot_wait_ms_per_request": sum(waits) * 1e3}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--kv-dim", type=int, default=576)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy-process", action="store_true", help="another process keeps the GPU busy")
    args = parser.parse_args()
    stop, child = None, None
    if args.busy_process:
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        child = context.Process(target=_busy, args=(stop, args.device), daemon=True)
        child.start()
        time.sleep(5)  # its context and first matmuls are up
    try:
        result = measure(args)
    finally:
        if child is not None:
            stop.set()
            child.join(30)
    result["busy_process"] = args.busy_process
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
