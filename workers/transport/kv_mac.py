"""A keyed MAC over the KV bytes of one transfer, for one-sided transports (mooncake).

Mooncake authenticates no peer: while a transfer runs, its staging slots (staging.py) are
registered with the engine and anyone who reaches its ports can write them (mooncake.py). So the
prefill side MACs the bytes it sent and carries the tag in the signed TransferDone; the decode side
copies the slots into the request's private pages, MACs that copy and refuses the request on a
mismatch (its pages are then scrubbed and freed like any failed transfer's). A stranger's write can
then spoil only a request that fails with a clear error; it cannot change one output token.

    key = HMAC-SHA256(secret, "deepseek-pd/kv-mac" || room || handshake nonce)  (InternalAuth.kv_key)
    header  = "room=R;pages=<the handshake's page ids>"   (request-local order: decode's staging slots)
    message_l = header || 0 || le32(l) || page 0, page 1, ... of layer l

    "gmac-pages" (preferred):
        key_g   = BLAKE2b(key, person "kv-gmac-key")             (32 bytes: an AES-256 key)
        page_tag(l, i) = AES-256-GCM(key_g, nonce = le32(l) || le64(i)), no plaintext, associated
                         data = page i of layer l (i: request order): a GMAC, 16 bytes
        layer_l = page_tag(l, 0) || page_tag(l, 1) || ...
        tag     = BLAKE2b(key, person "kv-root-gmac", header || layer_0 || layer_1 || ...)
    "blake2b-layers" (what older workers compute):
        layer_l = BLAKE2b(key, person "kv-layer", message_l)
        tag     = BLAKE2b(key, person "kv-root",  header || layer_0 || layer_1 || ...)

The handshake nonce is used once (the prefill side's replay guard), so each key MACs one transfer;
the key comes from the deployment secret, so an on-path observer who sees the tag (the bootstrap
stream is plaintext) cannot forge one.

Why GMAC per page is sound here: GCM authenticates under one key as long as no nonce repeats (NIST
SP 800-38D); within a transfer's one-time key each (layer, page) names its own nonce, and the
prefill side MACs each cell once. Decode recomputes a tag over what landed and only compares it (a
failed request is the one bit an attacker learns, once per key). A forgery of one page succeeds
with probability about (its 16-byte blocks + 1) / 2^128; the root, a keyed BLAKE2b over the page
tags in order, binds their positions, their count and the header (the nonces bind them too).
Why not keyed BLAKE2b alone: ~0.9 GB/s a core, half of a secured Mooncake transfer's CPU
(docs/performance.md, session 16); AES-GCM runs on the CPU's AES and carry-less-multiply units: ~2.7
GB/s a core at 18 KiB pages, the call's overhead included (test_kv_mac.py's cost test; ~17 GB/s in
one large call), more at 64-token pages. Why not Poly1305 per layer (~6 GB/s, incremental):
`cryptography` 51 holds the GIL through Poly1305's update (one 256 MB update stopped another Python
thread for its whole 68 ms, measured), so on a decode worker it would stall the scheduler thread;
its AEAD calls release the GIL (from 2 KiB: pyca/cryptography#15359), as hashlib's BLAKE2b does. So
"gmac-pages" is offered only with a release measured to release it (`GIL_FREE_CRYPTOGRAPHY`; a test
holds it to that), built on OpenSSL or LibreSSL (that change left BoringSSL's and AWS-LC's AEAD path
as it was), where the library has AES-GCM; otherwise a process offers and computes "blake2b-layers"
alone.

Negotiation: decode offers what it checks, preferred first (`MooncakeDestination.kv_mac_algorithms`);
the prefill side takes the first it computes (`choose`) or refuses the handshake naming both lists,
names its pick in the signed ack (`HandshakeAck.kv_mac`) and again in the signed done
(`TransferDone.kv_mac_algorithm`). Decode builds the tag as the KV lands with the ack's pick
(`agreed`: an ack that names none comes from an older prefill worker, which computes
"blake2b-layers") and refuses a done that names another.

Cost: one read of the prompt's KV on each side, once per transfer, in worker threads off the GIL:
off the decode steps. The prefill side reads each send's pages beside its write (`LayerMacs`, from
`MooncakeChannel.begin_seal`), so its seal at `finish`, on the first token's path, only digests
(bench/kv_mac_finish.py); the decode side reads each send's private copy as it lands (`LandedMacs`,
send_landing.py), so its check after the TransferDone only digests too. The layers hash in
parallel in up to 8 threads (half the cores); the CPU per side is the prompt's KV bytes at the
algorithm's rate (figures: docs/performance.md). A CUDA pool's pages are gathered on the
device and copied to the host a layer at a time first (PCIe at ~25 GB/s adds ~5 ms for that
prompt); a MAC computed on the device (no host copy) is not done here: no keyed MAC kernel is at
hand, and an unkeyed device checksum would not stop a stranger who can read the pages too.

What it relies on: the MAC is computed on the copy the model will read, which no writer reaches.
With the KV encrypted in the stagings (kv_cipher.py) that copy is the decrypted plaintext, and the
prefill side MACs its pool's plaintext: the tag checks the decryption too.
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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.page_io import consecutive_runs, page_index, side_stream, wait_ready
from deepseek_pd.workers.transport.negotiation import first_offered

KEY_BYTES = 32
GMAC = "gmac-pages"
BLAKE2B = "blake2b-layers"
OLDER_PEERS = BLAKE2B  # what a prefill worker computes whose ack names no MAC (before "gmac-pages")
# The first `cryptography` release measured to release the GIL in AES-GCM's encrypt (51.0.1: another
# Python thread kept ticking through 64 MB of associated data; pyca/cryptography#15359). Releases
# before it are not offered GMAC (some held the GIL for a whole call).
GIL_FREE_CRYPTOGRAPHY = (51, 0)
_ROOT_PERSON = {GMAC: b"kv-root-gmac", BLAKE2B: b"kv-root"}
# hashlib and cryptography's AEADs release the GIL while they hash (more than 2 KiB at a time), so
# layers hash in parallel, off the interpreter that runs the scheduler. A few threads: a transfer is
# one of many; at least two, so that one transfer's layers never hash on a single core behind
# another's (half of 2 cores was one thread: a 4k-token prompt's hashing, then the next one's, in a row).
_THREADS = max(2, min(8, (os.cpu_count() or 2) // 2))
_pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="kv-mac")


def _gmac_usable() -> bool:
    """`cryptography` is installed, releases the GIL in its AEADs (`GIL_FREE_CRYPTOGRAPHY`, and
    built on OpenSSL or LibreSSL: the change that releases it left the AEAD path of BoringSSL and
    AWS-LC builds as it was), and its library has AES-GCM."""
    try:
        import cryptography
        from cryptography.hazmat.bindings._rust import openssl as built_on
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return False
    try:
        release = tuple(int(part) for part in cryptography.__version__.split(".")[:2])
        if release < GIL_FREE_CRYPTOGRAPHY:
            return False
        if any(getattr(built_on, flag, False) for flag in ("CRYPTOGRAPHY_IS_BORINGSSL", "CRYPTOGRAPHY_IS_AWSLC")):
            return False
        AESGCM(bytes(KEY_BYTES)).encrypt(bytes(12), b"", b"probe")
    except Exception:  # (an unparsable version, an OpenSSL without AES-GCM)
        return False
    return True


_USABLE = (GMAC, BLAKE2B) if _gmac_usable() else (BLAKE2B,)
_ALGORITHMS = _USABLE


def algorithms() -> tuple[str, ...]:
    """The MAC algorithms this process computes, preferred first (what decode offers)."""
    return _ALGORITHMS


def offer_only(names: Sequence[str]) -> None:
    """This process offers and computes `names` alone, in that order (benches and tests: one
    algorithm against another in one run, or an older worker's set); ValueError for one it lacks."""
    global _ALGORITHMS
    missing = [name for name in names if name not in _USABLE]
    if missing or not names:
        raise ValueError(f"KV MAC {missing or list(names)} not available here (have: {', '.join(_USABLE)})")
    _ALGORITHMS = tuple(names)


def choose(offered: Sequence[str]) -> str:
    """The prefill side's pick among decode's `offered` MACs ("" when none is offered: an older
    decode worker, or a transport without one); raises ValueError when it computes none of them."""
    return first_offered(offered, algorithms(), "no KV MAC in common")


def agreed(offered: Sequence[str], chosen: str) -> str:
    """The decode side's reading of the ack's `chosen` MAC: one it offered ("" when it offered none);
    an ack that names none comes from an older prefill worker, which computes `OLDER_PEERS`. Raises
    ValueError for one it did not offer."""
    if not offered:
        return ""
    chosen = chosen or OLDER_PEERS
    if chosen not in offered:
        raise ValueError(f"the prefill worker MACs the KV with {chosen!r}, decode offered {list(offered)}")
    return chosen


class _LayerMac:
    """One layer's MAC as it takes the layer's pages in request order (`update`, whole pages), then
    `tag` once."""

    def __init__(self, algorithm: str, key: bytes, layer: int, head: bytes) -> None:
        self._index = layer.to_bytes(4, "little")
        if algorithm == GMAC:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            self._gmac = AESGCM(hashlib.blake2b(key=key, digest_size=KEY_BYTES, person=b"kv-gmac-key").digest())
            self._page_tags: list[bytes] = []
        else:
            self._gmac = None
            self._blake = hashlib.blake2b(key=key, digest_size=32, person=b"kv-layer")
            self._blake.update(head + b"\x00" + self._index)

    def update(self, data: memoryview, page_bytes: int) -> None:
        """The next whole pages of this layer, in request order."""
        if self._gmac is None:
            self._blake.update(data)
            return
        for offset in range(0, len(data), page_bytes):  # (each call releases the GIL: >= 2 KiB)
            nonce = self._index + len(self._page_tags).to_bytes(8, "little")
            self._page_tags.append(self._gmac.encrypt(nonce, b"", data[offset:offset + page_bytes]))

    def tag(self) -> bytes:
        return b"".join(self._page_tags) if self._gmac is not None else self._blake.digest()


def header(room: int, dst_pages: Sequence[int]) -> bytes:
    """What binds a tag to its room and its destination pages."""
    return f"room={room};pages={','.join(map(str, dst_pages))}".encode()


def _resolved(key: bytes, algorithm: str | None) -> str:
    """`algorithm` (None: this process's preferred), checked with `key`'s size."""
    algorithm = algorithms()[0] if algorithm is None else algorithm
    if algorithm not in algorithms():
        raise ValueError(f"KV MAC algorithm {algorithm!r} is not available here (have: {', '.join(algorithms())})")
    if len(key) != KEY_BYTES:
        raise ValueError(f"a KV MAC key has {KEY_BYTES} bytes, got {len(key)}")
    return algorithm


def _feed(mac: _LayerMac, pool: KVPool, layer: int, pages: Sequence[int],
          runs: list[tuple[int, int, int]], ready: "torch.cuda.Event | None", synced: bool = False) -> None:
    """Hashes `pages` of one layer, in order, into `mac`. `synced`: their last write is complete
    (host-synchronised), so no stream needs waiting for."""
    buffer = pool.buffers[layer]
    flat = buffer.view(pool.num_pages, -1)
    if buffer.device.type == "cpu":
        as_bytes = flat.view(torch.uint8).numpy()
        for begin, end, first in runs:
            mac.update(memoryview(as_bytes[first:first + end - begin]).cast("B"), pool.bytes_per_page)
        return
    # Gathered on the device and copied to the host on this thread's side stream, which waits for
    # `ready` (else for the default stream, unless `synced`): not for the forwards queued after the
    # KV was written.
    stream = side_stream(buffer.device)
    with torch.cuda.stream(stream):
        if not synced:
            wait_ready(pool, ready, stream)
        index = page_index(pool, pages)  # (page-locked: host_copy.upload's rule)
        host = flat.index_select(0, index).view(torch.uint8).to("cpu")  # (synchronises the side stream)
    mac.update(memoryview(host.numpy()).cast("B"), pool.bytes_per_page)


class LayerMacs:
    """The tag of one transfer, built as its pages go out, so that `digest` (on the first token's
    path) has only what was not yet hashed left to read.

    `update` hashes request-local pages `[page_begin, page_begin + len(pages))` of some layers; a layer
    takes them only if they continue what it has hashed (a page range sent out of order is read
    again by `digest`, as is every page no `update` saw). The tag is the same whatever the cut:

        macs = LayerMacs(pool.num_layers, key, head)
        macs.update(pool, range(0, 1), 0, [7, 8])         # layer 0 of pages 0-1, as it went out
        macs.update(pool, range(1, 27), 0, [7, 8])        # the other layers of them
        macs.digest(pool, [7, 8, 3]) == kv_mac(pool, [7, 8, 3], key, head, GMAC)   # reads page 2 only

    Calls must not overlap (a channel's sends are sequential); each reads what the pool holds then,
    so a page is hashed as it was sent (a sent page is complete: SendPlan).
    """

    def __init__(self, num_layers: int, key: bytes, head: bytes, algorithm: str | None = None) -> None:
        algorithm = _resolved(key, algorithm)
        self.key, self.head, self.algorithm = key, head, algorithm
        self._macs = [_LayerMac(algorithm, key, layer, head) for layer in range(num_layers)]
        self.hashed = [0] * num_layers  # request-local pages each layer has hashed, from page 0
        self.pages_read = 0  # (layer, page) cells read so far, by `update` and `digest`
        self.seconds = 0.0  # the hashing's time, summed over the MAC's threads (TransferStats' `mac`)
        self._timing = threading.Lock()

    def update(self, pool: KVPool, layers: range, page_begin: int, pages: Sequence[int],
               ready: "torch.cuda.Event | None" = None, synced: bool = False) -> "Hashing":
        """Starts hashing `pages` (this pool's ids of request-local pages from `page_begin`) of
        `layers`, the layers in parallel in the MAC's threads, and returns at once: the caller does its
        write meanwhile, then `wait`s. `ready` (CUDA): an event recorded after their KV was written;
        `synced`: as for `digest`."""
        todo = [layer for layer in layers if self.hashed[layer] == page_begin]
        for layer in todo:
            self.hashed[layer] = page_begin + len(pages)
        return self._hash(pool, todo, list(pages), ready, synced)

    def digest(self, pool: KVPool, pages: Sequence[int], synced: bool = False) -> bytes:
        """The tag over all of `pages` (this pool's ids, in request-local order): hashes what each
        layer lacks, then the keyed root over the layer tags. Ends this object's use. `synced`: the
        pages' writes are complete (a host-synchronised copy, as decode's landing): on CUDA the
        reads then wait for no stream (else for the default stream, where the model writes KV)."""
        pages = list(pages)
        tails = []
        for begin in sorted(set(self.hashed)):  # layers that stopped at the same page, together
            todo = [layer for layer, hashed in enumerate(self.hashed) if hashed == begin]
            tails.append(self._hash(pool, todo, pages[begin:], None, synced))
        for tail in tails:
            tail.wait()
        root = hashlib.blake2b(key=self.key, digest_size=32, person=_ROOT_PERSON[self.algorithm])
        root.update(self.head)
        for mac in self._macs:
            root.update(mac.tag())
        return root.digest()

    def _hash(self, pool: KVPool, layers: list[int], pages: list[int], ready: "torch.cuda.Event | None",
              synced: bool = False) -> "Hashing":
        if not layers or not pages:
            return Hashing([])
        runs = consecutive_runs(pages)
        self.pages_read += len(layers) * len(pages)
        return Hashing([_pool.submit(self._feed, self._macs[layer], pool, layer, pages, runs, ready, synced)
                        for layer in layers])

    def _feed(self, *args) -> None:
        began = time.perf_counter()
        try:
            _feed(*args)
        finally:
            with self._timing:
                self.seconds += time.perf_counter() - began


class LandedMacs:
    """The decode side's tag of one transfer, built as its cells land in the request's private
    pages (copied there out of the staging, where no writer reaches them), in whatever cut and order
    they land, so that the check after the TransferDone (on the first token's path) only digests.

    `landed` hashes a layer's pages only in request order: a range that lands before the pages
    in front of it waits, parked, and is hashed by the landing that fills the gap. What never
    landed before `digest` (a transfer copied out whole after its TransferDone) is read there.
    The tag is `kv_mac`'s whatever the cut and the order:

        macs = LandedMacs(pool, [7, 8, 3], key, head, GMAC)   # pool: decode's; pages: the request's
        macs.landed(range(5, 6), 2, 3)    # layer 5 of page 2 landed first: parked
        macs.landed(range(0, 27), 0, 2)   # pages 0-1 of every layer: hashes those, then layer 5's page 2
        macs.landed(range(0, 5), 2, 3); macs.landed(range(6, 27), 2, 3)
        macs.digest() == kv_mac(pool, [7, 8, 3], key, head, GMAC)   # reads no page

    `landed` may run in several threads at once (a sink lands chunks side by side); a cell must
    land once (the sink refuses a second landing before it copies: a copy over a hashed page
    would let the model read bytes the tag never covered). The pages' writes are complete when
    they land (a synchronised copy), so on CUDA no read waits for a stream.
    """

    def __init__(self, pool: KVPool, pages: Sequence[int], key: bytes, head: bytes,
                 algorithm: str | None = None) -> None:
        self._pool = pool
        self._pages = list(pages)
        self._macs = LayerMacs(pool.num_layers, key, head, algorithm)
        self.algorithm = self._macs.algorithm
        self._parked: list[dict[int, int]] = [{} for _ in range(pool.num_layers)]  # begin -> end, not hashed
        self._lock = threading.Lock()  # the parked ranges and `hashed`
        # Held while a layer's range is hashed: the next range of that layer waits, so each layer's
        # MAC takes its pages in order.
        self._layer_locks = [threading.Lock() for _ in range(pool.num_layers)]

    @property
    def key(self) -> bytes:
        return self._macs.key

    @property
    def pages_read(self) -> int:
        """(layer, page) cells hashed so far, by `landed` and `digest`."""
        return self._macs.pages_read

    @property
    def seconds(self) -> float:
        """The hashing's time so far, summed over the MAC's threads."""
        return self._macs.seconds

    def landed(self, layers: range, page_begin: int, page_end: int) -> None:
        """Request pages [page_begin, page_end) of `layers` are in their private pages now: hashes
        every range this lets a layer hash in order; returns once hashed (raises what a read raised)."""
        with self._lock:
            for layer in layers:
                self._parked[layer][page_begin] = page_end
        held: list[threading.Lock] = []
        try:
            hashing = []
            for layer in layers:  # ascending in every caller, so no two wait on each other
                self._layer_locks[layer].acquire()
                held.append(self._layer_locks[layer])
                with self._lock:
                    begin = end = self._macs.hashed[layer]
                    parked = self._parked[layer]
                    while end in parked:
                        end = parked.pop(end)
                    if end > begin:  # (only submits: the layer's read runs in the MAC's threads)
                        hashing.append(self._macs.update(self._pool, range(layer, layer + 1), begin,
                                                         self._pages[begin:end], synced=True))
            for each in hashing:
                each.wait()
        finally:
            for lock in held:
                lock.release()

    def digest(self) -> bytes:
        """The tag over every page (reads what no landing hashed); after the last `landed`."""
        return self._macs.digest(self._pool, self._pages, synced=True)


class Hashing:
    """Layers being hashed in the MAC's threads (`LayerMacs.update`)."""

    def __init__(self, futures: list[Future]) -> None:
        self._futures = futures

    def wait(self) -> None:
        """Returns once every layer is hashed; raises the first error."""
        for future in self._futures:
            future.result()


def kv_mac(pool: KVPool, pages: Sequence[int], key: bytes, head: bytes, algorithm: str | None = None,
           synced: bool = False) -> bytes:
    """The tag of `pages` (this pool's ids, in request-local order) over every layer, after `head`:
    `algorithm`'s MAC per layer (in parallel; None: the preferred), then a keyed BLAKE2b over those.
    Raises ValueError for an algorithm this process does not compute or a key of the wrong size.
    `synced`: as for `LayerMacs.digest`."""
    return LayerMacs(pool.num_layers, key, head, algorithm).digest(pool, pages, synced)


def tags_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
