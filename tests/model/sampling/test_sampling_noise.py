"""The counter-based noise of seeded sampling against plain-Python integers (its definition), on
fresh random seeds, steps and tokens; identical on CUDA; uniform enough for Gumbel-max."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.sampling.noise import (GAMMA, counter_uniforms, mix64_, mix64_int, reference_uniform,
                                              seed_key, token_offsets)

pytestmark = pytest.mark.timeout(120)


def test_mix64_is_splitmix64():
    # SplitMix64 from state 0 (Steele et al.'s reference generator): outputs are mix64(k * GAMMA).
    assert [mix64_int(GAMMA * k) for k in (1, 2, 3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                                                         0x06C45D188009454F]
    rng = random.Random()
    words = [rng.randrange(2**64) for _ in range(2000)] + [0, 2**63 - 1, 2**63, 2**64 - 1]
    signed = torch.tensor([w - 2**64 if w >= 2**63 else w for w in words], dtype=torch.int64)
    got = [w % 2**64 for w in mix64_(signed).tolist()]
    assert got == [mix64_int(w) for w in words]


def _uniforms(seeds: list[int], steps: list[int], vocab: int, device: str) -> torch.Tensor:
    keys = torch.tensor([seed_key(s) for s in seeds], dtype=torch.int64, device=device)
    return counter_uniforms(keys, torch.tensor(steps, dtype=torch.int64, device=device),
                            token_offsets(vocab, device))


def test_tensor_uniforms_equal_the_python_definition():
    rng = random.Random()
    seeds = [rng.randrange(-2**63, 2**64) for _ in range(6)] + [0, -1, 2**64 - 1]
    steps = [rng.randrange(10**6) for _ in seeds]
    vocab = 300
    got = _uniforms(seeds, steps, vocab, "cpu")
    want = torch.tensor([[reference_uniform(s, t, v) for v in range(vocab)] for s, t in zip(seeds, steps)])
    assert got.dtype == torch.float32 and torch.equal(got, want)  # bit for bit


def test_uniforms_are_open_interval_and_uniform():
    rng = random.Random()
    seeds = [rng.randrange(2**64) for _ in range(64)]
    u = _uniforms(seeds, [rng.randrange(1000) for _ in seeds], 4096, "cpu").double()
    assert u.min() > 0 and u.max() < 1
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    histogram = torch.histc(u, bins=16, min=0, max=1)
    assert (histogram - n / 16).abs().max() < 5 * (n / 16) ** 0.5
    # neighbouring tokens and steps of one seed are uncorrelated
    row = _uniforms([seeds[0]] * 2, [5, 6], 4096, "cpu").double()
    for a, b in ((row[0, :-1], row[0, 1:]), (row[0], row[1])):
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(corr) < 5 / 4096 ** 0.5


def test_seed_and_step_both_change_the_noise():
    rng = random.Random()
    seed, step = rng.randrange(2**63), rng.randrange(1000)
    base = _uniforms([seed], [step], 256, "cpu")
    assert not torch.equal(base, _uniforms([seed + 1], [step], 256, "cpu"))
    assert not torch.equal(base, _uniforms([seed], [step + 1], 256, "cpu"))
    # negative seeds are their 64-bit two's complement, as torch.Generator reads them
    assert torch.equal(_uniforms([-5], [step], 256, "cpu"), _uniforms([2**64 - 5], [step], 256, "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_uniforms_equal_cpu_bit_for_bit():
    rng = random.Random()
    seeds = [rng.randrange(-2**63, 2**64) for _ in range(32)]
    steps = [rng.randrange(10**6) for _ in seeds]
    assert torch.equal(_uniforms(seeds, steps, 102400, "cuda").cpu(), _uniforms(seeds, steps, 102400, "cpu"))
