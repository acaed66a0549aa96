"""Byte units, and how a size is written in logs and errors: one place for "GiB is 2**30 bytes"."""
from __future__ import annotations

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def gib(num_bytes: float, digits: int = 2) -> str:
    """`num_bytes` in GiB, e.g. "1.50 GiB"."""
    return f"{num_bytes / GIB:.{digits}f} GiB"


def mib(num_bytes: float, digits: int = 2) -> str:
    """`num_bytes` in MiB, e.g. "4.00 MiB"."""
    return f"{num_bytes / MIB:.{digits}f} MiB"


def readable_size(num_bytes: float) -> str:
    """`num_bytes` in the largest binary unit it reaches, one decimal: "3.2 GiB", "17 B"."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"
