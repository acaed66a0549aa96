"""The grpc sink runs decode's finite check (kv_checks.FiniteOnLanding) on each chunk as it lands:
a chunk whose bytes hold a NaN or an infinity fails the transfer before any of them reaches a page;
a chunk a same-host peer wrote directly is checked in the pages it wrote. Oracle: torch.isfinite
over each layer of the chunk. The same on the real workers: tests/workers/test_security_nan_peer.py."""
from __future__ import annotations

import random
import re
import zlib

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.decode.kv_checks import FiniteOnLanding
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.grpc_stream import GrpcSink, read_pages
from pdtest.kv_transfer_harness import random_pool

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
# The sink's CUDA paths (the bytes scattered on a side stream; a direct chunk's pages reduced there).
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] * torch.cuda.is_available()


def _pool_on(pool: KVPool, device: str) -> KVPool:
    moved = KVPool(pool.num_layers, pool.num_pages, pool.page_size, pool.kv_dim, dtype=pool.dtype, device=device)
    for mine, theirs in zip(moved.buffers, pool.buffers):
        mine.copy_(theirs)
    return moved


def _spoil(rng: random.Random, pool, pages: list[int], layers: range) -> list[int]:
    """Writes NaN or an infinity at one to three random places of `layers` in `pages`; returns the
    layers torch.isfinite finds spoiled."""
    for _ in range(rng.randrange(1, 4)):
        layer, page = rng.choice(layers), rng.choice(pages)
        slot, value = rng.randrange(pool.page_size), rng.randrange(pool.kv_dim)
        bad = rng.choice([float("nan"), float("inf"), float("-inf")])
        pool.buffers[layer][page, slot, value] = float("nan") if pool.dtype == torch.float8_e4m3fn else bad
    return [layer for layer in layers if not bool(torch.isfinite(pool.buffers[layer][pages].float()).all())]


def _chunk(pool, layers: range, pages: list[int], page_begin: int) -> pb.KVChunk:
    data = read_pages(pool, layers, pages)
    return pb.KVChunk(layer_begin=layers.start, layer_end=layers.stop, page_begin=page_begin,
                      page_end=page_begin + len(pages), data=data, crc32=zlib.crc32(data))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_chunk_is_checked_before_its_bytes_reach_a_page(dtype, device):
    rng = random.Random()
    src = random_pool(rng, 8, rng.choice([1, 4]), dtype=dtype)
    dst = _pool_on(random_pool(rng, 8, src.page_size, dtype=dtype), device)
    pages = rng.sample(range(src.num_pages), 4)
    dst_pages = rng.sample(range(dst.num_pages), 4)
    sink = GrpcSink(dst, dst_pages)
    sink.check_on_landing(FiniteOnLanding(dst, "r"))
    sink.on_chunk(_chunk(src, range(src.num_layers), pages[:2], 0))  # finite: written
    assert all(torch.equal(dst.buffers[layer][dst_pages[:2]].cpu(), src.buffers[layer][pages[:2]])
               for layer in range(src.num_layers))
    begin = rng.randrange(src.num_layers)
    layers = range(begin, rng.randrange(begin + 1, src.num_layers + 1))
    bad = _spoil(rng, src, pages[2:], layers)
    before = [buffer.clone() for buffer in dst.buffers]
    with pytest.raises(TransferError, match=rf"NaN or infinite values \(layers {re.escape(str(bad))}\)"):
        sink.on_chunk(_chunk(src, layers, pages[2:], 2))
    assert sink.failed is not None
    assert all(torch.equal(a, b) for a, b in zip(dst.buffers, before)), "a refused chunk's bytes reached the pool"


@pytest.mark.parametrize("device", DEVICES)
def test_a_directly_written_chunk_is_checked_in_its_pages(device):
    rng = random.Random()
    pool = _pool_on(random_pool(rng, 8, rng.choice([1, 4])), device)
    pages = rng.sample(range(pool.num_pages), 4)
    sink = GrpcSink(pool, pages, offer=pb.DirectPool())
    sink.check_on_landing(FiniteOnLanding(pool, "r"))
    direct = lambda begin, end: pb.KVChunk(layer_begin=0, layer_end=pool.num_layers, page_begin=begin,  # noqa: E731
                                           page_end=end, written_directly=True)
    sink.on_chunk(direct(0, 2))  # finite, as the same-host peer wrote them
    bad = _spoil(rng, pool, pages[2:], range(pool.num_layers))
    with pytest.raises(TransferError, match=rf"NaN or infinite values \(layers {re.escape(str(bad))}\)"):
        sink.on_chunk(direct(2, 4))
