"""Whether Triton's CPU interpreter runs here (Triton 3.6's indexed with 1-element arrays, which
numpy >= 2.4 refuses; 3.7 does not). Decided by running one tiny kernel, once per process."""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def interpreter_runs() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import torch
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
