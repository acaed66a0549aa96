"""The decode side's content checks (workers/decode/kv_checks.py) against a direct scan, on the CPU
and, where there is one, on the GPU (whose check runs on a side stream)."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.decode.kv_checks import check_kv_finite, scrub_pages

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _random_pool(rng: random.Random, device: str) -> KVPool:
    pool = KVPool(rng.randint(1, 5), rng.randint(8, 40), rng.choice([1, 4, 16]), rng.choice([8, 576]),
                  torch.bfloat16, torch.device(device))
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))))
    return pool


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_value_in_a_received_page_is_refused_naming_its_layer(device):
    rng = random.Random()
    for _ in range(4):
        pool = _random_pool(rng, device)
        pages = rng.sample(range(pool.num_pages), rng.randint(1, pool.num_pages // 2))
        check_kv_finite(pool, pages, "clean")  # finite pages pass
        layer, page = rng.randrange(pool.num_layers), rng.choice(pages)
        slot = rng.randrange(pool.buffers[layer].shape[1])
        pool.buffers[layer][page, slot, rng.randrange(pool.buffers[layer].shape[-1])] = rng.choice(
            [float("nan"), float("inf"), float("-inf")])
        with pytest.raises(TransferError) as raised:
            check_kv_finite(pool, pages, "poisoned")
        assert f"layers [{layer}]" in raised.value.message
        others = [p for p in range(pool.num_pages) if p not in pages]
        check_kv_finite(pool, others, "other pages")  # a page outside the request is not its problem
        scrub_pages(pool, [page])
        assert all(float(b[page].abs().sum()) == 0 for b in pool.buffers)
        check_kv_finite(pool, pages, "scrubbed")


def test_the_first_token_must_be_in_the_vocabulary():
    from deepseek_pd.proto import bootstrap_pb2 as pb
    from deepseek_pd.workers.decode.kv_checks import check_first_token

    rng = random.Random()
    vocab = rng.randrange(2, 200_000)
    for token in (0, vocab - 1, rng.randrange(vocab)):
        check_first_token(pb.TransferDone(first_token_id=token), vocab, "ok")
    for token in (vocab, vocab + rng.randrange(1, 1 << 20), (1 << 32) - 1):  # uint32 on the wire
        with pytest.raises(TransferError, match="outside the vocabulary") as refused:
            check_first_token(pb.TransferDone(first_token_id=token), vocab, "r")
        assert str(token) in refused.value.message and refused.value.code.value == "internal"


def test_scrubbing_zeroes_exactly_its_pages_and_copies_their_ids_only_through_upload():
    """On CUDA a pageable copy of the page ids waits in the driver's shared staging behind the
    forward queued before it (tests/workers/engine/test_step_host_copies.py says why); the ids go
    through `model/host_copy.upload` like every transport's (`page_io.page_index`). Failed before:
    `torch.tensor(pages, device=pool.device)`."""
    from pdtest.host_uploads import DirectUploads

    rng = random.Random()
    pool = _random_pool(rng, "cpu")
    before = [b.clone() for b in pool.buffers]
    pages = rng.sample(range(pool.num_pages), rng.randint(1, pool.num_pages))
    with DirectUploads() as mode:
        scrub_pages(pool, pages)
    assert mode.records == [] and mode.uploads == 1
    kept = [p for p in range(pool.num_pages) if p not in pages]
    for buffer, old in zip(pool.buffers, before):
        assert not buffer[pages].any() and torch.equal(buffer[kept], old[kept])
