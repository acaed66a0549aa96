"""Block-scaled FP8 GEMMs through DeepGEMM (optional): the dense `fp8_gemm_nt`, and the grouped
`m_grouped_fp8_gemm_nt_contiguous` for the routed experts. DeepSeek-V3's format on both sides:
activations 1x128 (fp32 scales `[M, K/128]`), weights 128x128 (`[N/128, K/128]`, per expert).

DeepGEMM is never required: it is built from source with nvcc and JIT-compiles each kernel shape
on first use (docs/performance.md says how and at which commit). `deep_gemm_available()` says
whether it imports here on a Hopper GPU; the "deep_gemm" FP8 backends are registered only then
(`quant/fp8_linear.py`, `moe/deep_gemm_experts.py`), and nothing picks them by default.

The grouped GEMM takes rows grouped by expert, each expert's rows padded to DeepGEMM's M
alignment, and one int32 per row naming its expert (-1: a padding row it skips). `moe_align`'s
expert-sorted blocks are exactly that with `block_m` = the alignment, so no host sync is needed:
    rows of block b → expert block_expert[b] (-1 past the real blocks and for padding pairs).
The oracles are `fp8_ops.block_fp8_matmul_ref` and the torch MoE reference.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
from deepseek_pd.model.kernels.moe_align_large import align_by_expert_large
from deepseek_pd.model.kernels.moe_align_small import MAX_PAIRS, align_by_expert_small
from deepseek_pd.model.quant.moe_scales import Fp8ExpertScales

BLOCK = 128  # DeepGEMM's sm90 FP8 recipe: 1x128 activations, 128x128 weights


@functools.lru_cache(maxsize=None)
def deep_gemm_available() -> bool:
    """Whether `deep_gemm` imports (its extension built for this torch) and the GPU is Hopper."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import deep_gemm
    except Exception:  # not installed, or built for another torch / CUDA
        return False
    return all(hasattr(deep_gemm, name) for name in
               ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "get_mk_alignment_for_contiguous_layout"))


def compile_and_run_once(device: str) -> None:
    """Compiles one DeepGEMM FP8 GEMM (its JIT, with nvcc, on first use) and runs it on `device`:
    M = N = K = 128 through `dense`, the path the FP8 linears take. DeepGEMM compiles each new
    shape again on first use; this checks that its compiler, headers and GPU work here. Raises,
    with the reason, where they do not."""
    dev = torch.device(device)
    if dev.type != "cuda" or not deep_gemm_available():
        raise RuntimeError(f"deep_gemm does not import here or {device!r} is not a Hopper (sm90) GPU")
    x_fp8, x_scale = per_token_group_quant(torch.ones(BLOCK, BLOCK, dtype=torch.bfloat16, device=dev), BLOCK)
    w = torch.ones(BLOCK, BLOCK, device=dev).to(x_fp8.dtype)
    out = dense(x_fp8, x_scale, w, torch.ones(1, 1, dtype=torch.float32, device=dev), torch.bfloat16)
    torch.cuda.synchronize(dev)
    if not torch.equal(out, torch.full_like(out, BLOCK)):  # ones . ones over K = 128, exact in bf16
        raise RuntimeError("DeepGEMM's FP8 GEMM ran but gave a wrong product (128x128 ones)")


def fits(n: int, k: int, block_n: int, block_k: int) -> bool:
    """A weight `[n, k]` in `(block_n, block_k)` blocks that DeepGEMM's recipe takes."""
    return block_n == BLOCK and block_k == BLOCK and k % BLOCK == 0 and n % 64 == 0


def dense(x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
          out_dtype: torch.dtype) -> torch.Tensor:
    """x_fp8 `[M, K]` with x_scale `[M, K/128]`, w `[N, K]` with w_scale `[N/128, K/128]` → `[M, N]`."""
    import deep_gemm

    out = torch.empty(x_fp8.shape[0], w.shape[0], dtype=torch.bfloat16, device=x_fp8.device)
    if x_fp8.shape[0]:
        deep_gemm.fp8_gemm_nt((x_fp8, x_scale), (w, w_scale), out)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def grouped_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, scales: Fp8ExpertScales) -> torch.Tensor:
    """The routed experts as two grouped FP8 GEMMs; the contract of `fused_moe` with `scales`
    (ids outside [0, E) contribute nothing; the k results of a token summed in fp32)."""
    import deep_gemm

    num_experts, two_inter, hidden_size = w13.shape
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(num_tokens, hidden_size)
    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    blocks = (align_by_expert_small if num_pairs <= MAX_PAIRS else align_by_expert_large)(topk_ids, num_experts, align)
    pair = blocks.sorted_pair_ids.long()
    real = pair < num_pairs
    row_expert = blocks.block_expert.repeat_interleave(align)
    layout = torch.where(real & (row_expert < num_experts), row_expert, -1).to(torch.int32).contiguous()
    token = torch.where(real, pair // top_k, 0)
    x_fp8, x_scale = per_token_group_quant(hidden.contiguous(), BLOCK)
    gate_up = torch.empty(blocks.capacity, two_inter, dtype=torch.bfloat16, device=hidden.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((x_fp8[token], x_scale[token]), (w13, scales.w13_scale), gate_up,
                                                layout)
    gate, up = gate_up.chunk(2, dim=-1)
    a_fp8, a_scale = per_token_group_quant((F.silu(gate.float()) * up.float()).to(hidden.dtype), BLOCK)
    down = torch.empty(blocks.capacity, hidden_size, dtype=torch.bfloat16, device=hidden.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a_fp8, a_scale), (w2, scales.w2_scale), down, layout)
    # Padding rows go to one dump row past the pairs; each real pair lands once, times its weight.
    dest = torch.where(real, pair, num_pairs)
    weight = torch.cat([topk_weights.reshape(-1).float(), topk_weights.new_zeros(1, dtype=torch.float32)])[dest]
    per_pair = torch.zeros(num_pairs + 1, hidden_size, dtype=torch.float32, device=hidden.device)
    per_pair.index_copy_(0, dest, down.float() * weight[:, None])
    return per_pair[:num_pairs].view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
