"""MoE backend "triton": the fused Triton grouped GEMMs of `model/kernels/fused_moe.py`, for
experts in the model dtype or in block-scaled FP8 (`scales`).

No host synchronisation per layer (the torch reference syncs once to count tokens per expert), so
decode steps are not bound by host round trips. Same contract as `TorchMoEKernel`: fused shared
experts are ordinary expert ids, ids outside [0, E) (other EP ranks) contribute nothing.
"""
from __future__ import annotations

import torch

from deepseek_pd.model.kernels.checks import require_triton
from deepseek_pd.model.moe.experts import MOE_BACKENDS
from deepseek_pd.model.quant.moe_scales import Fp8ExpertScales


@MOE_BACKENDS.register("triton")
class TritonMoEKernel:
    cuda_graph_safe = True  # no host sync (see the module docstring)
    supports_fp8 = True
    # FusedExperts may send one-token batches to kernels/moe_single_token.py (same products, no sort).
    single_token_path = True

    def __init__(self) -> None:
        require_triton("MoE backend 'triton'")
        from deepseek_pd.model.kernels.fused_moe import fused_moe

        self._fused_moe = fused_moe

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, scales: Fp8ExpertScales | None = None) -> torch.Tensor:
        return self._fused_moe(hidden, topk_ids, topk_weights, w13, w2, scales=scales)
