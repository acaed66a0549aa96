"""Decode's finite check over gRPC, after the TransferDone (before) and per chunk as it lands (now).

    .venv/bin/python bench/grpc_finite_landing.py                 # CPU, V2-Lite shape, 4096 tokens

One V2-Lite-shaped bf16 pool (27 layers, 576-wide latent, 64-token pages) holding a `--tokens`
prompt in scattered pages, cut into the grpc sender's chunks (`--chunk-mb`, whole pages of every
layer). Prints the best of `--repeats` of
  after done  `check_kv_finite` over every page of the prompt: what pull_kv ran on the first
              token's path after the TransferDone before (and still runs for the fake transport);
  per chunk   `check_data_finite` on each chunk's bytes, summed (in the sink's threads, as each
              chunk arrives, before its write: kv_checks.FiniteOnLanding), and the last chunk's
              alone (the most of it that can precede the TransferDone on the stream).
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.decode.kv_checks import check_data_finite, check_kv_finite
from deepseek_pd.workers.transport.page_io import read_pages


def _best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    layers, page_size = 27, 64
    num_pages = -(-args.tokens // page_size)
    pool = KVPool(layers, num_pages * 2 + 1, page_size, 576, dtype=torch.bfloat16)
    for buffer in pool.buffers:
        buffer.normal_()
    pages = random.Random(0).sample(range(pool.num_pages), num_pages)
    per_chunk = max(1, int(args.chunk_mb * 2**20) // (layers * pool.bytes_per_page))
    chunks = [memoryview(read_pages(pool, range(layers), pages[i:i + per_chunk]))
              for i in range(0, num_pages, per_chunk)]
    after_done = _best_ms(lambda: check_kv_finite(pool, pages, "bench"), args.repeats)
    each = [_best_ms(lambda data=data: check_data_finite(data, pool.dtype, range(layers), "bench"), args.repeats)
            for data in chunks]
    mb = num_pages * layers * pool.bytes_per_page / 1e6
    print(f"{args.tokens} tokens, {mb:.1f} MB, {len(chunks)} chunks of {per_chunk} pages")
    print(f"after done: {after_done:.1f} ms on the first token's path")
    print(f"per chunk:  {sum(each):.1f} ms summed in the sink's threads; last chunk {each[-1]:.2f} ms")


if __name__ == "__main__":
    main()
