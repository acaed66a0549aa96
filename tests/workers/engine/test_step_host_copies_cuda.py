"""On CUDA, building a step's inputs returns while the GPU still runs the forward queued before it.

A copy up from pageable memory waits for the work queued before it on its stream (the driver
stages it through shared buffers, which other threads' copies then wait for too: the per-chunk KV
send of tests/workers/prefill/test_chunk_send_order_cuda.py). Every per-step copy up now goes
through pinned `host_copy.upload` (test_step_host_copies.py checks that on the CPU). Here a spin
kernel stands for the forward: an extend batch with a cached prefix (its seven tensors, its
prefix chunks' slots), the first-token rows' index, and a decode step's input rows are built and
queued, and the stream must still be busy when they return.

Would fail before: `ForwardBatch.build` copied each tensor with `.to(device, non_blocking=True)`
from pageable memory, which waits for the spin.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from deepseek_pd.model.attention.mla import prefix_chunks
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.host_copy import upload
from pdtest.pd_engine_harness import runner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _spin_cycles(seconds: float) -> int:
    """`torch.cuda._sleep` cycles that keep the stream busy about `seconds`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10 ** 7)
    end.record()
    end.synchronize()
    return int(10 ** 7 * seconds * 1000 / start.elapsed_time(end))


def test_building_a_steps_inputs_does_not_wait_for_the_forward_before_it() -> None:
    rng = random.Random()
    model = runner(device="cuda")
    pool, vocab = model.kv_pool, model.model_config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(20, 60))] for _ in range(rng.randint(1, 3))]
    prefixes = [rng.randint(1, len(p) - 1) for p in prompts]
    pages = [pool.alloc(pool.pages_for_tokens(len(p))) for p in prompts]

    def build() -> None:
        batch = ForwardBatch.build(ForwardMode.EXTEND, [p[c:] for p, c in zip(prompts, prefixes)], prefixes, pages,
                                   pool, vocab, "cuda")
        prefix_chunks(batch, 8)
        upload(torch.tensor(list(range(len(prompts))), dtype=torch.int64), "cuda")

    build()  # the allocators warm, the pinned blocks made
    torch.cuda.synchronize()
    spin_s = 1.0
    torch.cuda._sleep(_spin_cycles(spin_s))
    began = time.perf_counter()
    build()
    took = time.perf_counter() - began
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy and took < 0.25 * spin_s, f"building the inputs took {took:.3f} s behind a {spin_s} s forward"
