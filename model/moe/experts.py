"""Routed experts stacked for grouped kernels, and the MoE kernel registry.

`w13` is `[E, 2I, H]` (gate rows then up rows of each expert, HF's `gate_up_proj` layout) and `w2`
`[E, H, I]`. With `num_fused_shared_experts = n` the n shared experts are appended as experts
E..E+n-1 (the shared MLP of width n*I split into n slices of width I: an MLP is a sum over its
intermediate neurons, so the split is exact) and every token selects them with weight 1.

A kernel computes, per token, `sum_j w_j * expert_{id_j}(x)`; ids outside [0, E) (experts another
EP rank owns) contribute nothing. How the experts are stored is the quantisation method
(`quant_method.py`): in the model dtype, or in block-scaled FP8, when the kernel gets their
`Fp8ExpertScales`; kernels with `supports_fp8` take both.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_pd.errors import UserError
from deepseek_pd.model.moe.quant_method import MoEQuantMethod
from deepseek_pd.model.quant.moe_scales import Fp8ExpertScales
from deepseek_pd.model.registry import Registry

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_expert_products(hidden: torch.Tensor, expert: torch.Tensor, top_k: int, w13: torch.Tensor,
                            w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (token, k) pair's expert MLP output with no host sync: `expert` [tokens * top_k] holds
    each pair's expert, num_experts for a dropped one. Returns (order, y): the pairs sorted by
    expert (stable), and y[i] the output of pair order[i] (`torch._grouped_mm` from device row
    offsets; rows of dropped pairs sort last, past the last offset, and hold garbage). The SiLU-mul
    is rounded to the model dtype before the down projection, as the fused kernel stores it."""
    num_experts = w13.shape[0]
    expert = expert.long()
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=hidden.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    offsets = counts[:num_experts].cumsum(0).to(torch.int32)
    order = torch.argsort(expert, stable=True)
    gate, up = torch._grouped_mm(hidden[order // top_k], w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(gate) * up).to(hidden.dtype), w2.transpose(1, 2), offs=offsets)
    return order, y


class MoEKernel(Protocol):
    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, scales: Fp8ExpertScales | None = None) -> torch.Tensor:
        """hidden `[N, H]`, topk_ids/weights `[N, k]` → `[N, H]` in hidden's dtype; `scales` for FP8 experts."""


MOE_BACKENDS: Registry[MoEKernel] = Registry("MoE backend")


@MOE_BACKENDS.register("torch")
class TorchMoEKernel:
    """Reference: group the (token, expert) pairs by expert, one GEMM pair per expert hit.

    FP8 experts: each product quantises its rows per token group and multiplies dequantised
    operands in fp32 (`Fp8ExpertScales.reference_product`); the SiLU-mul output is rounded to the
    model dtype before the down projection, as the fused kernel stores it.

    Each expert's GEMMs take its rows only, so their row counts (how many tokens chose it) decide
    the shapes, and a CPU BLAS multiplies a row differently at different row counts (MKL: its
    small-M kernels). On the CPU, in the model dtype, the counts stay tensors (`_grouped`): torch's
    `_grouped_mm` runs the same per-expert GEMMs from device offsets, bit for bit (test_moe.py), and
    nothing is read back in Python (a speculative step's forwards read nothing: test_speculative_host_sync.py).
    Elsewhere (FP8 scales, batch-invariant products, CUDA, a torch without `_grouped_mm`) the
    counts are read on the host, one sync per call: on CUDA the grouped op would read them too (its
    fallback) or multiply otherwise (CUTLASS); there the "triton" and "grouped" backends are the
    sync-free ones. Both paths add each token's terms in expert order, as one `index_add_` would.
    """

    cuda_graph_safe = False
    supports_fp8 = True
    # The per-expert products (the "torch_invariant" backend swaps in batch_invariant.linear).
    linear = staticmethod(F.linear)

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, scales: Fp8ExpertScales | None = None) -> torch.Tensor:
        num_experts = w13.shape[0]
        num_tokens, top_k = topk_ids.shape
        out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        if num_tokens == 0:
            return out.to(hidden.dtype)
        flat_ids = topk_ids.reshape(-1)
        flat_ids = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids,
                               torch.full_like(flat_ids, num_experts))
        flat_weights = topk_weights.reshape(-1).float()
        if scales is None and self._groups_on_device(hidden, w2):
            return self._grouped(out, hidden, flat_ids, flat_weights, top_k, w13, w2)
        order = torch.argsort(flat_ids, stable=True)  # expert-major, then token order
        token_of = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
        counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()
        start = 0
        for expert, count in enumerate(counts[:num_experts]):
            if count:
                pairs = order[start:start + count]
                tokens = token_of[pairs]
                gate, up = self._product(hidden[tokens], w13[expert], 13, expert, scales).chunk(2, dim=-1)
                y = self._product((F.silu(gate) * up).to(hidden.dtype), w2[expert], 2, expert, scales)
                out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
            start += count
        return out.to(hidden.dtype)

    def _groups_on_device(self, hidden: torch.Tensor, w2: torch.Tensor) -> bool:
        """Whether `_grouped` gives this call's products bit for bit (see the class doc); its rows
        must be a multiple of 16 bytes (the tiny and real models' are)."""
        return (hidden.device.type == "cpu" and _HAS_GROUPED_MM and type(self).linear is F.linear
                and hidden.dtype in _GROUPED_DTYPES
                and hidden.shape[-1] * hidden.element_size() % 16 == 0 and w2.shape[-1] * w2.element_size() % 16 == 0)

    @staticmethod
    def _grouped(out: torch.Tensor, hidden: torch.Tensor, flat_ids: torch.Tensor, flat_weights: torch.Tensor,
                 top_k: int, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """The loop's GEMMs (`grouped_expert_products`) and its sums, in expert order. The dropped
        pairs' terms are zeros (`where`), and adding +0.0 changes no sum (`out` starts at +0.0 and
        never holds -0.0)."""
        order, y = grouped_expert_products(hidden, flat_ids, top_k, w13, w2)
        kept = (flat_ids[order] < w13.shape[0])[:, None]
        out.index_add_(0, order // top_k, torch.where(kept, y.float() * flat_weights[order, None], 0.0))
        return out.to(hidden.dtype)

    def _product(self, x: torch.Tensor, weight: torch.Tensor, gemm: int, expert: int,
                 scales: Fp8ExpertScales | None) -> torch.Tensor:
        if scales is None:
            return self.linear(x, weight)
        return scales.reference_product(x, weight, gemm, expert)


class FusedExperts(nn.Module):
    """The routed experts of one layer: parameters made by the quantisation method (`w13`, `w2`,
    and FP8's `w13_scale_inv`, `w2_scale_inv`), multiplied by the kernel named `backend`.

    `small_batch_fusions`: where the kernel offers it (`single_token_path`, the "triton" backend)
    and the experts are in the model dtype, a batch of one token (batch-1 decode) goes through
    `kernels/moe_single_token.py` instead (two launches, no sort); other batches through `backend`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: str,
                 quant: MoEQuantMethod, small_batch_fusions: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.quant = quant
        quant.create_weights(self, num_experts, hidden_size, intermediate_size)
        self.kernel: MoEKernel = MOE_BACKENDS.build(backend)
        if not quant.is_fp8 and getattr(self.kernel, "fp8_only", False):
            raise UserError(f"MoE backend {backend!r} multiplies FP8 experts only; these are in {self.w13.dtype}")
        if quant.is_fp8 and not getattr(self.kernel, "supports_fp8", False):
            fp8_names = [n for n in MOE_BACKENDS.names() if getattr(MOE_BACKENDS.get(n), "supports_fp8", False)]
            raise UserError(f"MoE backend {backend!r} does not multiply FP8 experts; use one of {', '.join(fp8_names)}")
        self._single_token = None
        if small_batch_fusions and getattr(self.kernel, "single_token_path", False) and not quant.is_fp8:
            from deepseek_pd.model.kernels.moe_single_token import MAX_TOKENS, fused_moe_single_token

            self._single_token, self._single_token_max = fused_moe_single_token, MAX_TOKENS

    def fp8_param_blocks(self) -> dict:
        """FP8 parameters by name and their scale blocks (`fp8_linear.fp8_blocks`); none in the model dtype."""
        return self.quant.param_blocks()

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self._single_token is not None and 0 < hidden.shape[0] <= self._single_token_max:
            return self._single_token(hidden.contiguous(), topk_ids, topk_weights, self.w13, self.w2)
        return self.kernel(hidden, topk_ids, topk_weights, self.w13, self.w2, self.quant.scales(self))
