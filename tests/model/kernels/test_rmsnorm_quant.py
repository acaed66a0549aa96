"""The fused RMSNorm + FP8 group quantisation kernel (`kernels/rmsnorm_quant.py`): bit for bit the
two Triton kernels it fuses, and within e4m3's precision of the torch reference (norm, then
quantise), at seeded random shapes with odd hidden sizes, partial groups, strided rows, with and
without the residual add. On the CPU through Triton's interpreter."""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import DEVICE, HAS_CUDA, needs_triton  # noqa: E402 (first: it sets TRITON_INTERPRET)

from deepseek_pd.model.norm_rope import rms_norm_ref  # noqa: E402
from deepseek_pd.model.quant.fp8_ops import FP8_MAX, dequant_activation, per_token_group_quant_ref  # noqa: E402

DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
          (torch.bfloat16, torch.float32)]  # (x, weight)


def _inputs(x_dtype: torch.dtype, w_dtype: torch.dtype, dim: int, tokens: int, with_residual: bool):
    """x as a column slice of a wider tensor (a row stride past its width, as `q_a` out of the fused
    q_a + kv_a projection), a weight around 1, and a residual or None."""
    wide = (torch.randn(tokens, dim + random.randint(0, 9)) * random.uniform(0.1, 30)).to(x_dtype).to(DEVICE)
    x = wide[:, :dim]
    weight = (1 + 0.3 * torch.randn(dim)).to(w_dtype).to(DEVICE)
    residual = (torch.randn(tokens, dim) * 3).to(x_dtype).to(DEVICE) if with_residual else None
    return x, weight, residual


def _shape() -> tuple[int, int, int]:
    group = random.choice([16, 24, 32, 128])
    dim = random.choice([group * random.randint(1, 12) + random.randint(1, group - 1),  # a partial last group
                         2 * random.randint(8, 200) + 1])  # odd
    return group, dim, random.randint(1, 9)


@needs_triton
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_kernel_is_the_norm_kernel_then_the_quant_kernel_bit_for_bit(x_dtype, w_dtype, with_residual):
    from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
    from deepseek_pd.model.kernels.rmsnorm import rms_norm
    from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant

    for _ in range(3):
        group, dim, tokens = _shape()
        x, weight, residual = _inputs(x_dtype, w_dtype, dim, tokens, with_residual)
        eps = random.choice([1e-6, 1e-5])
        q, scale, res_out = rms_norm_quant(x, weight, eps, group, residual)
        normed, unfused_res = rms_norm(x, weight, eps, residual)
        ref_q, ref_scale = per_token_group_quant(normed, group)
        if HAS_CUDA and x_dtype == torch.float32:
            # On a GPU each kernel's row layout is Triton's choice, so the two reduce an fp32 row's
            # sum of squares in different orders and 1/rms can differ in its last bits; measured on
            # an H100 (2026-12-07): e4m3 bytes equal, scales not. 16-bit rows round that away (bit
            # for bit there, as on the interpreter); fp32 rows agree to the scale's rounding.
            torch.testing.assert_close(scale, ref_scale, rtol=1e-5, atol=0)
            torch.testing.assert_close(dequant_activation(q, scale, group), dequant_activation(ref_q, ref_scale, group),
                                       rtol=0.13, atol=1e-6)  # a byte may round across one e4m3 step (1/8)
        else:
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), (group, dim, tokens)
            assert torch.equal(scale, ref_scale)
        assert (res_out is None) == (residual is None)
        if residual is not None:
            assert torch.equal(res_out, unfused_res)


