"""Before a worker serves: every CUDA kernel and buffer its KV transport's threads use, made once.

Why. A prefill worker sends a chunk's KV from a transport thread while the model thread has
already queued the next forward on the default stream. The copy is ordered only after an event
recorded between the two forwards (`kv_written_event`), so on the GPU it can run beside that
forward. But the host calls that issue it can still wait for the whole device:

- the first launch of a kernel in a process loads its module (CUDA's lazy loading, the default
  since 12.2), and the CUDA guide says that loading may synchronise the context: it then waits
  for every kernel queued so far, the next forward included;
- a page-locked host allocation (the byte stream's staging) and a device allocation that the
  caching allocator cannot serve from its per-stream cache are on the guide's list of implicitly
  synchronising calls;
- a copy from pageable host memory shares the driver's staging with the model thread's own
  pageable copies, which wait behind the forward: page ids go through a page-locked buffer each
  transport thread reserves here (model/host_copy_staging.py): page ids, and on the receiver a chunk's bytes.

On an H100 the first per-chunk send of a fresh worker went out only 0.01 s before the next forward
ended, for direct copies and the byte stream alike (tests/workers/prefill/test_chunk_send_order_cuda.py,
2648c43). So each transport thread runs its copies once here, on its own streams, over both index
sizes torch picks different kernels for (up to 16 indices, and more), before the first forward;
the staging slots are made when `PageGather` is built, and a direct copy gathers at most
`direct_pool.COPY_BATCH_BYTES` per layer at a time, so its temporaries fit the allocator block the
warm-up left on its thread's stream. Later sends find everything loaded and cached. A pool on
the CPU has nothing lazy: `warm_*` do nothing there.

`tests/workers/transport/test_cuda_first_use_cuda.py` measures, on the GPU, which of
these calls wait for a kernel running on another stream.
"""
from __future__ import annotations

import threading
from concurrent.futures import Executor
from typing import Callable

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model import host_copy_staging
from deepseek_pd.workers.transport import direct_pool, page_io

# torch's index_select uses one kernel for at most 16 indices and others above (and index_copy_
# splits by index width): warm one send of each size class.
SMALL_INDEX = 16


def warm_page_counts(pool: KVPool, largest_bytes: int = 0) -> list[int]:
    """The page counts one warm-up pass copies: 1, past torch's small-index kernels, and as many as
    `largest_bytes` of one layer holds (the largest temporary a copy makes), each if the pool allows."""
    return sorted({1, min(pool.num_pages, 2 * SMALL_INDEX),
                   max(1, min(pool.num_pages, largest_bytes // pool.bytes_per_page))})


def in_every_thread(executor: Executor, threads: int, fn: Callable[[], None], timeout_s: float = 120.0) -> None:
    """Runs `fn()` once in each of the `threads` threads of `executor` (a pool of that many).

    A barrier holds every call until all `threads` have started, so no thread runs two while
    another stays cold. Raises what `fn` raised (`threading.BrokenBarrierError` if the pool has
    fewer threads)."""
    barrier = threading.Barrier(threads, timeout=timeout_s)

    def once() -> None:
        barrier.wait()
        fn()

    for future in [executor.submit(once) for _ in range(threads)]:
        future.result(timeout=timeout_s)


def warm_sender(pool: KVPool, executor: Executor, threads: int, gather: page_io.PageGather) -> None:
    """Prefill side: each staging slot's gather (`PageGather.warm`), and in every send thread a
    direct device copy (`direct_pool.write_pages`, the pages onto themselves: no byte changes)."""
    if pool.device.type != "cuda":
        return
    gather.warm(warm_page_counts(pool))
    chunk_pages = max(1, gather.max_bytes // pool.bytes_per_page)

    def copy_in_place() -> None:
        host_copy_staging.reserve(pool.device, torch.long, 2 * chunk_pages)  # a direct copy's source and destination ids
        for count in warm_page_counts(pool, direct_pool.COPY_BATCH_BYTES):
            pages = list(range(count))
            direct_pool.write_pages(pool, pool.buffers, range(1), pages, pages, None)
    in_every_thread(executor, threads, copy_in_place)


def warm_receiver(pool: KVPool, executor: Executor, threads: int, chunk_bytes: int) -> None:
    """Decode side: in every ingest thread a scatter of pages read from the pool back into the
    same pages (no byte changes), up to a chunk of `chunk_bytes` (the largest a chunk brings)."""
    if pool.device.type != "cuda":
        return

    def scatter_in_place() -> None:
        host_copy_staging.reserve(pool.device, torch.long, 2 * max(1, chunk_bytes // pool.bytes_per_page))
        host_copy_staging.reserve(pool.device, torch.uint8, chunk_bytes)  # a chunk's bytes on their way in
        for count in warm_page_counts(pool, chunk_bytes):
            pages = list(range(count))
            page_io.scatter_pages(pool, range(1), pages, page_io.read_pages(pool, range(1), pages))
    in_every_thread(executor, threads, scatter_in_place)
