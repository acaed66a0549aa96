"""The KV MAC of a CUDA pool (pages gathered on the device, copied to the host per layer) equals the
MAC of the same bytes in a CPU pool, at other page ids, under each algorithm this process offers;
its cost on a V2-Lite-sized prompt under each."""
from __future__ import annotations

import random
import time

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport import kv_mac
from test_kv_mac import _transfer  # the stub-engine transfer, here between CUDA pools

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(180)]


@pytest.mark.parametrize("algorithm", kv_mac.algorithms())
def test_a_cuda_pool_macs_like_the_same_bytes_on_the_cpu(algorithm):
    rng = random.Random()
    gpu = KVPool(rng.randrange(2, 6), 64, 16, 576, dtype=torch.bfloat16, device="cuda")
    for buffer in gpu.buffers:
        buffer.normal_()
    pages = rng.sample(range(64), rng.randrange(1, 40))
    cpu = KVPool(gpu.num_layers, 80, 16, 576, dtype=torch.bfloat16)
    cpu_pages = rng.sample(range(80), len(pages))
    for g, c in zip(gpu.buffers, cpu.buffers):
        c[cpu_pages] = g[pages].cpu()
    key, head = bytes(rng.randrange(256) for _ in range(32)), kv_mac.header(rng.randrange(1 << 40), pages)
    tag = kv_mac.kv_mac(cpu, cpu_pages, key, head, algorithm)
    assert kv_mac.kv_mac(gpu, pages, key, head, algorithm) == tag
    gpu.buffers[0][pages[0], 0, 0] += 1
    assert kv_mac.kv_mac(gpu, pages, key, head, algorithm) != tag


def test_mac_cost_of_a_v2_lite_prompt_on_the_gpu():
    """Prints the wall time of the MAC of a 4k-token V2-Lite prompt (27 layers x 256 pages of 16
    tokens x 576 bf16) in a CUDA pool: what each side adds before the first token."""
    pool = KVPool(27, 512, 16, 576, dtype=torch.bfloat16, device="cuda")
    pages = random.Random().sample(range(512), 256)
    mb = len(pages) * pool.num_layers * pool.bytes_per_page / 1e6
    for algorithm in kv_mac.algorithms():
        kv_mac.kv_mac(pool, pages, bytes(32), b"", algorithm)  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(3):
            kv_mac.kv_mac(pool, pages, bytes(32), b"", algorithm)
        seconds = (time.perf_counter() - started) / 3
        print(f"kv_mac ({algorithm}) of {mb:.0f} MB from a CUDA pool: {seconds * 1e3:.1f} ms "
              f"({mb / seconds / 1e3:.2f} GB/s)")


def test_a_send_hashes_its_layer_without_waiting_for_the_forward_queued_after_it():
    """`LayerMacs.update` with a layer's `ready` event (as a layer-wise send passes it) reads that
    layer on a side stream: it neither waits for the kernels queued after the event on the default
    stream (the rest of the forward) nor changes the tag."""
    rng = random.Random()
    pool = KVPool(4, 64, 16, 576, dtype=torch.bfloat16, device="cuda")
    pages = rng.sample(range(64), 24)
    key, head = bytes(rng.randrange(256) for _ in range(32)), kv_mac.header(rng.randrange(1 << 40), pages)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # each MAC thread's stream and allocations made once (first uses may sync the device)
        kv_mac.LayerMacs(pool.num_layers, key, head).update(pool, range(pool.num_layers), 0, pages).wait()
    torch.cuda.synchronize()
    macs = kv_mac.LayerMacs(pool.num_layers, key, head)
    for layer, buffer in enumerate(pool.buffers):
        buffer.normal_()
        ready = torch.cuda.Event()
        ready.record()
        for _ in range(80):  # the rest of the forward: ~0.2 s of matmuls after the layer's KV
            big = (big @ big).tanh_()
        after = torch.cuda.Event()
        after.record()
        macs.update(pool, range(layer, layer + 1), 0, pages, ready).wait()
        assert not after.query(), "the hash waited for kernels queued after its layer's event"
        torch.cuda.synchronize()
    assert macs.pages_read == pool.num_layers * len(pages)
    assert macs.digest(pool, pages) == kv_mac.kv_mac(pool, pages, key, head)


def test_decodes_check_of_its_landed_copy_waits_for_no_decode_step(monkeypatch):
    """The decode side MACs the copy `land` made (synchronised on its side stream) while decode steps
    keep running on the default stream: the check must not wait for the step queued meanwhile (it is
    on the first token's path), and must MAC the landed bytes."""
    sink, done, key, room, dst, *_ = _transfer(monkeypatch, random.Random(), begin=True, device="cuda",
                                               reports=False)  # (landed whole: the check reads every page)
    assert dst.device.type == "cuda" and sink.check_reads()
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # warm the MAC threads' streams
        kv_mac.kv_mac(dst, sink.pages, key, b"", synced=True)
    torch.cuda.synchronize()
    for _ in range(80):  # a decode step still queued when the check runs (~0.2 s of matmuls)
        big = (big @ big).tanh_()
    after = torch.cuda.Event()
    after.record()
    sink.check_sealed(done, key, room)
    assert not after.query(), "the check waited for the decode step queued after the landing"
    assert sink.failed is None


def test_a_cuda_transfer_landed_send_by_send_passes_its_mac_with_only_a_digest_left(monkeypatch):
    """Each send's report lands (copied out of the device staging, synchronised, then MACed from the
    pool's pages on the MAC threads' side streams), in a random order and side by side: the tag is
    the prefill side's, and the check after the TransferDone reads nothing."""
    sink, done, key, room, dst, *_ = _transfer(monkeypatch, random.Random(), device="cuda", reports=True,
                                               check=True)
    assert not sink.check_reads()
    sink.check_sealed(done, key, room)
    assert sink.failed is None
