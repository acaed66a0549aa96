"""On CUDA, a decode worker's model thread issues on a stream of the device's greatest priority
(workers/engine/model_stream.py), and keeps the ordering it had on the default stream: a call
starts after what other threads queued there, and what they queue there next runs after the call's
work, without the host waiting for either.

What the priority is worth under a prefill load is bench/stream_priority.py's measurement.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from deepseek_pd.workers.engine.model_stream import KernelPriority, model_stream
from deepseek_pd.workers.engine.model_thread import ModelThread

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_calls_run_on_the_greatest_priority_stream() -> None:
    stream = model_stream("cuda", KernelPriority.GREATEST)
    _least, greatest = torch.cuda.Stream.priority_range()
    assert stream is not None and stream.priority == greatest < 0
    thread = ModelThread("decode-model", stream)
    try:
        current = asyncio.run(thread.run(torch.cuda.current_stream))
    finally:
        thread.close()
    assert current == stream
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the caller's thread is left alone


def test_a_call_sees_what_the_default_stream_wrote_before_it() -> None:
    """Another thread queues a long kernel and then a write on the default stream and does not wait;
    the model thread's read on its own stream still sees the write."""
    rng = random.Random()
    thread = ModelThread("decode-model", model_stream("cuda", KernelPriority.GREATEST))
    value = torch.zeros(1 << 20, device="cuda")
    expected = rng.uniform(1.0, 2.0)
    try:
        asyncio.run(thread.run(lambda: None))  # the thread and its stream exist
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the write
        value.fill_(expected)
        began = time.perf_counter()
        seen = asyncio.run(thread.run(lambda: (value.min().item(), value.max().item())))
        assert time.perf_counter() - began > 0.02, "the default stream's kernels had run already: nothing checked"
    finally:
        thread.close()
    assert seen == pytest.approx((expected, expected))  # every element written, none stale (zero)


def test_what_a_call_returns_reads_right_on_the_default_stream() -> None:
    """The call's last kernel is still queued behind ~0.25 s of GPU time when it returns; the caller
    reads the tensor on its own (default) stream and sees the call's values."""
    rng = random.Random()
    thread = ModelThread("decode-model", model_stream("cuda", KernelPriority.GREATEST))
    expected = rng.uniform(1.0, 2.0)

    def late_fill() -> torch.Tensor:
        torch.cuda._sleep(500_000_000)
        return torch.full((1 << 20,), expected, device="cuda")

    try:
        asyncio.run(thread.run(lambda: None))
        torch.cuda.synchronize()
        began = time.perf_counter()
        value = asyncio.run(thread.run(late_fill))
        assert time.perf_counter() - began < 0.1, "the call waited for its kernels: nothing checked"
        seen = (value.min().item(), value.max().item())
    finally:
        thread.close()
    assert seen == pytest.approx((expected, expected))
