"""What the FP8 quantisation method adds to a MoE kernel's input: the experts' block scales.

Experts kept in FP8 (DeepSeek-V3's format) are `w13 [E, 2I, H]` and `w2 [E, H, I]` in e4m3, each
with fp32 scales per `(block_out, block_in)` block: `w13_scale [E, ceil(2I/bn1), ceil(H/bk1)]`,
`w2_scale [E, ceil(H/bn2), ceil(I/bk2)]`. A MoE kernel (`model/moe/experts.py`) takes
`scales=None` for experts in the model dtype and an `Fp8ExpertScales` for FP8 ones; activations
are then quantised per token group of the GEMM's `block_in` (`fp8_ops.py`), the SiLU-mul
intermediate rounded to the model dtype first, as the fused kernel stores it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
from deepseek_pd.model.quant.fp8_ops import block_fp8_matmul_ref, per_token_group_quant_ref


@dataclass(frozen=True)
class Fp8ExpertScales:
    w13_scale: torch.Tensor
    block13: Fp8BlockQuantConfig
    w2_scale: torch.Tensor
    block2: Fp8BlockQuantConfig

    def reference_product(self, x: torch.Tensor, weight: torch.Tensor, gemm: int, expert: int) -> torch.Tensor:
        """fp32 `x · weight^T` for one expert's gate_up (`gemm=13`) or down (`gemm=2`) weight, with
        `x` quantised per token group first (the torch reference's arithmetic)."""
        scale, block = (self.w13_scale, self.block13) if gemm == 13 else (self.w2_scale, self.block2)
        x_fp8, x_scale = per_token_group_quant_ref(x, block.block_in)
        return block_fp8_matmul_ref(x_fp8, x_scale, weight, scale[expert], block.block_out, block.block_in,
                                    torch.float32)
