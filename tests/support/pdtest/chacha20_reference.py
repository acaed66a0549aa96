"""ChaCha20's keystream (RFC 8439 section 2.3-2.4) in plain numpy: the KV cipher's oracle where PyPI
`cryptography` is not installed (the GPU image), itself checked against `cryptography` in
tests/workers/transport/test_kv_cipher.py.

    keystream(key, nonce12, counter, num_blocks) -> bytes   # 64 * num_blocks bytes
"""
from __future__ import annotations

import numpy as np

_CONSTANTS = np.array([0x61707865, 0x3320646E, 0x79622D32, 0x6B206574], dtype=np.uint32)


def _quarter(x: np.ndarray, a: int, b: int, c: int, d: int) -> None:
    for p, q, r, shift in ((a, b, d, 16), (c, d, b, 12), (a, b, d, 8), (c, d, b, 7)):
        x[p] += x[q]
        x[r] ^= x[p]
        x[r] = (x[r] << np.uint32(shift)) | (x[r] >> np.uint32(32 - shift))


def keystream(key: bytes, nonce: bytes, counter: int, num_blocks: int) -> bytes:
    """Blocks `counter`, `counter + 1`, ... of ChaCha20 under the 32-byte `key` and 12-byte `nonce`."""
    if len(key) != 32 or len(nonce) != 12:
        raise ValueError(f"a 32-byte key and a 12-byte nonce, got {len(key)} and {len(nonce)}")
    state = np.empty((16, num_blocks), dtype=np.uint32)
    state[0:4] = _CONSTANTS[:, None]
    state[4:12] = np.frombuffer(key, dtype="<u4")[:, None]
    state[12] = (np.arange(num_blocks, dtype=np.uint64) + counter).astype(np.uint32)
    state[13:16] = np.frombuffer(nonce, dtype="<u4")[:, None]
    x = state.copy()
    with np.errstate(over="ignore"):
        for _ in range(10):
            for a, b, c, d in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                               (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
                _quarter(x, a, b, c, d)
        x += state
    return x.T.astype("<u4").tobytes()
