"""MoE backend "deep_gemm": FP8 experts through DeepGEMM's grouped GEMM (`kernels/fp8_deep_gemm.py`).

Registered only where the `deep_gemm` package is installed, built only where it imports on a
Hopper GPU (a UserError elsewhere), and never chosen by default: `fp8_backend="deep_gemm"` names it
for the experts and the FP8 linear layers together. FP8 experts only. Not yet marked capturable:
DeepGEMM compiles each new shape on first use, and this path has not been run inside CUDA graphs.
"""
from __future__ import annotations

import importlib.util

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.moe.experts import MOE_BACKENDS
from deepseek_pd.model.quant.moe_scales import Fp8ExpertScales


class DeepGemmMoEKernel:
    cuda_graph_safe = False
    supports_fp8 = True
    fp8_only = True

    def __init__(self) -> None:
        from deepseek_pd.model.kernels import fp8_deep_gemm

        if not fp8_deep_gemm.deep_gemm_available():
            raise UserError("MoE backend 'deep_gemm' needs the deep_gemm package built for this torch and a Hopper "
                            "(sm90) GPU; use 'triton'")
        self._grouped = fp8_deep_gemm.grouped_moe

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, scales: Fp8ExpertScales | None = None) -> torch.Tensor:
        if scales is None:
            raise ValueError("MoE backend 'deep_gemm' multiplies FP8 experts only")
        return self._grouped(hidden, topk_ids, topk_weights, w13, w2, scales)


if importlib.util.find_spec("deep_gemm") is not None:
    MOE_BACKENDS.register("deep_gemm")(DeepGemmMoEKernel)
