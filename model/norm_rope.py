"""Backends for the small per-layer ops: RMSNorm (with the residual add) and RoPE + latent-cache write.

    "torch"   the reference: `rms_norm_ref` and `RotaryEmbedding.forward` + an indexed write
              (~7 launches per norm, ~20 for rope and the write).
    "triton"  `kernels/rmsnorm.py` and `kernels/rope_cache.py`: one launch each; MLA's kv_a norm
              can ride in the rope launch (`norm_rope_and_write`, with `small_batch_fusions`).
Chosen once when a module is built (`BuildOptions.norm_rope_backend`); `RunnerConfig` resolves
"auto" to Triton on CUDA. Both are free of host syncs (capturable in CUDA graphs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from deepseek_pd.model.registry import Registry

if TYPE_CHECKING:
    from deepseek_pd.model.rope import RotaryEmbedding


class NormRopeOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x)."""

    def rope_and_write(self, rotary: "RotaryEmbedding", positions: torch.Tensor, q_pe: torch.Tensor,
                       k_pe: torch.Tensor, c_kv: torch.Tensor, cache: torch.Tensor,
                       out_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped (q_pe, k_pe); `cache[out_slots] = [c_kv | roped k_pe]` (cache `[S, R + d]`)."""

    def norm_rope_and_write(self, rotary: "RotaryEmbedding", positions: torch.Tensor, q_pe: torch.Tensor,
                            k_pe: torch.Tensor, c_kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            cache: torch.Tensor, out_slots: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rope_and_write` of the RMS-normalised c_kv (MLA's kv_a norm): (roped q_pe, roped k_pe,
        normalised c_kv)."""


NORM_ROPE_BACKENDS: Registry[NormRopeOps] = Registry("norm/rope backend")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF DeepSeek's RMSNorm: normalise in fp32, round to x's dtype, then scale by the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@NORM_ROPE_BACKENDS.register("torch")
class TorchNormRope:
    def rms_norm(self, x, weight, eps, residual):
        residual = x if residual is None else x + residual
        return rms_norm_ref(residual, weight, eps), residual

    def rope_and_write(self, rotary, positions, q_pe, k_pe, c_kv, cache, out_slots):
        q_pe, k_pe = rotary(positions, q_pe, k_pe)
        cache[out_slots] = torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype)
        return q_pe, k_pe

    def norm_rope_and_write(self, rotary, positions, q_pe, k_pe, c_kv, norm_weight, eps, cache, out_slots):
        c_kv = rms_norm_ref(c_kv, norm_weight, eps)
        return (*self.rope_and_write(rotary, positions, q_pe, k_pe, c_kv, cache, out_slots), c_kv)


@NORM_ROPE_BACKENDS.register("triton")
class TritonNormRope:
    def __init__(self) -> None:
        from deepseek_pd.model.kernels.checks import require_triton

        require_triton("norm/rope backend 'triton'")
        from deepseek_pd.model.kernels.rmsnorm import rms_norm
        from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant
        from deepseek_pd.model.kernels.rope_cache import MAX_NORM_RANK, norm_rope_and_cache_write, rope_and_cache_write

        self._norm, self._rope, self._norm_rope = rms_norm, rope_and_cache_write, norm_rope_and_cache_write
        self._max_norm_rank = MAX_NORM_RANK
        self.rms_norm_quant = rms_norm_quant  # the norm fused with FP8 quantisation (quant/norm_fp8_linear.py)

    def rms_norm(self, x, weight, eps, residual):
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        out, new_residual = self._norm(flat, weight, eps, None if residual is None else residual.reshape(flat.shape))
        new_residual = flat if new_residual is None else new_residual
        return out.view(*lead, -1), new_residual.view(*lead, -1)

    def rope_and_write(self, rotary, positions, q_pe, k_pe, c_kv, cache, out_slots):
        return self._rope(q_pe, k_pe, c_kv, positions, rotary.inv_freq, rotary.attention_factor, rotary.interleaved,
                          cache, out_slots)

    def norm_rope_and_write(self, rotary, positions, q_pe, k_pe, c_kv, norm_weight, eps, cache, out_slots):
        if c_kv.shape[-1] > self._max_norm_rank:  # the fused norm holds a row in one block
            c_kv = self.rms_norm(c_kv, norm_weight, eps, None)[0]
            return (*self.rope_and_write(rotary, positions, q_pe, k_pe, c_kv, cache, out_slots), c_kv)
        return self._norm_rope(q_pe, k_pe, c_kv, norm_weight, eps, positions, rotary.inv_freq,
                               rotary.attention_factor, rotary.interleaved, cache, out_slots)
