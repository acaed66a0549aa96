"""`ModelThread`: the one thread in a worker that runs the model.

Every forward (and every sampling call) runs here, one call at a time, so the asyncio loop that
serves gRPC, the bootstrap stream and the token streams never waits on the GPU, and nothing else
touches the model, the CUDA-graph buffers or the batched sampling state.

Every call runs under `torch.inference_mode` (`model_call`, also the group's lockstep thread's).
The model's own `no_grad` still has each op keep autograd's version counters and view records;
inference mode skips them. A prefill forward is host-bound at serving sizes (kernel launches of
27 layers of MoE), so that bookkeeping is step time: the tiny model's extend took 1.22x as long
under `no_grad` as under inference mode (CPU, median of 60 pairs), and the runner benches
(bench/runner_steps.py) time the runner under inference mode, which is what a worker's step is
held against. The tensors a call makes are inference tensors: nothing here trains, and a tensor
made in this thread that another thread updates in place outside inference mode would fail loudly.

On CUDA a thread may issue on a stream of its own (`stream`: workers/engine/model_stream.py, the
decode worker's high-priority stream), ordered against the default stream as if it ran there.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

from deepseek_pd.workers.engine.model_stream import issuing_on

T = TypeVar("T")


def model_call(fn: Callable[..., T], *args, stream: "torch.cuda.Stream | None" = None) -> T:
    """`fn(*args)` as the model thread runs every call: under inference mode, on `stream` if one is
    given (module docstring)."""
    with torch.inference_mode(), issuing_on(stream):
        return fn(*args)


class ModelThread:
    def __init__(self, name: str, stream: "torch.cuda.Stream | None" = None) -> None:
        """`stream`: where the calls issue their kernels (None: the default stream)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.stream = stream

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Runs `fn(*args)` in the model thread (`model_call`); one thread hop per call."""
        call = functools.partial(model_call, fn, *args, stream=self.stream)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
