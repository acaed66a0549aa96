"""The KV cipher of a CUDA pool (workers/transport/kv_cipher_kernel.py, a Triton ChaCha20) against
ChaCha20 in numpy (pdtest/chacha20_reference.py, itself checked against PyPI `cryptography`, which
the GPU image lacks) on the same bytes, through the staging's encrypting and decrypting copies as a
transfer runs them; its cost on a V2-Lite-sized prompt (bench/kv_cipher.py gives the table)."""
from __future__ import annotations

import random
import time

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.kv_cipher import CellCipher
from deepseek_pd.workers.transport.staging import StagingArea
from pdtest.chacha20_reference import keystream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(180)]


def _keystream(key: bytes, layer: int, page: int, page_bytes: int) -> bytes:
    """kv_cipher.py's keystream of cell (layer, request page)."""
    blocks = -(-page_bytes // 64)
    return keystream(key, layer.to_bytes(4, "little") + bytes(8), page * blocks, blocks)[:page_bytes]


def test_a_cuda_staging_holds_the_documented_ciphertext_and_lands_the_kv():
    rng = random.Random()
    pool = KVPool(rng.randrange(2, 6), 96, rng.choice([1, 16, 64]), 576, dtype=torch.bfloat16, device="cuda")
    for buffer in pool.buffers:
        buffer.normal_()
    count = rng.randrange(1, 40)
    pages, slots = rng.sample(range(96), count), rng.sample(range(64), count)
    staging = StagingArea(pool, 64)
    key, first = rng.randbytes(32), rng.randrange(1000)
    cipher = CellCipher(key, pool.bytes_per_page, pool.device)
    layers = range(rng.randrange(pool.num_layers), pool.num_layers)
    staging.fill_from(pool, layers, pages, slots, cipher, first)
    for layer in layers:
        for i, (page, slot) in enumerate(zip(pages, slots)):
            plain = pool.buffers[layer][page].view(torch.uint8).cpu().numpy().tobytes()
            stream = _keystream(key, layer, first + i, pool.bytes_per_page)
            got = staging.buffers[layer][slot].view(torch.uint8).cpu().numpy().tobytes()
            assert got == bytes(a ^ b for a, b in zip(plain, stream)), (layer, i)
    out = KVPool(pool.num_layers, 96, pool.page_size, 576, dtype=torch.bfloat16, device="cuda")
    out_pages = rng.sample(range(96), count)
    staging.copy_into(out, slots, out_pages, layers, cipher, first)
    for layer in layers:
        assert torch.equal(out.buffers[layer][out_pages], pool.buffers[layer][pages])
        assert not staging.buffers[layer][slots].any()  # the slots go back zeroed


def test_cipher_cost_of_a_v2_lite_prompt_on_the_gpu():
    """Prints the time of the encrypting staging copy of a 4k-token V2-Lite prompt (27 layers x 256
    pages of 16 tokens x 576 bf16, 127 MB) against the plain copy: what each side adds per prompt."""
    pool = KVPool(27, 512, 16, 576, dtype=torch.bfloat16, device="cuda")
    for buffer in pool.buffers:
        buffer.normal_()
    pages = random.Random().sample(range(512), 256)
    staging = StagingArea(pool, 256)
    slots = list(range(256))
    cipher = CellCipher(bytes(32), pool.bytes_per_page, pool.device)
    mb = len(pages) * pool.num_layers * pool.bytes_per_page / 1e6

    def best(work) -> float:
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            started = time.perf_counter()
            work()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return min(times)
    plain = best(lambda: staging.fill_from(pool, range(27), pages, slots))
    ciphered = best(lambda: staging.fill_from(pool, range(27), pages, slots, cipher))
    print(f"{mb:.0f} MB of KV on {torch.cuda.get_device_name()}: plain staging copy {plain * 1e3:.2f} ms, "
          f"with ChaCha20 {ciphered * 1e3:.2f} ms ({mb / 1e3 / ciphered:.1f} GB/s)")
    assert ciphered < 1.0  # a loose bound: the kernel must not be orders of magnitude off
