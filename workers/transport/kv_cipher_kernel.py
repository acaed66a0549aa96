"""ChaCha20 (RFC 8439) over rows of KV pages on the GPU, as a Triton kernel, and its thin wrapper.

The construction (which keystream byte meets which KV byte) is kv_cipher.py's; PyPI `cryptography`
is the oracle (tests/workers/transport/test_kv_cipher.py under TRITON_INTERPRET=1,
test_kv_cipher_cuda.py on a GPU). One program takes `BLOCKS` 64-byte blocks of one row: it computes
their keystream (16 uint32 words each, ARX only), loads the row's words, XORs and stores them into
the destination row: the copy and the cipher in one pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# ChaCha20 blocks (64 bytes) per program: one per thread of its 4 warps, each holding its block's
# 16-word state in registers (a V2-Lite page of 16 tokens is 288 blocks: 3 programs).
BLOCKS = 128
NUM_WARPS = 4


@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def _quarter(a, b, c, d):
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _xor_word(src, dst, word, mask, stream):
    data = tl.load(src + word, mask=mask, other=0).to(tl.uint32, bitcast=True)
    tl.store(dst + word, (data ^ stream).to(tl.int32, bitcast=True), mask=mask)


# Triton makes an integer argument equal to 1 a compile-time constant (a Python int without `.to`):
# layer 1 failed to compile on the GPU (H100, 2026-12-07); the interpreter does not specialise.
@triton.jit(do_not_specialize=["layer", "first_page"])
def _chacha20_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, key_ptr, layer, first_page,
                          row_words, blocks_per_page, BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    src = src_ptr + tl.load(src_rows_ptr + row) * row_words
    dst = dst_ptr + tl.load(dst_rows_ptr + row) * row_words
    zero = tl.zeros([BLOCKS], dtype=tl.uint32)
    # The state of RFC 8439 2.3: constants, key, block counter, nonce (layer, 0, 0).
    i0 = zero + 0x61707865
    i1 = zero + 0x3320646E
    i2 = zero + 0x79622D32
    i3 = zero + 0x6B206574
    i4 = zero + tl.load(key_ptr + 0).to(tl.uint32, bitcast=True)
    i5 = zero + tl.load(key_ptr + 1).to(tl.uint32, bitcast=True)
    i6 = zero + tl.load(key_ptr + 2).to(tl.uint32, bitcast=True)
    i7 = zero + tl.load(key_ptr + 3).to(tl.uint32, bitcast=True)
    i8 = zero + tl.load(key_ptr + 4).to(tl.uint32, bitcast=True)
    i9 = zero + tl.load(key_ptr + 5).to(tl.uint32, bitcast=True)
    i10 = zero + tl.load(key_ptr + 6).to(tl.uint32, bitcast=True)
    i11 = zero + tl.load(key_ptr + 7).to(tl.uint32, bitcast=True)
    i12 = ((first_page + row).to(tl.int64) * blocks_per_page + block).to(tl.uint32)
    i13 = zero + layer.to(tl.uint32)
    i14 = zero
    i15 = zero
    x0, x1, x2, x3, x4, x5, x6, x7 = i0, i1, i2, i3, i4, i5, i6, i7
    x8, x9, x10, x11, x12, x13, x14, x15 = i8, i9, i10, i11, i12, i13, i14, i15
    for _ in range(10):  # 20 rounds: a column round and a diagonal round each
        x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    base = block * 16
    _xor_word(src, dst, base + 0, base + 0 < row_words, x0 + i0)
    _xor_word(src, dst, base + 1, base + 1 < row_words, x1 + i1)
    _xor_word(src, dst, base + 2, base + 2 < row_words, x2 + i2)
    _xor_word(src, dst, base + 3, base + 3 < row_words, x3 + i3)
    _xor_word(src, dst, base + 4, base + 4 < row_words, x4 + i4)
    _xor_word(src, dst, base + 5, base + 5 < row_words, x5 + i5)
    _xor_word(src, dst, base + 6, base + 6 < row_words, x6 + i6)
    _xor_word(src, dst, base + 7, base + 7 < row_words, x7 + i7)
    _xor_word(src, dst, base + 8, base + 8 < row_words, x8 + i8)
    _xor_word(src, dst, base + 9, base + 9 < row_words, x9 + i9)
    _xor_word(src, dst, base + 10, base + 10 < row_words, x10 + i10)
    _xor_word(src, dst, base + 11, base + 11 < row_words, x11 + i11)
    _xor_word(src, dst, base + 12, base + 12 < row_words, x12 + i12)
    _xor_word(src, dst, base + 13, base + 13 < row_words, x13 + i13)
    _xor_word(src, dst, base + 14, base + 14 < row_words, x14 + i14)
    _xor_word(src, dst, base + 15, base + 15 < row_words, x15 + i15)


def _words(buffer: torch.Tensor, name: str) -> torch.Tensor:
    """A layer buffer `[rows, ...]` as int32 words `[rows, row words]`, no copy."""
    if not buffer.is_contiguous():
        raise ValueError(f"{name}: a KV layer buffer must be contiguous, got strides {buffer.stride()}")
    flat = buffer.view(buffer.shape[0], -1).view(torch.uint8)
    if flat.shape[1] % 4:
        raise ValueError(f"{name}: rows of {flat.shape[1]} bytes; the kernel takes whole 4-byte words")
    return flat.view(torch.int32)


def chacha20_copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor,
                       key: torch.Tensor, layer: int, first_page: int) -> None:
    """`dst[dst_rows[i]] = src[src_rows[i]] ^ keystream(key, layer, first_page + i)` (kv_cipher.py's
    construction), queued on the current stream. `key`: 8 int32 words on the device; rows: int64
    on the device; both buffers' rows the same number of bytes."""
    src_words, dst_words = _words(src, "src"), _words(dst, "dst")
    if src_words.shape[1] != dst_words.shape[1]:
        raise ValueError(f"rows of {src_words.shape[1]} and {dst_words.shape[1]} words differ")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError(f"row lists of shapes {tuple(src_rows.shape)} and {tuple(dst_rows.shape)}")
    if key.numel() != 8 or key.dtype != torch.int32:
        raise ValueError(f"the key is 8 int32 words, got {key.numel()} of {key.dtype}")
    for name, t in (("src", src), ("dst", dst), ("src_rows", src_rows), ("dst_rows", dst_rows), ("key", key)):
        if t.device != src.device:
            raise ValueError(f"{name} is on {t.device}, the source on {src.device}")
    rows = src_rows.numel()
    if not rows:
        return
    row_words = src_words.shape[1]
    blocks_per_page = -(-row_words // 16)
    grid = (rows, triton.cdiv(blocks_per_page, BLOCKS))
    _chacha20_rows_kernel[grid](src_words, dst_words, src_rows, dst_rows, key, layer, first_page,
                                row_words, blocks_per_page, BLOCKS=BLOCKS, num_warps=NUM_WARPS)
