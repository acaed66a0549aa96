"""`ModelThread`: the one thread in a worker that runs the model.

Every forward (and every sampling call) runs here, one call at a time, so the asyncio loop that
serves gRPC, the bootstrap stream and the token streams never waits on the GPU, and nothing else
touches the model, the CUDA-graph buffers or the batched sampling state.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class ModelThread:
    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Runs `fn(*args)` in the model thread; one thread hop per call."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
