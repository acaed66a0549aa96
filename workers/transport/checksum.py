"""The crc32 of KV chunks (`KVChunk.crc32`, zlib's CRC-32), from the fastest implementation here.

zlib's table-driven crc32 runs at about 0.45 GB/s on the CI machine's cores, and every chunk is
checksummed twice (sender and receiver): at 127 MB per 4k-token V2-Lite request that alone was
the largest share of a transfer's CPU time (bench/kv_transfer.py, docs/performance.md). ISA-L's
(PyPI `isal`) computes the same CRC-32 with carry-less multiplies, about 10x faster; it is used
when importable, so peers with and without it interoperate (the value is the same).

    crc32(data) == zlib.crc32(data)    # for any buffer, either implementation
"""
from __future__ import annotations

import zlib

try:
    from isal import isal_zlib as _fast
except ImportError:  # optional: the GPU image installs the package without dependencies
    _fast = None

crc32 = _fast.crc32 if _fast is not None else zlib.crc32
IMPLEMENTATION = "isal" if _fast is not None else "zlib"
