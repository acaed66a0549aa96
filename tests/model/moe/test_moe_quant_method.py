"""The routed experts' quantisation method (`model/moe/quant_method.py`): the parameters each method
makes, the kernels that take FP8 experts, and FP8 experts through `FusedExperts` against a per-token
loop written here (quantise, dequantise, multiply in fp32)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from deepseek_pd.errors import UserError
from deepseek_pd.model.moe import MOE_BACKENDS, FusedExperts
from deepseek_pd.model.moe.quant_method import Fp8BlockMethod, UnquantisedMethod, moe_quant_method
from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig, quantize_block_fp8
from deepseek_pd.model.quant.fp8_linear import Fp8Spec
from deepseek_pd.model.quant.fp8_ops import FP8_DTYPE, dequant_activation, dequant_weight, per_token_group_quant_ref

pytestmark = pytest.mark.timeout(60)


def test_each_method_makes_its_parameters_and_blocks():
    experts, hidden, inter = random.randint(1, 5), 64, random.choice([32, 48, 96])
    plain = FusedExperts(experts, hidden, inter, "torch", moe_quant_method(None, inter, torch.float32, "cpu"))
    assert isinstance(plain.quant, UnquantisedMethod) and plain.fp8_param_blocks() == {}
    assert {n for n, _ in plain.named_parameters()} == {"w13", "w2"} and plain.w13.dtype == torch.float32

    spec = Fp8Spec(Fp8BlockQuantConfig(128, 128), "torch")
    fp8 = FusedExperts(experts, hidden, inter, "torch", moe_quant_method(spec, inter, torch.bfloat16, "cpu"))
    assert isinstance(fp8.quant, Fp8BlockMethod)
    params = dict(fp8.named_parameters())
    assert set(params) == {"w13", "w13_scale_inv", "w2", "w2_scale_inv"}
    assert params["w13"].dtype == FP8_DTYPE and params["w2"].dtype == FP8_DTYPE
    # gate and up join at I, so w13's row blocks divide I; w2's columns are I wide (fused shared slices).
    want13, want2 = Fp8BlockQuantConfig(128 if inter % 128 == 0 else inter & -inter, 128), \
        Fp8BlockQuantConfig(128, 128 if inter % 128 == 0 else inter & -inter)
    assert fp8.fp8_param_blocks() == {"w13": want13, "w2": want2}
    assert params["w13_scale_inv"].shape == (experts, -(-2 * inter // want13.block_out), -(-hidden // 128))
    assert torch.isnan(params["w2_scale_inv"]).all()  # poisoned until loaded


def test_fp8_experts_refuse_a_kernel_without_fp8():
    spec = Fp8Spec(Fp8BlockQuantConfig(128, 128), "torch")
    plain_only = [n for n in MOE_BACKENDS.names() if not getattr(MOE_BACKENDS.get(n), "supports_fp8", False)]
    assert "torch_invariant" in plain_only and "torch" not in plain_only
    with pytest.raises(UserError, match="does not multiply FP8 experts.*torch"):
        FusedExperts(2, 64, 32, "torch_invariant", moe_quant_method(spec, 32, torch.float32, "cpu"))


def test_fp8_experts_match_a_per_token_loop():
    experts, k, hidden, inter, tokens = 4, 2, 64, 32, random.randint(1, 9)
    block = Fp8BlockQuantConfig(32, 32)
    module = FusedExperts(experts, hidden, inter, "torch", Fp8BlockMethod(Fp8Spec(block, "torch"), inter, "cpu"))
    with torch.no_grad():
        for e in range(experts):
            module.w13[e], module.w13_scale_inv[e] = quantize_block_fp8(torch.randn(2 * inter, hidden), block)
            module.w2[e], module.w2_scale_inv[e] = quantize_block_fp8(torch.randn(hidden, inter), block)
    x = torch.randn(tokens, hidden)
    ids = torch.rand(tokens, experts).topk(k, dim=1).indices
    ids[0, -1] = experts + 3  # another EP rank's expert: contributes nothing
    weights = torch.rand(tokens, k)
    got = module(x, ids, weights)

    def fp8_product(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        q, qs = per_token_group_quant_ref(a[None], 32)
        return dequant_activation(q, qs, 32)[0] @ dequant_weight(w, s, 32, 32).T

    for t in range(tokens):
        want = torch.zeros(hidden)
        for j in range(k):
            e = int(ids[t, j])
            if e >= experts:
                continue
            gate, up = fp8_product(x[t], module.w13[e], module.w13_scale_inv[e]).chunk(2)
            want += weights[t, j] * fp8_product(F.silu(gate) * up, module.w2[e], module.w2_scale_inv[e])
        torch.testing.assert_close(got[t], want, rtol=1e-4, atol=1e-4)
