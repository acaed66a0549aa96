"""KV confidentiality for one-sided transports (mooncake): ChaCha20 (RFC 8439) over every KV cell.

Mooncake authenticates no peer: while a transfer runs, decode's staging slots are registered (and
over RDMA the prefill side's send staging too, for good), and anyone who reaches the engine's ports
can READ them (tests/workers/test_security_mooncake_inflight_read.py). So the prefill side encrypts
each cell as it gathers it into its send staging (`StagingArea.fill_from`), what is registered and
what lands in decode's staging is ciphertext, and decode decrypts as it copies a landed send out of
its staging into the request's private pages (`StagingArea.copy_into`, from send_landing.py's and
mooncake_sink.py's landings). A stranger's read gets bytes that are not the KV.

    key       = HMAC-SHA256(secret, "deepseek-pd/kv-cipher" || room || handshake nonce)  (InternalAuth.kv_cipher_key)
    cell (l, p) = layer l of request page p (its page in request order, not its staging slot)
    byte b of cell (l, p) ^= ChaCha20 keystream byte of (key, nonce = le32(l) || le32(0) || le32(0),
                             block counter = p * ceil(page_bytes / 64) + b // 64), byte b % 64

The key is used for one transfer (the handshake nonce is used once, as for the MAC key, under
another label); within it, the (layer, page, offset) of a byte names its keystream position, so a
cell sent whole or layer by layer, in windows through reused slots, out of order or from several
streams always meets the same keystream, and no two cells share one. A layer of the request takes
at most 2^32 blocks (256 GiB): `check_positions` refuses what would wrap the counter.

The MAC (kv_mac.py: the negotiated GMAC per page or BLAKE2b per layer, under a keyed BLAKE2b root)
stays over the plaintext, on the prefill side over its pool, on the decode side over the decrypted
private copy. So it is checked on what the model will read, after the last read a writer can reach
(the copy), and covers the decryption too. Not encrypt-then-MAC: decode would then have to MAC the
ciphertext before the decrypting copy (the staging may change between the two) or copy it twice.
Decrypting unauthenticated bytes is harmless here: a stream cipher has no padding to fail on, and
the pages become live only after the MAC (and the finite check) pass. The MAC of the plaintext under
its own one-time key is a PRF output: it shows nothing of the KV.

Backends, chosen by the pool's device when a cipher is built (`CellCipher`):
- CPU pools: PyPI `cryptography` (its OpenSSL ChaCha20, ~4-5 GB/s a core with AVX-512: ~46 ms of
  CPU for a 4k-token V2-Lite prompt gathered from scattered pages). Older releases held the GIL in
  `update_into`; 51.0 releases it (a busy Python thread kept running beside a 256 MB update,
  session 16), so copies in several threads run on several cores. A copy still ciphers at most
  `PIECE_BYTES` (~0.1-0.3 ms of one core) before it yields the GIL (`time.sleep(0)`), so with an
  older release the scheduler thread never waits behind a whole transfer;
- CUDA pools: a Triton kernel (kv_cipher_kernel.py) that reads, XORs and writes each cell in one
  pass on the copy's side stream, in place of the plain copy.

Negotiation (proto MooncakeDestination.kv_cipher_algorithms, HandshakeAck.kv_cipher): decode names
what it decrypts; the prefill side, with a secret, picks the first it has (`choose`) or refuses the
handshake naming both lists; its signed ack names the pick. An ack that names none (an older prefill
worker) is accepted in the clear with a warning, once (`agreed`): refusing would fail every request
between old prefill and new decode workers during a rolling upgrade; the downgrade cannot be forced
by a stranger (the offer and the ack are signed).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.host_copy import upload
from deepseek_pd.workers.transport.plan import merge_page_runs
from deepseek_pd.workers.transport.negotiation import first_offered

log = logging.getLogger(__name__)

ALGORITHM = "chacha20-cells"
KEY_BYTES = 32
BLOCK_BYTES = 64  # one ChaCha20 block
PIECE_BYTES = 256 << 10  # the CPU backend ciphers at most this much between two yields of the GIL
_warned_clear = False  # `agreed`: said once per process


def algorithms() -> tuple[str, ...]:
    """The ciphers this version implements, preferred first (every mooncake worker runs them:
    `require`)."""
    return (ALGORITHM,)


def require(device: torch.device) -> None:
    """Raises UserError unless this process can run the cipher on a pool on `device` (a pool with
    no storage, on the meta device, needs nothing)."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise UserError("the mooncake transport encrypts KV on the GPU with a Triton kernel: install "
                            "'triton' (it comes with torch's CUDA builds)") from None
        return
    if device.type == "meta":
        return
    try:
        from cryptography.hazmat.primitives.ciphers import algorithms as _  # noqa: F401
    except ImportError:
        raise UserError("the mooncake transport encrypts KV of a CPU pool with PyPI 'cryptography': "
                        "install deepseek-pd[serve] (or pip install cryptography)") from None


def choose(offered: Sequence[str]) -> str:
    """The prefill side's pick among decode's `offered` ciphers ("" when none is offered); raises
    ValueError when it has none of them."""
    return first_offered(offered, algorithms(), "no KV cipher in common")


def agreed(offered: Sequence[str], chosen: str, secured: bool) -> str:
    """The decode side's reading of the ack's `chosen` cipher ("": in the clear); raises ValueError
    when it names one decode did not offer. `secured`: this worker has a deployment secret (an ack
    in the clear then comes from an older prefill worker: warned once)."""
    if chosen:
        if chosen not in offered:
            raise ValueError(f"the prefill worker encrypts KV with {chosen!r}, decode offered {list(offered)}")
        return chosen
    global _warned_clear
    if secured and offered and not _warned_clear:
        _warned_clear = True
        log.warning("a prefill worker sends KV over mooncake in the clear (an older version): a stranger on "
                    "the mooncake ports can read its transfers in flight; upgrade it")
    return ""


