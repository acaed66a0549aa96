"""KV confidentiality over mooncake (workers/transport/kv_cipher.py): each cell's bytes XOR the
documented ChaCha20 keystream, with PyPI `cryptography` as the oracle (on the CPU path and the Triton
kernel, here under TRITON_INTERPRET=1); the keys; the negotiation's rules; and a transfer over a stub
engine that really moves the bytes: what the prefill side writes and what waits in decode's staging
is ciphertext, what decode lands is the KV, and a stranger's write still fails the MAC.
Its decode workers run the write direction (`mooncake_kv_direction=write`), the one these sinks
and channels serve; pulled transfers, the default: test_mooncake_pull.py."""
from pdtest.triton_env import DEVICE, needs_triton  # first: before the kernels

import asyncio
import ctypes
import logging
import random
import sys

import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport import kv_cipher, kv_mac
from deepseek_pd.workers.transport.base import TransportConfig
from deepseek_pd.workers.transport.internal_auth import InternalAuth
from deepseek_pd.workers.transport.mooncake import MooncakeReceiver, MooncakeSender
from pdtest import chacha20_reference, mooncake_stub
from test_kv_mac import _filled_pool, _random_sends
from test_send_landing import open_reported_transfer


def _keystream(key: bytes, layer: int, page: int, page_bytes: int) -> bytes:
    """The documented keystream of cell (layer, request page), from `cryptography`'s ChaCha20 (its
    16-byte nonce is RFC 8439's block counter, then the 96-bit nonce)."""
    counter = page * -(-page_bytes // 64)
    nonce = counter.to_bytes(4, "little") + layer.to_bytes(4, "little") + bytes(8)
    return Cipher(algorithms.ChaCha20(key, nonce), None).encryptor().update(bytes(page_bytes))


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b))


def _row(buffer: torch.Tensor, row: int) -> bytes:
    return buffer[row].contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _rows(rng: random.Random, num_rows: int, count: int) -> list[int]:
    """`count` distinct rows, partly in consecutive runs (one keystream per run on the CPU)."""
    start = rng.randrange(num_rows - count + 1)
    rows = list(range(start, start + count)) if rng.random() < 0.5 else rng.sample(range(num_rows), count)
    return rows


def _kernel_copy(key: bytes, row_bytes: int, src, src_rows, dst, dst_rows, layer: int, first: int) -> None:
    """The Triton kernel itself (on the CPU `CellCipher` takes `cryptography`'s path)."""
    from deepseek_pd.workers.transport.kv_cipher_kernel import chacha20_copy_rows

    rows = torch.tensor([src_rows, dst_rows], dtype=torch.int64, device=src.device)
    words = torch.frombuffer(bytearray(key), dtype=torch.int32).to(src.device)
    chacha20_copy_rows(src, rows[0], dst, rows[1], words, layer, first)


def _cell_cipher_copy(key: bytes, row_bytes: int, src, src_rows, dst, dst_rows, layer: int, first: int) -> None:
    kv_cipher.CellCipher(key, row_bytes, src.device).copy(src, src_rows, dst, dst_rows, layer, first)


