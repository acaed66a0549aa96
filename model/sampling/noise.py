"""Counter-based noise for seeded sampling: a pure function of (seed, step, token id).

A seeded request's draw at step `t` is Gumbel-max with the uniforms `u(seed, t, v)` for every token
id `v`, so its tokens depend on nothing but its own seed and step: not on the batch, its order, or
which worker (prefill or decode) samples that step. The function is built from SplitMix64's
finaliser `mix64` (Steele, Lea, Flood 2014), all arithmetic modulo 2**64:

    s0 = mix64(seed mod 2**64)                 once per request, on the host (`seed_key`)
    s1 = mix64(s0 + (step + 1) * GAMMA)        per row and step, on the device
    x  = mix64(s1 + (v + 1) * GAMMA)           per token, on the device
    u  = (2 * ((x >>> 41) ^ 2**22) + 1) / 2**24   23 bits, in [2**-24, 1 - 2**-24]: never 0 or 1

Tensors hold these 64-bit words as int64: multiplication wraps modulo 2**64 on CPU and CUDA alike,
and a logical right shift is the arithmetic one masked, so the bits are identical on every device
(the tests check them against `reference_uniform`, plain Python integers). Worked example:
`reference_uniform(seed=1, step=0, token=0)` is the first uniform of request seed 1's first token.
In tensors, `(x >> 41) + 2**22` (an arithmetic shift) equals `(x >>> 41) ^ 2**22`, which saves a mask.
"""
from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 / golden ratio, odd)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(word: int) -> int:
    """The int64 whose bits are the unsigned 64-bit `word`."""
    word &= MASK64
    return word - (1 << 64) if word >= 1 << 63 else word


_GAMMA_S, _M1_S, _M2_S = _signed(GAMMA), _signed(_M1), _signed(_M2)


def mix64_int(word: int) -> int:
    """SplitMix64's finaliser on a Python int (unsigned 64-bit result)."""
    word &= MASK64
    word = ((word ^ (word >> 30)) * _M1) & MASK64
    word = ((word ^ (word >> 27)) * _M2) & MASK64
    return word ^ (word >> 31)


def mix64_(words: torch.Tensor) -> torch.Tensor:
    """`mix64_int` in place on an int64 tensor (its bits read as unsigned words); returns it."""
    words.bitwise_xor_((words >> 30).bitwise_and_((1 << 34) - 1))  # masked: a logical shift
    words.mul_(_M1_S)
    words.bitwise_xor_((words >> 27).bitwise_and_((1 << 37) - 1))
    words.mul_(_M2_S)
    words.bitwise_xor_((words >> 31).bitwise_and_((1 << 33) - 1))
    return words


def seed_key(seed: int) -> int:
    """`s0` of the module docstring as an int64 (any seed that `SamplingParams.validate` accepts)."""
    return _signed(mix64_int(seed))


def token_offsets(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """`(v + 1) * GAMMA` for every token id, int64 `[V]`: computed once per batch."""
    return (torch.arange(vocab_size, dtype=torch.int64, device=device) + 1).mul_(_GAMMA_S)


def counter_uniforms(keys: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Uniforms `[B, V]` fp32 for rows with seed keys `keys` `[B]` at steps `steps` `[B]` (int64)."""
    row = mix64_(keys + (steps + 1) * _GAMMA_S)
    words = mix64_(row.unsqueeze(1) + offsets.unsqueeze(0))
    high = (words >> 41).to(torch.float32)  # exact: |high| < 2**22
    # (high + 2**22) * 2**-23 + 2**-24: every step is exact in fp32 (at most 24 significant bits).
    return high.mul_(2.0 ** -23).add_(0.5 + 2.0 ** -24)


def reference_uniform(seed: int, step: int, token: int) -> float:
    """The uniform of the module docstring, in plain Python: the oracle for the tensor version."""
    row = mix64_int(mix64_int(seed) + (step + 1) * GAMMA)
    word = mix64_int(row + (token + 1) * GAMMA)
    return (2 * ((word >> 41) ^ (1 << 22)) + 1) / 2.0 ** 24
