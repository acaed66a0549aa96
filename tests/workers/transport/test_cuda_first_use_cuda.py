"""Which host calls of a KV send wait for a kernel running on another stream (warm_up.py's reasons).

A fresh child process (no kernel loaded yet) queues a long spin kernel on the default stream, as a
prefill worker's next forward is, and times one call at a time in another thread, as a transport
thread makes it: the first launch of a kernel (lazy module loading), a page-locked allocation, a
device allocation on a new stream, a pageable host-to-device copy, a cold direct page copy, then
the same transport's gather and direct copy after `GrpcSender` warmed them, alone and while
another thread (as the model thread in a forward) has pageable copies, a page-locked
allocation or a kernel's first launch waiting for the spin. A call that took most of the spin waited for it. Only the warm
transport is asserted, alone and beside a synchronous pageable copy (the rest is the CUDA
driver's behaviour, printed for docs/performance.md: run with -s).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(300)]

SPIN_S = 1.0

_CHILD = textwrap.dedent("""
    import json, random, sys, threading, time
    import torch
    from deepseek_pd.model.kv.pool import KVPool
    from deepseek_pd.workers.transport import TransportConfig
    from deepseek_pd.workers.transport.direct_pool import write_pages
    from deepseek_pd.workers.transport.page_io import page_index
    spin_s = float(sys.argv[1])
    rng = random.Random(int(sys.argv[2]))
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    began = time.monotonic(); torch.cuda._sleep(10 ** 8); torch.cuda.synchronize()
    cycles = int(10 ** 8 * spin_s / (time.monotonic() - began))

    def timed_beside_spin(call, busy=None):
        '''Seconds `call()` took in a thread while the default stream runs the spin (and, with
        `busy`, while another thread is inside `busy()`, a call that waits for the spin).'''
        torch.cuda._sleep(cycles)
        if busy is not None:
            busy_thread = threading.Thread(target=busy); busy_thread.start()
            time.sleep(0.05)  # inside its CUDA call by now
        took = []
        def run():
            t = time.monotonic(); call(); took.append(time.monotonic() - t)
        thread = threading.Thread(target=run); thread.start(); thread.join()
        if busy is not None:
            busy_thread.join()
        torch.cuda.synchronize()
        return took[0]

    pool = KVPool(num_layers=2, num_pages=rng.randrange(40, 80), page_size=64, kv_dim=576,
                  dtype=torch.bfloat16, device="cuda")
    other = KVPool(num_layers=2, num_pages=pool.num_pages, page_size=64, kv_dim=576, dtype=torch.bfloat16,
                   device="cuda")
    def pages():
        return rng.sample(range(pool.num_pages), rng.randrange(17, 33))
    def page_pairs():
        src = pages()
        return src, rng.sample(range(pool.num_pages), len(src))
    out = {}
    # A kernel nothing here launched before, into tensors made beforehand (no allocation in the call).
    x = torch.zeros(64, 8, 4, dtype=torch.int16, device="cuda")
    values, indices = torch.empty_like(x), torch.empty(x.shape, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    kernel_stream = torch.cuda.Stream()
    def new_kernel():
        with torch.cuda.stream(kernel_stream):
            torch.cummax(x, dim=1, out=(values, indices))
        kernel_stream.synchronize()
    out["first launch of a kernel"] = timed_beside_spin(new_kernel)
    out["page-locked allocation (64 MiB)"] = timed_beside_spin(
        lambda: torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True))
    def device_alloc():
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.empty(96 << 20, dtype=torch.uint8, device="cuda")
    out["device allocation on a new stream (96 MiB)"] = timed_beside_spin(device_alloc)
    h2d_stream = torch.cuda.Stream()
    def h2d():
        with torch.cuda.stream(h2d_stream):
            page_index(pool, pages())
        h2d_stream.synchronize()
    h2d()
    out["pageable host-to-device copy (warm)"] = timed_beside_spin(h2d)
    written = torch.cuda.Event(); written.record()  # ordered before the spin: the copy need not wait
    out["cold direct page copy"] = timed_beside_spin(
        lambda: write_pages(pool, other.buffers, range(2), *page_pairs(), written))
    from deepseek_pd.workers.transport.grpc_stream import GrpcSender
    sender = GrpcSender(pool, TransportConfig(io_threads=2))
    ready = torch.cuda.Event(); ready.record()  # the KV is written before the spin (the next forward)
    def warm_gather():
        with sender.gather.gather(range(2), pages(), ready):
            pass
    out["warm gather (byte stream)"] = timed_beside_spin(
        lambda: sender.executor.submit(warm_gather).result())
    out["warm direct page copy"] = timed_beside_spin(
        lambda: sender.executor.submit(write_pages, pool, other.buffers, range(2), *page_pairs(), ready).result())
    # As the model thread is while a forward runs: in a copy from pageable memory on the default
    # stream, queued behind the spin (`torch.tensor(..., device=...)` waits for it), or in a
    # page-locked allocation (an upload's `pin_memory()` the host cache cannot serve).
    def model_pageable_copy():
        torch.tensor(list(range(4096)), dtype=torch.long, device="cuda")
    def model_pageable_async_copies():  # a forward's inputs (forward_batch.py), 256 KiB each
        for _ in range(8):
            torch.arange(1 << 15, dtype=torch.long).to("cuda", non_blocking=True)
    # Kernels nothing here launched before, one per use, into tensors made beforehand.
    unlaunched = []
    for dtype in (torch.int16, torch.int32):
        y = torch.zeros(64, 8, 4, dtype=dtype, device="cuda")
        unlaunched.append((y, torch.empty_like(y), torch.empty(y.shape, dtype=torch.long, device="cuda")))
    torch.cuda.synchronize()
    def model_first_launch():
        y, y_values, y_indices = unlaunched.pop()
        torch.cummin(y, dim=1, out=(y_values, y_indices))
    held = []  # kept, so that each allocation is a new one rather than the host cache's block
    def model_page_locked_allocation():
        held.append(torch.empty(200 << 20, dtype=torch.uint8, pin_memory=True))
    def pageable_ids():
        with torch.cuda.stream(h2d_stream):
            torch.as_tensor(pages(), dtype=torch.long).to("cuda", non_blocking=True)
        h2d_stream.synchronize()
    out["pageable page ids beside a pageable copy"] = timed_beside_spin(pageable_ids, model_pageable_copy)
    for busy_name, busy in (("pageable copy", model_pageable_copy),
                            ("pageable async copy", model_pageable_async_copies),
                            ("page-locked allocation", model_page_locked_allocation),
                            ("first launch of a kernel", model_first_launch)):
        out[f"warm gather beside a {busy_name}"] = timed_beside_spin(
            lambda: sender.executor.submit(warm_gather).result(), busy)
        out[f"warm direct page copy beside a {busy_name}"] = timed_beside_spin(
            lambda: sender.executor.submit(write_pages, pool, other.buffers, range(2), *page_pairs(),
                                           ready).result(), busy)
    sender.close()
    print(json.dumps(out))
""")


def test_a_warm_transport_does_not_wait_for_a_kernel_on_another_stream(tmp_path):
    seed = int.from_bytes(__import__("os").urandom(4), "little")
    print(f"seed {seed}")
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    done = subprocess.run([sys.executable, str(script), str(SPIN_S), str(seed)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    took = json.loads(done.stdout.strip().splitlines()[-1])
    table = "\n".join(f"  {name}: {seconds:.3f}s{'  (waited for the spin)' if seconds > SPIN_S / 2 else ''}"
                      for name, seconds in took.items())
    print(f"beside a {SPIN_S}s kernel on the default stream:\n{table}")
    for name in ("warm gather (byte stream)", "warm direct page copy", "warm gather beside a pageable copy",
                 "warm direct page copy beside a pageable copy"):
        assert took[name] < SPIN_S / 2, f"{name} waited for the kernel on the default stream:\n{table}"
