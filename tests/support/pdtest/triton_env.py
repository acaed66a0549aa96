"""Where the Triton kernel tests run: on a GPU, or on the CPU through Triton's interpreter.

Import it before any kernel module: on a machine without CUDA it sets TRITON_INTERPRET=1, which
`triton.jit` reads when a kernel is decorated. Whether the interpreter runs here (Triton 3.6
indexed with 1-element arrays, which numpy >= 2.4 refuses; 3.7 does not) is decided by running one
tiny kernel, once per process.

    from pdtest.triton_env import DEVICE, needs_triton  # first: before the kernels
"""
from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if HAS_CUDA else "cpu"


@functools.lru_cache(maxsize=None)
def interpreter_runs() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _copy(src, dst, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

        src = torch.arange(5, dtype=torch.float32)
        dst = torch.zeros(5)
        _copy[(1,)](src, dst, 5, BLOCK=8)
        return bool(torch.equal(src, dst))
    except Exception:  # any failure means: no interpreter here
        return False


TRITON_RUNS = HAS_CUDA or (HAS_TRITON and interpreter_runs())
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="needs a GPU, or Triton whose CPU interpreter runs here")
