"""Measured launch tiles per GPU and shape (`tile_tables.TABLES`, written from a sweep of
`bench/fp8_prefill_gpu.py`). A kernel asks `lookup` before its own rule (`default_tile`); no table,
no GPU entry, no shape entry, or rows outside every range all mean: the rule decides, as before.

Format, one table per kernel; ranges of rows are inclusive, None as the upper end means any larger:
    {"fp8_gemm": {"NVIDIA H100 80GB HBM3": {"2112x7168": [[2048, 4096, {"block_m": 64, ...}],
                                                          [4097, None, {...}]]}}}
The shape key is the kernel's own (`fp8_gemm`: "NxK"; `fused_moe`: "E<experts>xN<I>xK<H>-fp8"),
and so are the rows (`fp8_gemm`: M; `fused_moe`: (token, expert) pairs).
"""
from __future__ import annotations

import functools

import torch

from deepseek_pd.model.kernels.tile_tables import TABLES


def check(tables: dict) -> None:
    """ValueError unless every entry is `[lo, hi or None, tile fields]`."""
    for kernel, devices in tables.items():
        for device, shapes in devices.items():
            for shape, entries in shapes.items():
                for entry in entries:
                    if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], int)
                            or not (entry[1] is None or isinstance(entry[1], int)) or not isinstance(entry[2], dict)):
                        raise ValueError(f"{kernel} / {device} / {shape}: entry {entry!r} is not [lo, hi or None, tile]")


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def lookup(kernel: str, device: torch.device, shape: str, rows: int, tables: dict = TABLES) -> dict | None:
    """The measured tile's fields for `rows` of `shape` on `device`'s GPU, or None."""
    table = tables.get(kernel)
    if not table or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    for lo, hi, tile in table.get(_device_name(index), {}).get(shape, ()):
        if lo <= rows and (hi is None or rows <= hi):
            return tile
    return None


def ranges(best: dict[int, dict]) -> list[list]:
    """Table entries from the best tile at each measured row count: a row count up to the next
    measured one takes the next one's tile, past the last the last's. Rows below the first
    measured count get no entry (the kernel's rule decides there).

    Example: {2048: A, 8192: B} → [[2048, 2048, A], [2049, None, B]].
    """
    counts = sorted(best)
    out, lo = [], None
    for i, rows in enumerate(counts):
        hi = None if i == len(counts) - 1 else rows
        out.append([rows if lo is None else lo, hi, best[rows]])
        lo = rows + 1
    return out
