"""The KV MAC's documented constructions (workers/transport/kv_mac.py's docstring), computed
independently of it: sequentially over each page's bytes, with GCM's GHASH in pure Python (NIST SP
800-38D) and only AES's block function from `cryptography` (ECB), so that a test of "gmac-pages"
does not trust the AEAD call it checks."""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_R = 0xE1 << 120  # GCM's reduction constant, bit-reflected


def _gf_multiply(x: int, y: int) -> int:
    """The product in GF(2^128) as GCM defines it (bit 0 is the most significant)."""
    product, v = 0, y
    for bit in range(127, -1, -1):
        if (x >> bit) & 1:
            product ^= v
        v = (v >> 1) ^ _R if v & 1 else v >> 1
    return product


def gmac(key: bytes, nonce: bytes, associated: bytes) -> bytes:
    """AES-GCM's tag with no plaintext (a GMAC): GHASH over the associated data and its bit length,
    masked with the block cipher of the first counter block; 12-byte `nonce`."""
    block = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    h = int.from_bytes(block.update(bytes(16)), "big")
    padded = associated + bytes(-len(associated) % 16) + (8 * len(associated)).to_bytes(8, "big") + bytes(8)
    y = 0
    for begin in range(0, len(padded), 16):
        y = _gf_multiply(y ^ int.from_bytes(padded[begin:begin + 16], "big"), h)
    mask = int.from_bytes(block.update(nonce + (1).to_bytes(4, "big")), "big")
    return (y ^ mask).to_bytes(16, "big")


def page_bytes(buffer: torch.Tensor, page: int) -> bytes:
    return buffer[page].contiguous().view(torch.uint8).numpy().tobytes()


def kv_tag(buffers: Sequence[torch.Tensor], pages: Sequence[int], key: bytes, head: bytes, algorithm: str) -> bytes:
    """The transfer's tag over every layer buffer's `pages`, by the construction `algorithm` names."""
    layers = []
    for layer, buffer in enumerate(buffers):
        index = layer.to_bytes(4, "little")
        if algorithm == "gmac-pages":
            gmac_key = hashlib.blake2b(key=key, digest_size=32, person=b"kv-gmac-key").digest()
            layers.append(b"".join(gmac(gmac_key, index + i.to_bytes(8, "little"), page_bytes(buffer, page))
                                   for i, page in enumerate(pages)))
        elif algorithm == "blake2b-layers":
            message = head + b"\x00" + index + b"".join(page_bytes(buffer, page) for page in pages)
            layers.append(hashlib.blake2b(message, key=key, digest_size=32, person=b"kv-layer").digest())
        else:
            raise ValueError(algorithm)
    person = b"kv-root-gmac" if algorithm == "gmac-pages" else b"kv-root"
    return hashlib.blake2b(head + b"".join(layers), key=key, digest_size=32, person=person).digest()