@needs_triton
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_kernel_matches_the_torch_reference_norm_then_quantise(x_dtype, w_dtype, with_residual):
    from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant

    group, dim, tokens = _shape()
    x, weight, residual = _inputs(x_dtype, w_dtype, dim, tokens, with_residual)
    q, scale, res_out = rms_norm_quant(x, weight, 1e-6, group, residual)
    summed = x
    if residual is not None:
        # One rounding of the fp32 sum to x's dtype (Triton's interpreter may round it the other way).
        torch.testing.assert_close(res_out, x + residual, rtol=2 ** -7, atol=0)
        summed = res_out
    normed = rms_norm_ref(summed, weight, 1e-6)
    ref_q, ref_scale = per_token_group_quant_ref(normed, group)
    # The sums of squares may be added in another order (and 1/sqrt is not rsqrt): the normed row may
    # differ by an ulp at each of its two roundings, so scales agree to two ulps of bf16 (8 bits) and
    # values to one e4m3 step.
    torch.testing.assert_close(scale, ref_scale, rtol=2 ** -6, atol=0)
    got, want = dequant_activation(q, scale, group), dequant_activation(ref_q, ref_scale, group)
    step = ref_scale.repeat_interleave(group, dim=1)[:, :dim] * FP8_MAX / 8  # e4m3's coarsest step in the group
    assert ((got - want).abs() <= step * 1.01).all()
    assert (got - normed.float()).abs().max() <= (step * 1.01).max()


@needs_triton
def test_fused_kernel_refuses_mismatched_inputs():
    from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant

    x = torch.randn(3, 40).to(DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quant(x, torch.ones(41).to(DEVICE), 1e-6, 16)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quant(x, torch.ones(40).to(DEVICE), 1e-6, 16, torch.randn(3, 41).to(DEVICE))
    with pytest.raises(ValueError, match="group"):
        rms_norm_quant(x, torch.ones(40).to(DEVICE), 1e-6, 0)
    q, scale, res = rms_norm_quant(x[:0], torch.ones(40).to(DEVICE), 1e-6, 16)
    assert q.shape == (0, 40) and scale.shape == (0, 3) and res is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("tokens,dim", [(1, 1536), (4096, 7168), (8192, 1536), (333, 2048)])
def test_fused_kernel_gpu_v3_shapes_equal_the_unfused_pair(tokens, dim):
    from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
    from deepseek_pd.model.kernels.rmsnorm import rms_norm
    from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant

    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16) * 4
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(dim, device="cuda")).to(torch.bfloat16)
    for res in (None, residual):
        q, scale, res_out = rms_norm_quant(x, weight, 1e-6, 128, res)
        normed, unfused_res = rms_norm(x, weight, 1e-6, res)
        ref_q, ref_scale = per_token_group_quant(normed, 128)
        # One reduction on the GPU may take another order in the fused kernel: at most one step apart.
        same = (q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean().item()
        assert same > 0.999, same
        torch.testing.assert_close(scale, ref_scale, rtol=2 ** -7, atol=0)
        if res is not None:
            assert torch.equal(res_out, unfused_res)


@needs_triton
def test_fused_kernel_writes_the_same_bits_into_a_packed_buffer():
    """Attention TP gathers the input norm's quantised rows as one uint8 buffer (fp8 bytes, then the
    scales: quant/norm_fp8_linear.py); the kernel writes there through row strides past each part's
    width, the bits it returns into fresh tensors, and nothing outside its part of each row."""
    from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant
    from deepseek_pd.model.quant.norm_fp8_linear import packed_rows, unpacked

    group = random.choice([16, 32, 128])
    dim = 4 * random.randint(5, 100)
    tokens = random.randint(1, 9)
    x = (torch.randn(tokens, dim) * 3).to(DEVICE)
    residual = torch.randn_like(x) if random.random() < 0.5 else None
    weight = (1 + 0.1 * torch.randn(dim)).to(DEVICE)
    want_q, want_scale, want_res = rms_norm_quant(x, weight, 1e-6, group, residual)
    packed = packed_rows(tokens, dim, group, DEVICE)
    packed.fill_(0xA5)  # poison: a byte left unwritten shows
    q, scale, res = rms_norm_quant(x, weight, 1e-6, group, residual, out=unpacked(packed, dim, group))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert (res is None) == (want_res is None) and (res is None or torch.equal(res, want_res))
    parts = unpacked(packed, dim, group)
    assert parts[0].data_ptr() == q.data_ptr() and parts[1].data_ptr() == scale.data_ptr()
    assert torch.equal(packed, torch.cat([want_q.view(torch.uint8), want_scale.view(torch.uint8)], dim=-1))
    with pytest.raises(ValueError, match="out must be"):
        rms_norm_quant(x, weight, 1e-6, group, out=(want_q[:, :-1], want_scale))
    with pytest.raises(ValueError, match="packed"):
        unpacked(packed[:, :-1], dim, group)
