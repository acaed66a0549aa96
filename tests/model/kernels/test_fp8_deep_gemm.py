"""The optional DeepGEMM FP8 backends (`model/kernels/fp8_deep_gemm.py`): refused clearly where
DeepGEMM does not run; on a Hopper GPU with `deep_gemm` installed (marker `gpu`), the dense GEMM and
the grouped MoE against the torch references at V3's shapes, outputs copied over NaN."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.kernels.fp8_deep_gemm import deep_gemm_available, fits
from deepseek_pd.model.moe.deep_gemm_experts import DeepGemmMoEKernel
from deepseek_pd.model.moe.experts import MOE_BACKENDS
from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig, quantize_block_fp8
from deepseek_pd.model.quant.fp8_linear import DeepGemmFp8Gemm, FP8_GEMM_BACKENDS
from deepseek_pd.model.quant.moe_scales import Fp8ExpertScales

requires_deep_gemm = pytest.mark.skipif(not deep_gemm_available(), reason="needs deep_gemm and a Hopper GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten row?)"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@pytest.mark.skipif(deep_gemm_available(), reason="DeepGEMM runs here")
def test_deep_gemm_backends_are_user_errors_where_it_does_not_run():
    for backend in (DeepGemmFp8Gemm, DeepGemmMoEKernel):
        with pytest.raises(UserError, match="deep_gemm"):
            backend()


def test_only_whole_128_blocks_go_to_deep_gemm():
    assert fits(2112, 7168, 128, 128) and fits(576, 2048, 128, 128)
    assert not fits(2112, 7168, 64, 128) and not fits(96, 200, 128, 128) and not fits(100, 128, 128, 128)


def _weight(n: int, k: int, lead: int | None = None):
    block = Fp8BlockQuantConfig(128, 128)
    if lead is None:
        return [t.cuda() for t in quantize_block_fp8(torch.randn(n, k) * 0.02, block)]
    pairs = [quantize_block_fp8(torch.randn(n, k) * 0.02, block) for _ in range(lead)]
    return torch.stack([p[0] for p in pairs]).cuda(), torch.stack([p[1] for p in pairs]).cuda()


@pytest.mark.gpu
@requires_deep_gemm
@pytest.mark.parametrize("n,k", [(2112, 7168), (7168, 2048), (576, 2048)])
def test_deep_gemm_dense_matches_the_fp8_reference(n, k):
    w, s = _weight(n, k)
    ref, gemm = FP8_GEMM_BACKENDS.build("torch"), FP8_GEMM_BACKENDS.build("deep_gemm")
    for m in (1, random.randint(2, 300), 4096):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        out.copy_(gemm(x, w, s, 128, 128))
        assert rel_err(out, ref(x, w, s, 128, 128)) < 1e-2, (m, n, k)


@pytest.mark.gpu
@requires_deep_gemm
@pytest.mark.parametrize("tokens", [1, 100, 3000])
def test_deep_gemm_grouped_moe_matches_the_torch_reference(tokens):
    experts, k, hidden, inter = 17, 8, 2048, 1408
    w13, s13 = _weight(2 * inter, hidden, experts)
    w2, s2 = _weight(hidden, inter, experts)
    scales = Fp8ExpertScales(s13, Fp8BlockQuantConfig(128, 128), s2, Fp8BlockQuantConfig(128, 128))
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda").topk(k, dim=1).indices
    ids[0, 0] = experts + 1  # another EP rank's expert
    weights = torch.rand(tokens, k, device="cuda")
    ref = MOE_BACKENDS.build("torch")(x, ids, weights, w13, w2, scales)
    out = torch.full_like(ref, float("nan"))
    out.copy_(MOE_BACKENDS.build("deep_gemm")(x, ids, weights, w13, w2, scales))
    # The SiLU-mul intermediate is re-quantised from bf16 here, from fp32 in the reference.
    assert rel_err(out, ref) < 3e-2
