"""MoE backends for `--deterministic`: "torch_invariant" and "triton_invariant".

A token's result is `sum_j w_j * expert_{id_j}(x)`; what may follow the batch is each expert's GEMM
(its row count is how many tokens chose that expert) and the order of the k-term sum. Here the GEMMs
reduce each row in an order of its own (`batch_invariant.linear`; the fused kernel's one tile) and
the k terms are added in a fixed order per token (torch: expert-id order, one `index_add_` per
expert; Triton: slot order). `RunnerConfig` picks them for the "torch"/"triton" backends when
`deterministic` is set on CUDA (`invariant_kernels`; off CUDA each sequence runs alone instead: the
CPU's SIMD-tail SiLU would make "torch_invariant" depend on a row's place in its expert's group).
"""
from __future__ import annotations

import torch

from deepseek_pd.model import batch_invariant
from deepseek_pd.model.kernels.checks import require_triton
from deepseek_pd.model.moe.experts import MOE_BACKENDS, TorchMoEKernel


@MOE_BACKENDS.register("torch_invariant")
class InvariantTorchMoEKernel(TorchMoEKernel):
    linear = staticmethod(batch_invariant.linear)
    supports_fp8 = False  # its FP8 products would not be the batch-invariant ones


@MOE_BACKENDS.register("triton_invariant")
class InvariantTritonMoEKernel:
    cuda_graph_safe = True  # as "triton": no host sync

    def __init__(self) -> None:
        require_triton("MoE backend 'triton_invariant'")
        from deepseek_pd.model.kernels.fused_moe import fused_moe

        self._fused_moe = fused_moe

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, scales: None = None) -> torch.Tensor:
        return self._fused_moe(hidden, topk_ids, topk_weights, w13, w2, invariant=True)