def check_positions(page_bytes: int, pages_end: int) -> None:
    """Raises ValueError when request pages below `pages_end` would wrap the 32-bit block counter."""
    if pages_end * -(-page_bytes // BLOCK_BYTES) > 1 << 32:
        raise ValueError(f"{pages_end} pages of {page_bytes} bytes exceed ChaCha20's 2^32 blocks per layer")


class CellCipher:
    """One transfer's cipher over its KV cells: `copy` writes `src` rows XOR their cells' keystream
    into `dst` rows (encrypting and decrypting are the same). Built for the pool's device.

        cipher = CellCipher(key, pool.bytes_per_page, pool.device)
        cipher.copy(pool.buffers[5], [7, 8], staging.buffers[5], [0, 1], layer=5, first_page=2)
        # staging slot 0 = pool page 7 ^ keystream of (layer 5, request page 2); slot 1: page 3
    """

    def __init__(self, key: bytes, page_bytes: int, device: torch.device, algorithm: str = ALGORITHM) -> None:
        if algorithm != ALGORITHM:
            raise ValueError(f"KV cipher {algorithm!r} is not available here (have: {', '.join(algorithms())})")
        if len(key) != KEY_BYTES:
            raise ValueError(f"a KV cipher key has {KEY_BYTES} bytes, got {len(key)}")
        self.key = key
        self.page_bytes = page_bytes
        self.algorithm = algorithm
        self.blocks_per_page = -(-page_bytes // BLOCK_BYTES)
        self._device_key: torch.Tensor | None = None  # CUDA: the key's words on the device, once
        # CUDA: this thread's last row lists on the device (a copy's layers share them). Per thread:
        # each thread queues on its own side stream, which alone may reuse a replaced tensor's memory.
        self._rows = threading.local()
        self._copy = self._copy_cuda if torch.device(device).type == "cuda" else self._copy_cpu

    def copy(self, src: torch.Tensor, src_rows: Sequence[int], dst: torch.Tensor, dst_rows: Sequence[int],
             layer: int, first_page: int) -> None:
        """`dst[dst_rows[i]] = src[src_rows[i]] ^ keystream(layer, first_page + i)` for each i: rows
        are pages of one layer buffer (`[rows, ...]`, `page_bytes` each). On CUDA it is queued on
        the current stream."""
        if len(src_rows) != len(dst_rows):
            raise ValueError(f"{len(src_rows)} source rows but {len(dst_rows)} destination rows")
        if not src_rows:
            return
        check_positions(self.page_bytes, first_page + len(src_rows))
        self._copy(src, list(src_rows), dst, list(dst_rows), layer, first_page)

    def _copy_cpu(self, src: torch.Tensor, src_rows: list[int], dst: torch.Tensor, dst_rows: list[int],
                  layer: int, first_page: int) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms as ciphers

        source = src.view(src.shape[0], -1).view(torch.uint8).numpy()
        target = dst.view(dst.shape[0], -1).view(torch.uint8).numpy()
        nonce = layer.to_bytes(4, "little") + bytes(8)
        # Consecutive pages are one keystream when a page is whole blocks: a run is one piece list.
        whole = self.page_bytes % BLOCK_BYTES == 0
        runs = merge_page_runs(src_rows, dst_rows) if whole else None
        spans = ([(run.src, run.dst, run.length) for run in runs] if runs is not None
                 else [(s, d, 1) for s, d in zip(src_rows, dst_rows)])
        context = Cipher(ciphers.ChaCha20(self.key, bytes(16)), None).encryptor()  # (re-keyed per piece)
        page, held = first_page, 0
        for src_row, dst_row, length in spans:
            flat_src = memoryview(source[src_row:src_row + length].reshape(-1))
            flat_dst = memoryview(target[dst_row:dst_row + length].reshape(-1))
            for begin in range(0, length * self.page_bytes, PIECE_BYTES):
                end = min(begin + PIECE_BYTES, length * self.page_bytes)
                row, offset = divmod(begin, self.page_bytes)
                counter = (page + row) * self.blocks_per_page + offset // BLOCK_BYTES
                context.reset_nonce(counter.to_bytes(4, "little") + nonce)
                context.update_into(flat_src[begin:end], flat_dst[begin:end])
                held += end - begin
                if held >= PIECE_BYTES:  # yields the GIL: a thread that asked for it runs before the next piece
                    time.sleep(0)
                    held = 0
            page += length

    def _copy_cuda(self, src: torch.Tensor, src_rows: list[int], dst: torch.Tensor, dst_rows: list[int],
                   layer: int, first_page: int) -> None:
        from deepseek_pd.workers.transport.kv_cipher_kernel import chacha20_copy_rows

        if self._device_key is None:
            # As bytes: a transport thread's reserved page-locked buffers are long and uint8. The
            # key serves every thread's stream, so it is on the device before any of them reads it.
            key = upload(torch.frombuffer(bytearray(self.key), dtype=torch.uint8), src.device)
            if key.is_cuda:
                torch.cuda.current_stream(src.device).synchronize()
            self._device_key = key.view(torch.int32)
        wanted = (src.device, tuple(src_rows), tuple(dst_rows))
        cached = getattr(self._rows, "last", None)
        if cached is None or cached[0] != wanted:
            rows = upload(torch.tensor([src_rows, dst_rows], dtype=torch.int64), src.device)
            cached = self._rows.last = (wanted, rows)
        rows = cached[1]
        chacha20_copy_rows(src, rows[0], dst, rows[1], self._device_key, layer, first_page)
