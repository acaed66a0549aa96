"""The CPU finite check by bit patterns (workers/decode/finite_bits.py) against torch.isfinite:
every bit pattern of the 16- and 8-bit formats, boundary and random patterns of the wider ones,
each alone at a random place among finite values of a random page run."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.decode import finite_bits

INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, torch.float64]


def _patterns(dtype: torch.dtype, rng: random.Random) -> list[int]:
    """Every pattern of a format up to 16 bits; else the boundaries around finfo.max, the
    infinities and NaNs of both signs, and random patterns."""
    bits = 8 * dtype.itemsize
    if bits <= 16:
        return list(range(1 << bits))
    sign = 1 << (bits - 1)
    top = finite_bits.first_nonfinite_bits(dtype)
    edges = [0, 1, top - 2, top - 1, top, top + 1, sign - 1]
    edges += [e | sign for e in edges]
    return edges + [rng.getrandbits(bits) for _ in range(4000)]


def _signed(pattern: int, bits: int) -> int:
    return pattern - (1 << bits) if pattern >= 1 << (bits - 1) else pattern


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_bit_pattern_is_judged_as_torch_isfinite_judges_it(dtype):
    rng = random.Random()
    bits = 8 * dtype.itemsize
    patterns = _patterns(dtype, rng)
    values = torch.tensor([_signed(p, bits) for p in patterns], dtype=INT_VIEW[dtype.itemsize]).view(dtype)
    finite = torch.isfinite(values.float() if dtype.itemsize == 1 else values).tolist()
    pool = KVPool(2, 6, 2, 3, dtype=dtype)
    background = torch.empty(pool.buffers[0].shape, dtype=torch.float64).uniform_(-1, 1) * float(torch.finfo(dtype).max)
    for buffer in pool.buffers:
        buffer.copy_(background.to(dtype))  # finite, up to the format's largest values
    pages = rng.sample(range(pool.num_pages), 4)
    assert finite_bits.nonfinite_layers(pool, pages) == []
    flat = [buffer.view(-1) for buffer in pool.buffers]
    slots = pool.page_size * pool.kv_dim
    for index, ok in enumerate(finite):
        layer, page, offset = rng.randrange(2), rng.choice(pages), rng.randrange(slots)
        where = page * slots + offset
        kept = flat[layer][where].clone()
        flat[layer][where] = values[index]
        assert finite_bits.nonfinite_layers(pool, pages) == ([] if ok else [layer]), hex(patterns[index])
        flat[layer][where] = kept


def test_the_largest_finite_values_pass_and_the_infinities_and_nans_fail():
    """Named cases of the production format, readable on their own."""
    pool = KVPool(1, 2, 1, 4, dtype=torch.bfloat16)
    big = torch.finfo(torch.bfloat16).max
    for value, finite in [(big, True), (-big, True), (-0.0, True), (1e-40, True), (float("inf"), False),
                          (float("-inf"), False), (float("nan"), False), (-float("nan"), False)]:
        pool.buffers[0][1, 0, 2] = value
        assert finite_bits.nonfinite_layers(pool, [1]) == ([] if finite else [0]), value
        assert finite_bits.nonfinite_layers(pool, [0]) == []  # another page is not looked at


def test_a_gpu_or_an_unsupported_format_is_refused_clearly():
    with pytest.raises(ValueError, match="bit-pattern finite scan"):
        finite_bits.nonfinite_layers(KVPool(1, 2, 1, 4, dtype=torch.float8_e4m3fnuz), [0])
