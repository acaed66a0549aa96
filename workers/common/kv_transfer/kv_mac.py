"""A keyed MAC over the KV bytes of one transfer, for one-sided transports (mooncake).

Mooncake authenticates no peer: while a transfer runs, its decode pages are registered with the
engine and anyone who reaches its ports can write them (mooncake.py). So the prefill side MACs the
bytes it sent and carries the tag in the signed TransferDone; the decode side, once the pages are
withdrawn, MACs what landed and refuses the request on a mismatch (its pages are then scrubbed and
freed like any failed transfer's). A stranger's write can then spoil only a request that fails
with a clear error; it cannot change one output token.

    key = HMAC-SHA256(secret, "deepseek-pd/kv-mac" || room || handshake nonce)  (InternalAuth.kv_key)
    tag = MAC(key, header || layer 0: page 0, page 1, ... || layer 1: ... )      (request-local page order)
    header = "room=R;pages=<decode page ids>"

The handshake nonce is used once (the prefill side's replay guard), so each key MACs one transfer:
that is what Poly1305, a one-time authenticator, needs. The key comes from the deployment secret,
so an on-path observer who sees the tag (the bootstrap stream is plaintext) cannot forge one.

Algorithms (`TransferDone.kv_mac_algorithm`): "poly1305" (PyPI `cryptography`, ~2-5 GB/s a core)
where it imports, else "blake2b" (hashlib, keyed, ~0.5-1 GB/s). The verifier uses whichever the
sender named; each algorithm's tag is 16 bytes or more and compared in constant time.

Cost: one read of the prompt's KV on each side, once per transfer in a worker thread: off the
decode steps, on the first token's path. Measured (test_kv_mac.py's bench, CPU pool read in
place, 2 shared CI cores): poly1305 0.21 ms of CPU per MB (~4.8 GB/s), blake2b 1.1 ms/MB; so
~27 ms per side for a 4k-token V2-Lite prompt (127 MB). A CUDA pool's pages are gathered on the
device and copied to the host a layer at a time first (PCIe at ~25 GB/s adds ~5 ms for that
prompt); a MAC computed on the device (no host copy) is not done here: no keyed MAC kernel is at
hand, and an unkeyed device checksum would not stop a stranger who can read the pages too.

What it does not cover: Mooncake's TCP server checks a write's range once, when its header
arrives, then reads the body with no deadline (tcp_transport_session_impl.h, readHeader/readBody).
A stranger who sends a header while the pages are registered can trickle the body in after the
withdrawal and the MAC check. Over RDMA the pools stay registered for the worker's life, so a write
after the check is possible at any time. Both are documented in docs/operations.md §8.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Protocol, Sequence

import torch

from deepseek_pd.model.kv_pool import KVPool
from deepseek_pd.workers.common.kv_transfer.page_io import consecutive_runs

try:
    from cryptography.hazmat.primitives.poly1305 import Poly1305
except ImportError:  # optional: the GPU image installs the package without dependencies
    Poly1305 = None

KEY_BYTES = 32


class _Mac(Protocol):
    def update(self, data: bytes | memoryview) -> None: ...


def algorithms() -> tuple[str, ...]:
    """The MAC algorithms this process can compute, preferred first."""
    return ("poly1305", "blake2b") if Poly1305 is not None else ("blake2b",)


def _new(algorithm: str, key: bytes) -> _Mac:
    if algorithm == "poly1305" and Poly1305 is not None:
        return Poly1305(key)
    if algorithm == "blake2b":
        return hashlib.blake2b(key=key, digest_size=32)
    raise ValueError(f"KV MAC algorithm {algorithm!r} is not available here (have: {', '.join(algorithms())})")


def _tag(mac: _Mac) -> bytes:
    return mac.finalize() if hasattr(mac, "finalize") else mac.digest()


def header(room: int, dst_pages: Sequence[int]) -> bytes:
    """What binds a tag to its room and its destination pages."""
    return f"room={room};pages={','.join(map(str, dst_pages))}".encode()


def kv_mac(pool: KVPool, pages: Sequence[int], key: bytes, head: bytes, algorithm: str) -> bytes:
    """The tag of `pages` (this pool's ids, in request-local order) over every layer, after `head`.

    A CPU pool is read in place (one memoryview per run of consecutive pages); a CUDA pool's pages
    are gathered and copied to the host one layer at a time."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a KV MAC key has {KEY_BYTES} bytes, got {len(key)}")
    mac = _new(algorithm, key)
    mac.update(head)
    runs = list(consecutive_runs(pages))
    index = None
    for buffer in pool.buffers:
        flat = buffer.view(pool.num_pages, -1)
        if buffer.device.type == "cpu":
            as_bytes = flat.view(torch.uint8).numpy()
            for begin, end, first in runs:
                mac.update(memoryview(as_bytes[first:first + end - begin]).cast("B"))
        else:
            if index is None:
                index = torch.tensor(list(pages), dtype=torch.long, device=buffer.device)
            host = flat.index_select(0, index).view(torch.uint8).cpu().numpy()
            mac.update(memoryview(host).cast("B"))
    return _tag(mac)


def tags_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
