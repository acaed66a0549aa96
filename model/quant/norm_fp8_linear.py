"""`linear(norm(x))`, with the norm and the FP8 activation quantisation in one launch where both allow.

Where the linear keeps FP8 weights with a GEMM backend that multiplies quantised activations
(`Fp8Linear.takes_quantised`: "triton", "deep_gemm") and the norm runs the Triton kernels (its ops
have `rms_norm_quant`), `NormThenLinear` runs `kernels/rmsnorm_quant.py` and then the GEMM alone:
two launches where there were three, and the normed row is never written to memory in the model
dtype and read back. Its bytes are those of the unfused kernels (tests/model/quant/
test_norm_fp8_linear.py), so the choice changes no output. Anywhere else it is `linear(norm(x))`.
Chosen once, when the layer is built.

    q = NormThenLinear(self.q_a_layernorm, self.q_b_proj)(q_a)    # MLA: q_b_proj(q_a_layernorm(q_a))
"""
from __future__ import annotations

import torch
from torch import nn

from deepseek_pd.model.norm import RMSNorm
from deepseek_pd.model.quant.fp8_linear import Fp8Linear


class NormThenLinear:
    """Not a module: `norm` and `linear` stay the owning layer's (their weights and names)."""

    def __init__(self, norm: RMSNorm, linear: nn.Module) -> None:
        self.norm, self.linear = norm, linear
        self.fused = isinstance(linear, Fp8Linear) and linear.takes_quantised \
            and callable(getattr(norm.ops, "rms_norm_quant", None))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self.linear(self.norm(x))
        lead, dim = x.shape[:-1], x.shape[-1]
        x_fp8, x_scale, _ = self.norm.ops.rms_norm_quant(x.reshape(-1, dim), self.norm.weight, self.norm.eps,
                                                         self.linear.block.block_in)
        out_dtype = torch.promote_types(self.norm.weight.dtype, x.dtype)
        return self.linear.forward_quantised(x_fp8, x_scale, out_dtype).view(*lead, -1)