def _check_copy(rng: random.Random, rows: int, row_bytes: int, device: str, copy=_cell_cipher_copy) -> None:
    src = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(
        rng.randrange(1 << 30))).to(device)
    dst = torch.zeros_like(src)
    count = rng.randrange(1, rows // 2 + 1)
    src_rows, dst_rows = _rows(rng, rows, count), _rows(rng, rows, count)
    key, layer, first = rng.randbytes(32), rng.randrange(64), rng.randrange(1 << 12)
    copy(key, row_bytes, src, src_rows, dst, dst_rows, layer, first)
    for i, (s, d) in enumerate(zip(src_rows, dst_rows)):
        assert _row(dst, d) == _xor(_row(src, s), _keystream(key, layer, first + i, row_bytes)), (row_bytes, i)
    untouched = [row for row in range(rows) if row not in dst_rows]
    assert not dst[untouched].any()


def test_each_cell_meets_its_documented_keystream_on_the_cpu(monkeypatch):
    """Pages of whole blocks and not, runs cut into pieces (a small piece size here), any rows."""
    rng = random.Random()
    monkeypatch.setattr(kv_cipher, "PIECE_BYTES", 64 * rng.randrange(1, 4))
    for row_bytes in (64 * rng.randrange(1, 40), 4 * rng.randrange(1, 200), 1152):
        _check_copy(rng, rng.randrange(2, 12), row_bytes, "cpu")


@needs_triton
def test_the_triton_kernel_meets_the_same_keystream():
    """A page over two programs (BLOCKS blocks each), its last block partial (the tail words masked).
    One row: the interpreter is slow."""
    from deepseek_pd.workers.transport.kv_cipher_kernel import BLOCKS

    rng = random.Random()
    _check_copy(rng, 2, 64 * BLOCKS + 4 * rng.randrange(1, 16), DEVICE, _kernel_copy)


def test_the_numpy_reference_is_chacha20():
    """The GPU test's oracle (no `cryptography` on the GPU image) against `cryptography`'s, and RFC
    8439's section 2.4.2 test vector (its first block)."""
    rng = random.Random()
    key, nonce, counter, blocks = rng.randbytes(32), rng.randbytes(12), rng.randrange(1 << 31), rng.randrange(1, 9)
    want = Cipher(algorithms.ChaCha20(key, counter.to_bytes(4, "little") + nonce), None).encryptor().update(
        bytes(64 * blocks))
    assert chacha20_reference.keystream(key, nonce, counter, blocks) == want
    rfc = chacha20_reference.keystream(bytes(range(32)), bytes.fromhex("000000000000004a00000000"), 1, 1)
    plain = b"Ladies and Gentlemen of the class of '99: If I could offer you o"
    assert _xor(plain, rfc).hex() == ("6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
                                      "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8")


def test_a_cpu_mooncake_worker_without_cryptography_refuses_to_start(monkeypatch):
    mooncake_stub.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers", None)  # (import fails)
    pool = _filled_pool(random.Random(), 4)
    for side in (MooncakeSender, MooncakeReceiver):
        with pytest.raises(UserError, match="deepseek-pd\\[serve\\]"):
            side(pool, TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write"))


def test_keystream_positions_never_wrap():
    kv_cipher.check_positions(1152, (1 << 32) // 18)
    with pytest.raises(ValueError, match="2\\^32 blocks"):
        kv_cipher.check_positions(1152, (1 << 32) // 18 + 1)


def test_the_cipher_key_is_the_mac_keys_derivation_under_its_own_label():
    auth, other = InternalAuth(secret=b"a" * 32), InternalAuth(secret=b"b" * 32)
    nonce = bytes(range(16))
    key = auth.kv_cipher_key(7, nonce)
    assert len(key) == kv_cipher.KEY_BYTES
    assert key not in (auth.kv_key(7, nonce), other.kv_cipher_key(7, nonce), auth.kv_cipher_key(8, nonce),
                       auth.kv_cipher_key(7, bytes(16)))
    assert InternalAuth.insecure().kv_cipher_key(7, nonce) is None


def test_negotiation_picks_what_decode_offers_and_refuses_a_disagreement(caplog):
    assert kv_cipher.choose([]) == ""  # an older decode worker: in the clear
    assert kv_cipher.choose(["aes-someday", kv_cipher.ALGORITHM]) == kv_cipher.ALGORITHM
    with pytest.raises(ValueError, match="aes-someday"):
        kv_cipher.choose(["aes-someday"])
    offered = list(kv_cipher.algorithms())
    assert kv_cipher.agreed(offered, kv_cipher.ALGORITHM, secured=True) == kv_cipher.ALGORITHM
    with pytest.raises(ValueError, match="decode offered"):
        kv_cipher.agreed(offered, "aes-someday", secured=True)
    with pytest.raises(ValueError, match="decode offered"):
        kv_cipher.agreed([], kv_cipher.ALGORITHM, secured=True)
    kv_cipher._warned_clear = False
    with caplog.at_level(logging.WARNING):
        assert kv_cipher.agreed(offered, "", secured=True) == ""  # an older prefill worker: warned, once
        assert kv_cipher.agreed(offered, "", secured=True) == ""
    assert sum("in the clear" in record.message for record in caplog.records) == 1


def _moving_bytes(monkeypatch) -> list[list[bytes]]:
    """Makes the stub engine write for real (both pools are in this process) and keep, per write,
    the bytes it read at its local addresses."""
    read: list[list[bytes]] = []

    def write(self, session, local, remote, lengths):
        read.append([ctypes.string_at(addr, length) for addr, length in zip(local, lengths)])
        for src, dst, length in zip(local, remote, lengths):
            ctypes.memmove(dst, src, length)
        self.writes.append((session, list(local), list(remote), list(lengths)))
        return 0
    monkeypatch.setattr(mooncake_stub.StubTransferEngine, "batch_transfer_sync_write", write)
    return read


def test_a_transfer_moves_only_ciphertext_and_lands_the_kv(monkeypatch):
    rng = random.Random()
    mooncake_stub.install(monkeypatch)
    read = _moving_bytes(monkeypatch)
    src = _filled_pool(rng, 24)
    dst = KVPool(src.num_layers, 24, src.page_size, src.kv_dim, dtype=src.dtype)
    config = TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write", mooncake_protocol=rng.choice(["tcp", "rdma"]))
    sender, receiver = MooncakeSender(src, config), MooncakeReceiver(dst, config)
    count = rng.randrange(2, 8)
    src_pages, dst_pages = rng.sample(range(24), count), rng.sample(range(24), count)
    handshake, sink, slots, channel, reports = open_reported_transfer(sender, receiver, dst, dst_pages,
                                                                      count * src.page_size)
    assert list(handshake.mooncake.kv_cipher_algorithms) == [kv_cipher.ALGORITHM]
    room, mac_key, key = rng.randrange(1 << 40), rng.randbytes(32), rng.randbytes(32)
    for side in (channel, sink):  # as KVPush and the bootstrap client do, before any KV moves
        side.begin_cipher(kv_cipher.ALGORITHM, key)
    channel.begin_seal(mac_key, room)
    sink.begin_check(mac_key, room, kv_mac.algorithms()[0])
    for layers, first, end in _random_sends(rng, src.num_layers, count):
        asyncio.run(channel.send(src_pages[first:end], first, layers.start, layers.stop))
    page_bytes = src.bytes_per_page
    plain = {(layer, i): _row(src.buffers[layer], page) for layer in range(src.num_layers)
             for i, page in enumerate(src_pages)}
    cipher = {cell: _xor(text, _keystream(key, cell[0], cell[1], page_bytes)) for cell, text in plain.items()}
    # What the prefill side wrote from (its send staging) and what waits in decode's slots: ciphertext.
    sent = {piece[j:j + page_bytes] for pieces in read for piece in pieces for j in range(0, len(piece), page_bytes)}
    assert sent == set(cipher.values()) and sent.isdisjoint(plain.values())
    for (layer, i), text in cipher.items():
        assert _row(receiver.staging.buffers[layer], slots[i]) == text
    if rng.random() < 0.5:  # a stranger's bit in a slot before it lands: the MAC, over the plaintext, refuses
        layer, i = rng.randrange(src.num_layers), rng.randrange(count)
        receiver.staging.buffers[layer].view(-1).view(torch.uint8)[slots[i] * page_bytes + rng.randrange(page_bytes)] ^= 1
        spoiled = True
    else:
        spoiled = False
    rng.shuffle(reports)
    for report in reports:
        sink.on_chunk(report)
    done = pb.TransferDone(num_pages=count, bytes_sent=channel.bytes_sent)
    sink.check_complete(done)
    sink.land()
    channel.seal(done, mac_key, room)
    if spoiled:
        with pytest.raises(TransferError, match="does not match the MAC"):
            sink.check_sealed(done, mac_key, room)
        return
    sink.check_sealed(done, mac_key, room)
    for layer in range(src.num_layers):
        assert torch.equal(dst.buffers[layer][dst_pages], src.buffers[layer][src_pages])
    assert not any(buffer.any() for buffer in receiver.staging.buffers)  # the slots go back zeroed


@needs_triton
def test_the_cuda_path_copies_its_key_and_rows_only_through_upload():
    """`CellCipher`'s CUDA path (run here on the kernel's device, the CPU under the interpreter)
    puts the key and the row lists on the device through `model/host_copy.upload` (page-locked on
    CUDA; a pageable copy waits in the driver's shared staging behind the queued forward:
    tests/workers/engine/test_step_host_copies.py), still meets the keystream, and uploads the
    rows again only for other rows. Failed before: `.to(device)` of both."""
    from pdtest.host_uploads import DirectUploads

    rng = random.Random()
    row_bytes = 4 * rng.randrange(1, 32)

    def cuda_path(key, row_bytes, src, src_rows, dst, dst_rows, layer, first):
        cipher = kv_cipher.CellCipher(key, row_bytes, src.device)
        with DirectUploads() as mode:
            cipher._copy_cuda(src, list(src_rows), dst, list(dst_rows), layer, first)
            cipher._copy_cuda(src, list(src_rows), dst, list(dst_rows), layer, first)  # the same rows: cached
        assert mode.records == [] and mode.uploads == 2
        cipher._copy_cuda(src, list(src_rows), dst, list(dst_rows), layer, first)  # back to one XOR

    _check_copy(rng, rng.randrange(2, 6), row_bytes, DEVICE, cuda_path)
