"""FP8 block dequantisation against a slow per-element reference, on fresh random odd shapes."""
from __future__ import annotations

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.quant.fp8 import (Fp8BlockQuantConfig, dequantize_block_fp8, expected_scale_shape,
                                   quantize_block_fp8)

pytestmark = pytest.mark.timeout(60)


def _reference_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block: Fp8BlockQuantConfig) -> torch.Tensor:
    """One block at a time, with explicit index arithmetic: the definition, not a clever reshape."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    rows, cols = weight.shape
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            r0, r1 = bi * block.block_out, min(rows, (bi + 1) * block.block_out)
            c0, c1 = bj * block.block_in, min(cols, (bj + 1) * block.block_in)
            out[r0:r1, c0:c1] = weight[r0:r1, c0:c1].to(torch.float32) * float(scale_inv[bi, bj])
    return out


@pytest.mark.parametrize("block", [(128, 128), (64, 32), (16, 48)])
def test_dequant_matches_reference_on_odd_shapes(block):
    cfg = Fp8BlockQuantConfig(*block)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for _ in range(3):
        rows = int(torch.randint(1, 300, (1,), generator=gen))
        cols = int(torch.randint(1, 300, (1,), generator=gen))
        weight = (torch.randn(rows, cols, generator=gen) * 50).to(torch.float8_e4m3fn)
        scale = torch.rand(*expected_scale_shape((rows, cols), cfg), generator=gen) * 0.01 + 1e-4
        got = dequantize_block_fp8(weight, scale, cfg, dtype=torch.float32)
        torch.testing.assert_close(got, _reference_dequant(weight, scale, cfg), rtol=0, atol=0)


def test_quantise_round_trip_error_is_within_fp8_precision():
    cfg = Fp8BlockQuantConfig(128, 128)
    weight = torch.randn(257, 130) * torch.logspace(-3, 1, 130)  # columns of very different scale
    fp8, scale = quantize_block_fp8(weight, cfg)
    assert fp8.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    restored = dequantize_block_fp8(fp8, scale, cfg, dtype=torch.float32)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values; tiny ones hit the
    # subnormal floor, so bound the absolute error per block by amax * 2^-9 as well.
    block_amax = _reference_dequant(torch.ones_like(weight), scale, cfg) * 448
    assert torch.all((restored - weight).abs() <= weight.abs() / 16 + block_amax * 2**-9)


def test_bf16_output_rounds_once():
    cfg = Fp8BlockQuantConfig(128, 128)
    weight = torch.randn(200, 140).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2) + 0.5
    exact = _reference_dequant(weight, scale, cfg)
    assert torch.equal(dequantize_block_fp8(weight, scale, cfg, dtype=torch.bfloat16), exact.to(torch.bfloat16))


def test_bad_scale_shape_and_config_are_user_errors():
    cfg = Fp8BlockQuantConfig(128, 128)
    weight = torch.zeros(300, 129).to(torch.float8_e4m3fn)
    with pytest.raises(UserError, match=r"weight_scale_inv has shape \(2, 2\), expected \(3, 2\)"):
        dequantize_block_fp8(weight, torch.ones(2, 2), cfg, name="w")
    assert Fp8BlockQuantConfig.from_hf(None) is None
    assert Fp8BlockQuantConfig.from_hf({"quant_method": "fp8", "weight_block_size": [64, 32]}) == Fp8BlockQuantConfig(64, 32)
    with pytest.raises(UserError, match="quant_method='awq'"):
        Fp8BlockQuantConfig.from_hf({"quant_method": "awq"})
    with pytest.raises(UserError, match="weight_block_size"):
        Fp8BlockQuantConfig.from_hf({"quant_method": "fp8"})
