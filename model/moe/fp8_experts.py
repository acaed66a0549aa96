"""Routed experts with FP8 block-scaled weights kept in FP8, and their kernel registry.

`Fp8FusedExperts` is `FusedExperts` (`experts.py`: same stacking, same fused shared experts, same
contract that ids outside [0, E) contribute nothing) with `w13`/`w2` in e4m3 and fp32
`w13_scale_inv`/`w2_scale_inv`. Its block sizes follow `Fp8Spec.block_for`: w13's rows join gate
and up at `I` (and fused shared slices at multiples of `I`), w2's columns join shared slices at
multiples of `I`.

Kernels ("torch" reference, "triton" = `kernels/fused_moe_fp8.py`) take
`(hidden, topk_ids, topk_weights, w13, w13_scale, block13, w2, w2_scale, block2)`.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
from deepseek_pd.model.quant.fp8_linear import Fp8Spec, fp8_parameter, scale_parameter
from deepseek_pd.model.quant.fp8_ops import block_fp8_matmul_ref, per_token_group_quant_ref
from deepseek_pd.model.registry import Registry


class Fp8MoEKernel(Protocol):
    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w13_scale: torch.Tensor, block13: Fp8BlockQuantConfig,
                 w2: torch.Tensor, w2_scale: torch.Tensor, block2: Fp8BlockQuantConfig) -> torch.Tensor:
        """hidden `[N, H]`, topk `[N, k]` → `[N, H]` in hidden's dtype."""


FP8_MOE_BACKENDS: Registry[Fp8MoEKernel] = Registry("FP8 MoE backend")


@FP8_MOE_BACKENDS.register("torch")
class TorchFp8MoEKernel:
    """Reference: per expert hit, quantise its tokens' activations per group as the kernel does,
    dequantise, multiply in fp32; the SiLU-mul output is rounded to the model dtype before the
    down projection's quantisation, as the kernel stores it. One host sync (per-expert counts)."""

    cuda_graph_safe = False

    def __call__(self, hidden, topk_ids, topk_weights, w13, w13_scale, block13, w2, w2_scale, block2):
        num_experts = w13.shape[0]
        num_tokens, top_k = topk_ids.shape
        out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        if num_tokens == 0:
            return out.to(hidden.dtype)
        x_fp8, x_scale = per_token_group_quant_ref(hidden, block13.block_in)  # per token: shared by experts
        flat = topk_ids.reshape(-1)
        flat = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
        flat_weights = topk_weights.reshape(-1).float()
        token_of = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts + 1).tolist()
        start = 0
        for expert, count in enumerate(counts[:num_experts]):
            if count:
                pairs = order[start:start + count]
                tokens = token_of[pairs]
                gate_up = block_fp8_matmul_ref(x_fp8[tokens], x_scale[tokens], w13[expert], w13_scale[expert],
                                               block13.block_out, block13.block_in, torch.float32)
                gate, up = gate_up.chunk(2, dim=-1)
                act = (F.silu(gate) * up).to(hidden.dtype)
                a_fp8, a_scale = per_token_group_quant_ref(act, block2.block_in)
                y = block_fp8_matmul_ref(a_fp8, a_scale, w2[expert], w2_scale[expert], block2.block_out,
                                         block2.block_in, torch.float32)
                out.index_add_(0, tokens, y * flat_weights[pairs, None])
            start += count
        return out.to(hidden.dtype)


@FP8_MOE_BACKENDS.register("triton")
class TritonFp8MoEKernel:
    cuda_graph_safe = True  # no host sync

    def __init__(self) -> None:
        from deepseek_pd.model.kernels.checks import require_triton

        require_triton("FP8 MoE backend 'triton'")
        from deepseek_pd.model.kernels.fused_moe_fp8 import fused_moe_fp8

        self._fused = fused_moe_fp8

    def __call__(self, hidden, topk_ids, topk_weights, w13, w13_scale, block13, w2, w2_scale, block2):
        return self._fused(hidden, topk_ids, topk_weights, w13, w13_scale, block13, w2, w2_scale, block2)


class Fp8FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, spec: Fp8Spec,
                 device: torch.device | str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.block13 = spec.block_for(row_splits=(intermediate_size,))
        self.block2 = spec.block_for(col_splits=(intermediate_size,))
        self.w13 = fp8_parameter((num_experts, 2 * intermediate_size, hidden_size), device)
        self.w13_scale_inv = scale_parameter(tuple(self.w13.shape), self.block13, device)
        self.w2 = fp8_parameter((num_experts, hidden_size, intermediate_size), device)
        self.w2_scale_inv = scale_parameter(tuple(self.w2.shape), self.block2, device)
        self.kernel: Fp8MoEKernel = FP8_MOE_BACKENDS.build(spec.backend)

    def fp8_param_blocks(self) -> dict[str, Fp8BlockQuantConfig]:
        return {"w13": self.block13, "w2": self.block2}

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.kernel(hidden, topk_ids, topk_weights, self.w13, self.w13_scale_inv, self.block13,
                           self.w2, self.w2_scale_inv, self.block2)
