"""A transport thread's uploads go through its reserved page-locked buffers (model/host_copy_staging.py,
by `host_copy.upload`'s rule), and a buffer is never written while a queued copy still reads it: many sends' page ids, more than the buffer holds, queued on streams that wait behind a long
kernel, all arrive as sent; chunks scattered through the reserved byte buffer land as
`read_pages` reads them back (oracle: the ids and bytes themselves)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from deepseek_pd.model import host_copy_staging
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport import page_io

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(60)]


def _in_a_thread(fn) -> None:
    """Runs `fn` in a fresh thread (its own buffers, as a transport thread has); raises its error."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _pool(rng: random.Random) -> KVPool:
    return KVPool(num_layers=rng.randrange(1, 4), num_pages=rng.randrange(64, 256), page_size=16,
                  kv_dim=rng.choice([8, 64]), dtype=torch.bfloat16, device="cuda")


def test_reserved_ids_arrive_as_sent_across_wraps_and_streams():
    rng = random.Random()
    pool = _pool(rng)
    capacity = rng.randrange(8, 24)
    sent: list[list[int]] = []
    arrived: list[torch.Tensor] = []

    def transport_thread() -> None:
        host_copy_staging.reserve(pool.device, torch.long, capacity)
        staging = host_copy_staging.reserved(pool.device, torch.long)
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        blocked = torch.cuda.Event()
        torch.cuda._sleep(10 ** 8)  # the copies below wait behind it, so a reused region would show
        blocked.record()
        for stream in streams:
            stream.wait_event(blocked)
        for _ in range(rng.randrange(12, 24)):
            with torch.cuda.stream(rng.choice(streams)):
                pages = rng.sample(range(pool.num_pages), rng.randrange(0, capacity + 1))
                sent.append(pages)
                arrived.append(page_io.page_index(pool, pages))
        assert host_copy_staging.reserved(pool.device, torch.long) is staging  # never made again
        torch.cuda.synchronize()

    _in_a_thread(transport_thread)
    assert sum(map(len, sent)) > capacity  # the buffer wrapped at least once
    assert [ids.tolist() for ids in arrived] == sent


def test_chunks_land_through_the_reserved_byte_buffer():
    rng = random.Random()
    pool = _pool(rng)
    source = KVPool(pool.num_layers, pool.num_pages, pool.page_size, pool.kv_dim, pool.dtype, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(rng.getrandbits(63))
    for buffer in source.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=generator, device="cuda"))
    layers = range(pool.num_layers)
    chunks = [rng.sample(range(pool.num_pages), rng.randrange(1, 8)) for _ in range(rng.randrange(3, 8))]
    chunk_bytes = max(map(len, chunks)) * pool.num_layers * pool.bytes_per_page

    def ingest_thread() -> None:
        host_copy_staging.reserve(pool.device, torch.uint8, chunk_bytes)
        host_copy_staging.reserve(pool.device, torch.long, 2 * max(map(len, chunks)))
        staging = host_copy_staging.reserved(pool.device, torch.uint8)
        for pages in chunks:
            page_io.scatter_pages(pool, layers, pages, page_io.read_pages(source, layers, pages))
        assert host_copy_staging.reserved(pool.device, torch.uint8) is staging

    _in_a_thread(ingest_thread)
    landed = sorted({page for pages in chunks for page in pages})
    assert page_io.read_pages(pool, layers, landed) == page_io.read_pages(source, layers, landed)


def test_an_unreserved_thread_or_an_oversized_upload_still_gets_its_values():
    rng = random.Random()
    pool = _pool(rng)
    capacity = rng.randrange(4, 16)
    results: dict[str, list[int]] = {}
    expected: dict[str, list[int]] = {}

    def cold() -> None:  # no reservation in this thread: a block of the caching host allocator
        expected["cold"] = rng.sample(range(pool.num_pages), rng.randrange(1, 40))
        results["cold"] = page_io.page_index(pool, expected["cold"]).tolist()

    def oversized() -> None:
        host_copy_staging.reserve(pool.device, torch.long, capacity)
        expected["oversized"] = rng.sample(range(pool.num_pages), capacity + rng.randrange(1, 40))
        results["oversized"] = page_io.page_index(pool, expected["oversized"]).tolist()

    _in_a_thread(cold)
    _in_a_thread(oversized)
    assert results == expected
