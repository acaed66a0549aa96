"""Same-host direct KV writes over CUDA IPC between two processes (kv_transfer/direct_pool.py).

A child process plays the decode worker: it offers its zeroed CUDA pool and, when told, dumps it.
This process opens the offer and writes random pages of random layers right after filling them on
the default stream (the copy must wait for that write). Oracle: the source pages themselves, and
every other page still zero.
"""
from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.direct_pool import DirectPools, offer, write_pages

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(180)]

_DECODE = textwrap.dedent("""
    import sys, torch
    from deepseek_pd.model.kv.pool import KVPool
    from deepseek_pd.workers.transport.direct_pool import offer
    layers, pages, page_size, dim, offer_path, dump_path = sys.argv[1:]
    pool = KVPool(int(layers), int(pages), int(page_size), int(dim), dtype=torch.bfloat16, device="cuda")
    open(offer_path, "wb").write(offer(pool).SerializeToString())
    print("offered", flush=True)
    sys.stdin.readline()
    torch.cuda.synchronize()
    torch.save([buffer.cpu() for buffer in pool.buffers], dump_path)
    print("dumped", flush=True)
""")


def test_a_second_process_writes_the_decode_pool_over_cuda_ipc(tmp_path):
    rng = random.Random()
    layers, pages, page_size, dim = rng.randrange(2, 6), rng.randrange(20, 60), rng.choice([16, 64]), 576
    script = tmp_path / "decode.py"
    script.write_text(_DECODE)
    child = subprocess.Popen([sys.executable, str(script), str(layers), str(pages), str(page_size), str(dim),
                              str(tmp_path / "offer.bin"), str(tmp_path / "dump.pt")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "offered"
        offered = pb.DirectPool.FromString((tmp_path / "offer.bin").read_bytes())
        src = KVPool(layers, pages, page_size, dim, dtype=torch.bfloat16, device="cuda")
        buffers = DirectPools(src).open(offered)
        assert buffers is not None, "the offer of a process on this host and GPU did not open"
        count = rng.randrange(1, pages // 2)
        src_pages, dst_pages = rng.sample(range(pages), count), rng.sample(range(pages), count)
        written = range(rng.randrange(layers), layers)
        for layer in written:  # queued on the default stream: write_pages must wait for it
            src.buffers[layer].copy_(torch.randn(src.buffers[layer].shape, device="cuda").to(torch.bfloat16))
        write_pages(src, buffers, written, src_pages, dst_pages, ready=None)
        child.stdin.write("dump\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "dumped"
        dumped = torch.load(tmp_path / "dump.pt")
    finally:
        child.kill()
        child.wait()
    untouched = sorted(set(range(pages)) - set(dst_pages))
    for layer in range(layers):
        if layer in written:
            assert torch.equal(dumped[layer][dst_pages], src.buffers[layer][src_pages].cpu()), layer
        else:
            assert not dumped[layer][dst_pages].any(), layer
        assert not dumped[layer][untouched].any(), layer


def test_the_same_process_uses_its_own_buffers():
    """CUDA IPC cannot open a handle in the process that made it: the same process's offer maps to
    its pool's buffers themselves."""
    dst = KVPool(2, 8, 16, 576, dtype=torch.bfloat16, device="cuda")
    src = KVPool(2, 8, 16, 576, dtype=torch.bfloat16, device="cuda")
    buffers = DirectPools(src).open(offer(dst))
    assert buffers is not None and all(a.data_ptr() == b.data_ptr() for a, b in zip(buffers, dst.buffers))
    # A pool on another device (here the CPU) is not written directly: the byte stream moves it.
    on_cpu = KVPool(2, 8, 16, 576, dtype=torch.bfloat16, device="cpu")
    assert DirectPools(src).open(offer(on_cpu)) is None


def test_a_dead_decode_workers_pool_is_given_back_to_the_gpu(tmp_path):
    """A decode worker that dies while this process has its pool open: until the pool idles out
    here its GPU memory stays taken (a restarted worker could not size its pool); after, it is free."""
    layers, pages, page_size, dim = 4, 4096, 64, 576  # 4 x 288 MiB, far above the allocator's noise
    pool_bytes = layers * pages * page_size * dim * 2
    script = tmp_path / "decode.py"
    script.write_text(_DECODE)
    free_before, _ = torch.cuda.mem_get_info()
    child = subprocess.Popen([sys.executable, str(script), str(layers), str(pages), str(page_size), str(dim),
                              str(tmp_path / "offer.bin"), str(tmp_path / "dump.pt")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "offered"
        pools = DirectPools(KVPool(layers, 8, page_size, dim, dtype=torch.bfloat16, device="cuda"), idle_s=1.0)
        assert pools.open(pb.DirectPool.FromString((tmp_path / "offer.bin").read_bytes())) is not None
    finally:
        child.kill()
        child.wait()
    try:
        time.sleep(0.5)  # the driver tears the dead process down
        held, _ = torch.cuda.mem_get_info()
        assert free_before - held >= pool_bytes * 0.9, "the dead worker's pool should still be mapped here"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and free_before - torch.cuda.mem_get_info()[0] >= pool_bytes * 0.5:
            time.sleep(0.2)
        assert free_before - torch.cuda.mem_get_info()[0] < pool_bytes * 0.5, "the pool was not given back"
    finally:
        pools.close()
