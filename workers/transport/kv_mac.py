"""A keyed MAC over the KV bytes of one transfer, for one-sided transports (mooncake).

Mooncake authenticates no peer: while a transfer runs, its staging slots (staging.py) are
registered with the engine and anyone who reaches its ports can write them (mooncake.py). So the
prefill side MACs the bytes it sent and carries the tag in the signed TransferDone; the decode side
copies the slots into the request's private pages, MACs that copy and refuses the request on a
mismatch (its pages are then scrubbed and freed like any failed transfer's). A stranger's write can
then spoil only a request that fails with a clear error; it cannot change one output token.

    key = HMAC-SHA256(secret, "deepseek-pd/kv-mac" || room || handshake nonce)  (InternalAuth.kv_key)
    layer_l = BLAKE2b(key, person "kv-layer", header || 0 || l || page 0, page 1, ... of layer l)
    tag     = BLAKE2b(key, person "kv-root",  header || layer_0 || layer_1 || ...)
    header  = "room=R;pages=<the handshake's page ids>"   (request-local order: decode's staging slots)

The handshake nonce is used once (the prefill side's replay guard), so each key MACs one transfer;
the key comes from the deployment secret, so an on-path observer who sees the tag (the bootstrap
stream is plaintext) cannot forge one. The handshake names the algorithms the decode side checks
(`MooncakeDestination.kv_mac_algorithms`), the done the one used (`kv_mac_algorithm`).

Why keyed BLAKE2b per layer and not Poly1305 (PyPI `cryptography`, ~5x faster on one core):
`cryptography`'s Poly1305 holds the GIL while it runs (a 256 MB update stalled another Python
thread for 235 ms; fed in 1 MiB pieces, for 20-35 ms at a time), and on a decode worker that
thread is the scheduler; hashlib's BLAKE2b releases it (the same thread ticked every ~1 ms), so
the layers hash in parallel on spare cores without touching the decode steps.

Cost: one read of the prompt's KV on each side, once per transfer, in worker threads off the GIL:
off the decode steps, on the first token's path. Measured (test_kv_mac.py's bench, CPU pool read
in place, 2 shared CI cores): ~1.1 ms of CPU per MB (~0.9 GB/s a core), divided by the threads
(up to 8, half the cores); a 4k-token V2-Lite prompt (127 MB) is ~140 ms of CPU per side, ~20 ms
of wall time on 8 free cores. A CUDA pool's pages are gathered on the
device and copied to the host a layer at a time first (PCIe at ~25 GB/s adds ~5 ms for that
prompt); a MAC computed on the device (no host copy) is not done here: no keyed MAC kernel is at
hand, and an unkeyed device checksum would not stop a stranger who can read the pages too.

What it relies on: the MAC is computed on the copy the model will read, which no writer reaches.
Mooncake's TCP server checks a write's range once, when its header arrives, then reads the body
with no deadline (tcp_transport_session_impl.h, readHeader/readBody), and over RDMA both stagings
stay registered: a body that lands after the copy changes only the staging
(tests/workers/test_security_mooncake_slow_body.py); one that lands in slots a later transfer uses
fails that transfer's check. docs/operations.md §8.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.page_io import consecutive_runs

KEY_BYTES = 32
ALGORITHM = "blake2b-layers"
# hashlib releases the GIL while it hashes (more than 2 KiB at a time), so layers hash in parallel,
# off the interpreter that runs the scheduler. A few threads: a transfer is one of many.
_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
_pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="kv-mac")


def algorithms() -> tuple[str, ...]:
    """The MAC algorithms this process computes, preferred first."""
    return (ALGORITHM,)


def header(room: int, dst_pages: Sequence[int]) -> bytes:
    """What binds a tag to its room and its destination pages."""
    return f"room={room};pages={','.join(map(str, dst_pages))}".encode()


def _layer_tag(buffer: torch.Tensor, num_pages: int, layer: int, pages: Sequence[int],
               runs: list[tuple[int, int, int]], key: bytes, head: bytes) -> bytes:
    mac = hashlib.blake2b(key=key, digest_size=32, person=b"kv-layer")
    mac.update(head + b"\x00" + layer.to_bytes(4, "little"))
    flat = buffer.view(num_pages, -1)
    if buffer.device.type == "cpu":
        as_bytes = flat.view(torch.uint8).numpy()
        for begin, end, first in runs:
            mac.update(memoryview(as_bytes[first:first + end - begin]).cast("B"))
    else:  # gathered on the device, copied to the host (the copy also releases the GIL)
        index = torch.tensor(list(pages), dtype=torch.long, device=buffer.device)
        mac.update(memoryview(flat.index_select(0, index).view(torch.uint8).cpu().numpy()).cast("B"))
    return mac.digest()


def kv_mac(pool: KVPool, pages: Sequence[int], key: bytes, head: bytes, algorithm: str = ALGORITHM) -> bytes:
    """The tag of `pages` (this pool's ids, in request-local order) over every layer, after `head`:
    a keyed BLAKE2b per layer (in parallel), then a keyed BLAKE2b over those. Raises ValueError for
    an algorithm this process does not compute or a key of the wrong size."""
    if algorithm != ALGORITHM:
        raise ValueError(f"KV MAC algorithm {algorithm!r} is not available here (have: {', '.join(algorithms())})")
    if len(key) != KEY_BYTES:
        raise ValueError(f"a KV MAC key has {KEY_BYTES} bytes, got {len(key)}")
    runs = consecutive_runs(pages)
    layer_tags = _pool.map(lambda item: _layer_tag(item[1], pool.num_pages, item[0], pages, runs, key, head),
                           enumerate(pool.buffers))
    root = hashlib.blake2b(key=key, digest_size=32, person=b"kv-root")
    root.update(head)
    for tag in layer_tags:
        root.update(tag)
    return root.digest()


def tags_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
