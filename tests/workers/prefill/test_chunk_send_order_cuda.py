"""On CUDA, the pages a prefill round completes are sent without waiting for the next round.

Per-chunk sends (same-host direct copies always; the byte stream with layer-wise transfer off) run
in a transport thread after the round's forward has returned, when the scheduler may already have
queued the next forward on the same stream. Their copies must wait only for the KV they read, which
is already in the pool, not for that next forward. Here the second forward is made long on the GPU
(a spin kernel queued before it) and the first send's copy starts late enough that the second
forward is surely queued: the first chunk must still be on the stream long before the second forward
ends. The decode side must get the request done either way. One request runs first, as a worker
in service has run many: what is measured is the steady state, not a cold process's first kernel
loads (the second forward, the first with a prefix, was the first to run some kernels).

Failed on an H100 at 2648c43 (lead 0.01 s, both cases): the send's first CUDA calls in a fresh
process (kernel module loads, a page-locked staging allocation) waited for the whole device;
the transport now makes them before serving (workers/transport/warm_up.py).
Failed again at 422a203 (lead 0.01 s, both cases, warm transport): the send's host calls returned
when the spin ended (1.999 s), not when the forward did. Suspects: the page ids' copy from
pageable memory, the one copy both cases share (now from a reserved page-locked buffer,
model/host_copy_staging.py), and the cold model thread's first kernel launches (now warmed by a first
request). A failure lists both threads' slow calls.
Next suspect (session 12): the model thread's own pageable copies (the batch's seven tensors per
forward, the prefix chunks' slots), which held the driver's shared staging until the forward
before them ran; every per-step copy up now goes through pinned `host_copy.upload`
(tests/workers/engine/test_step_host_copies.py), and each engine warms its extends at start
(workers/engine/model_warm_up.py).
Failed again at d4173c0 (both cases): the send's upload waited 1.697 s while the model thread was
1.994 s inside the Triton MoE, which makes no host sync: most likely a new Triton variant (a batch
size class not seen in the warm-up), compiled and loaded mid-forward. Session 13: per-batch kernel
ints are unspecialised and the warm-up runs size ladders (tests/model/kernels/test_kernel_specialisation.py).
Failed again at 5f4a196; CUDA's sync debug mode showed that diagnosis wrong: the harness's runners
use the torch MoE on CUDA, whose expert loop reads its counts on the host (`.tolist()`, a sync),
so the model thread itself waited for the spin. Served models run the sync-free Triton MoE, so
the runners here do too (bf16, the Triton backends: what `auto` picks on a GPU).
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import threading
import time

import pytest
import torch

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.transport import direct_pool, page_io
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from pdtest.pd_engine_harness import CHUNK, PAGE_SIZE, PDPair, oracle, timed_emits, worker_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(300)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
SLOW_FORWARD_S = 2.0
LATE_COPY_S = 0.3


class _SlowCalls:
    """The calls one thread makes while its profile is on (`sys.setprofile`), those over a
    millisecond kept: the slowest name the call that waited, the CUDA call included (a torch op
    or a tensor method is a C call here)."""

    def __init__(self) -> None:
        self._stack: list[tuple[str, float]] = []
        self.calls: list[tuple[float, float, int, str]] = []  # began, seconds, depth, name

    def _profile(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            name = frame.f_code.co_qualname if event == "call" else getattr(arg, "__qualname__", repr(arg))
            self._stack.append((name, time.monotonic()))
        elif self._stack:  # return, c_return, c_exception
            name, began = self._stack.pop()
            if time.monotonic() - began > 1e-3:
                self.calls.append((began, time.monotonic() - began, len(self._stack), name))

    def start(self) -> None:
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)

    def slowest(self, origin: float, count: int = 12) -> str:
        top = sorted(sorted(self.calls, key=lambda call: -call[1])[:count])
        return ", ".join(f"{'>' * depth}{name} at {began - origin:.3f}s for {took:.3f}s"
                         for began, took, depth, name in top) or "none over 1 ms"


def _spin_cycles(seconds: float) -> int:
    """GPU clock cycles of `torch.cuda._sleep` that take about `seconds`."""
    torch.cuda._sleep(1000)  # the kernel's first launch (module load) is not timed
    torch.cuda.synchronize()
    cycles = 10 ** 8
    began = time.monotonic()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return int(cycles * seconds / max(time.monotonic() - began, 1e-6))


@pytest.mark.parametrize("direct", ["on", "off"])
def test_a_chunk_is_sent_before_the_next_forward_ends(direct, monkeypatch):
    rng = random.Random()
    prompt, warm_prompt = ([rng.randrange(2, oracle().vocab_size) for _ in range(2 * CHUNK + rng.randrange(1, CHUNK))]
                           for _ in range(2))
    spin = _spin_cycles(SLOW_FORWARD_S)
    late: dict[str, bool] = {}  # armed once the engines have started (their warm-up copies too)
    copy_began: list[float] = []
    # Each host call of the first send (from its copy's start to its stream sync) and of the model
    # thread during the second forward: a failure names the call that waited, and what the model
    # thread was in meanwhile (the two may share a driver resource).
    send_calls, model_calls = _SlowCalls(), _SlowCalls()

    def late_first_copy(real):
        def wait_ready(*args, **kwargs):
            if late.pop("first", False):
                time.sleep(LATE_COPY_S)  # the scheduler has queued the next forward by now
                copy_began.append(time.monotonic())
                send_calls.start()
            return real(*args, **kwargs)
        return wait_ready
    monkeypatch.setattr(direct_pool, "wait_ready", late_first_copy(direct_pool.wait_ready))
    monkeypatch.setattr(page_io, "wait_ready", late_first_copy(page_io.wait_ready))
    # When the first copy's host calls had all returned (its thread then waits for the copy on the
    # GPU): splits a copy that waited in the driver (host calls late) from one the GPU ran late.
    launched: list[float] = []
    stream_sync = torch.cuda.Stream.synchronize

    def traced_sync(stream):
        if copy_began and not launched and threading.current_thread().name.startswith("kv-send"):
            launched.append(time.monotonic())
            send_calls.stop()
        return stream_sync(stream)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", traced_sync)

    async def run():
        base = worker_config("grpc", same_host_direct=direct)
        cfg = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=False))
        runners = tuple(ModelRunner(RunnerConfig(model="tiny", page_size=PAGE_SIZE, num_pages=256, device="cuda",
                                                 dtype="bfloat16", attention_backend="triton", moe_backend="triton"))
                        for _ in range(2))
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg, device="cuda", runners=runners) as pair:
            # A worker in service: its forwards' kernels (with a prefix too) are loaded already. The
            # first launch of one in a process loads its module, which may synchronise the whole
            # context (warm_up.py); that a cold model thread's loads also hold up a warm transport
            # is what test_cuda_first_use_cuda.py's "beside a first launch" rows measure.
            warmed = await pair.run(warm_prompt, GREEDY, "warm")
            assert all(outcome.ok for outcome in warmed), [outcome.terminal for outcome in warmed]
            await pair.wait_pools_clean()
            late["first"] = True
            emitted, channels = timed_emits(pair.prefill)
            forward_ends: list[float] = []
            extend = pair.prefill.runner.extend

            def traced_extend(seqs, progress=None, **kwargs):
                second = len(forward_ends) == 1
                if second:
                    model_calls.start()
                    torch.cuda._sleep(spin)  # the second forward: long on the GPU
                logits = extend(seqs, progress=progress, **kwargs)
                torch.cuda.synchronize()
                if second:
                    model_calls.stop()
                forward_ends.append(time.monotonic())
                return logits
            pair.prefill.runner.extend = traced_extend
            prefill, decode = await pair.run(prompt, GREEDY, "order")
            await pair.wait_pools_clean()
            return prefill, decode, emitted, forward_ends, channels

    prefill, decode, emitted, forward_ends, channels = asyncio.run(run())
    assert channels == ["DirectChannel" if direct == "on" else "GrpcChannel"]
    assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
    assert len(decode.tokens) == GREEDY.max_new_tokens
    assert len(forward_ends) == 3 and emitted
    first_chunk_lead = forward_ends[1] - emitted[0]
    # Where the time went when it fails: the copy's host calls (copy_began -> emitted) or before.
    phases = (f"forward 1 ended at 0, the first copy began at {copy_began[0] - forward_ends[0]:.3f}s, "
              f"its host calls returned at "
              f"{(launched[0] - forward_ends[0]) if launched else float('nan'):.3f}s (late: they waited in the "
              f"driver; early: the GPU ran the copy late), its chunk was emitted at "
              f"{emitted[0] - forward_ends[0]:.3f}s, forward 2 ended at "
              f"{forward_ends[1] - forward_ends[0]:.3f}s; the send thread's calls over 1 ms (> nested): "
              f"{send_calls.slowest(forward_ends[0])}; the model thread's in the second forward: "
              f"{model_calls.slowest(forward_ends[0])}" if copy_began else "the first copy never began")
    assert first_chunk_lead > SLOW_FORWARD_S / 2, (
        f"the first chunk went out {-first_chunk_lead:.2f}s after the next forward ended "
        f"(its copy waited for that forward); {phases}" if first_chunk_lead < 0 else
        f"the first chunk went out only {first_chunk_lead:.2f}s before the next forward ended; {phases}")
