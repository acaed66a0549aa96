"""Whether a host (CPU) pool's pages hold a NaN or an infinity, read from their bit patterns.

For the IEEE-style float formats every bit pattern above the largest finite value's, up to the
sign bit, is an infinity or a NaN: with `T` = bits(finfo.max) + 1 and `S` the sign bit, a value
is not finite exactly when its bits `b` satisfy `b & ~S >= T`. Over the signed integer view of
the same memory the positive ones are those `>= T`; over the unsigned view the negative ones are
those `>= S | T`. So a run of pages holds a non-finite value exactly when

    max(signed view) >= T   or   max(unsigned view) >= S | T

Worked example, bfloat16 (T = 0x7F80, S = 0x8000): +inf 0x7F80 and NaN 0x7FC1 are >= 0x7F80 as
int16; -inf 0xFF80 and -NaN 0xFFC1 are >= 0xFF80 as uint16; -0.0 0x8000 and -max 0xFF7F are
below both, and as int16 all negatives are below 0.

Two integer max reductions in numpy: single-threaded, no temporary, the GIL released. On the
2-core CPU machine they scan a 4k-token V2-Lite request (127 MB) several times faster than
torch's `aminmax` (the float path of `kv_checks`), whose per-call OpenMP team on a loaded machine
cost 50-700 ms for the ~1700 page runs of a scattered page list.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.page_io import consecutive_runs

# The formats where every pattern above finfo.max's (below the sign bit) is inf or NaN; the
# "fnuz" float8 formats keep their only NaN at the negative-zero pattern and are not among them.
_SIGNED = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
           torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NUMPY_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def supports(dtype: torch.dtype) -> bool:
    """Whether `nonfinite_layers` can scan pools of `dtype`."""
    return dtype in _SIGNED


@functools.lru_cache(maxsize=None)
def first_nonfinite_bits(dtype: torch.dtype) -> int:
    """T: the bits of the smallest positive non-finite value of `dtype` (bf16: 0x7F80, +inf)."""
    largest = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
    return int(largest.view(_SIGNED[dtype]).item()) + 1


def nonfinite_layers(pool: KVPool, pages: Sequence[int], layers: range | None = None) -> list[int]:
    """The layers (of `layers`, default all) of a CPU `pool` whose `pages` (whole pages) hold a NaN
    or an infinity."""
    if pool.device.type != "cpu" or not supports(pool.dtype):
        raise ValueError(f"bit-pattern finite scan needs a CPU pool of {sorted(map(str, _SIGNED))}, "
                         f"got {pool.dtype} on {pool.device}")
    holds = _scanner(pool.dtype)
    runs = consecutive_runs(sorted(pages))  # fewer, longer runs: the order of a check does not matter
    bad = []
    for layer in range(pool.num_layers) if layers is None else layers:
        signed = pool.buffers[layer].view(_SIGNED[pool.dtype]).numpy()
        if any(holds(signed[first:first + end - begin]) for begin, end, first in runs):
            bad.append(layer)
    return bad


def nonfinite_rows(data, dtype: torch.dtype, rows: int) -> list[int]:
    """The rows of `data` (any buffer: `rows` equal rows of `dtype` values, e.g. a KV chunk's bytes,
    one row per layer) that hold a NaN or an infinity; the same scan as `nonfinite_layers`, on bytes
    that need not be in a pool (nor aligned)."""
    if not supports(dtype):
        raise ValueError(f"bit-pattern finite scan needs one of {sorted(map(str, _SIGNED))}, got {dtype}")
    signed = np.frombuffer(data, dtype=_NUMPY_SIGNED[dtype.itemsize])
    holds = _scanner(dtype)
    return [row for row, values in enumerate(signed.reshape(rows, -1)) if holds(values)]


def _scanner(dtype: torch.dtype):
    """`holds(values)`: whether a numpy array of `dtype`'s signed integer view holds a non-finite value."""
    threshold = first_nonfinite_bits(dtype)
    unsigned = _UNSIGNED[dtype.itemsize]
    negative_threshold = threshold | (1 << (8 * dtype.itemsize - 1))

    def holds(values: np.ndarray) -> bool:
        return bool(values.size) and (values.max() >= threshold or values.view(unsigned).max() >= negative_threshold)
    return holds
