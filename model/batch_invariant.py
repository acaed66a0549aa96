"""Batch-invariant products for `--deterministic`: a row's result never depends on the other rows.

A GEMM library picks its algorithm (tile, split-K, gemv for one row) by the number of rows M, and
with it the order in which each output element sums its K products; so a row computed in a batch of
16 can differ in the last bits from the same row computed alone, and greedy decoding then follows
the batch at a near-tie (issue 25). Here every row is reduced in one order that depends on K alone:

- CUDA: `kernels/matmul_invariant.py`, one fixed tile and no split-K for every M (Thinking
  Machines' "Defeating Nondeterminism in LLM Inference", SGLang/vLLM's batch-invariant mode);
- elsewhere (the CPU reference): each row on its own, a `[1, K] x [K, N]` product, which is the
  same call whatever the batch. Slow, and only meant to be exact. The CPU's elementwise kernels
  vary with a row's place too, so there the runner also makes each sequence its own forward
  (`each_row_alone`).

Chosen once, when the model is built (`BuildOptions.deterministic`): `make_linears_invariant`
swaps the model's `nn.Linear`s for `InvariantLinear`, and the layers that multiply directly take
`linear`/`bmm` from here instead of torch's.

    y = linear(x, w)          # [M, K] x [N, K] -> [M, N]; y[i] depends on x[i] and w only
    z = bmm(a, b)             # [B, M, K] x [B, K, N] -> [B, M, N]; z[:, i] depends on a[:, i] and b
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from deepseek_pd.model.kv.layer_progress import LayerProgress


def _triton_runs(x: torch.Tensor) -> bool:
    """The Triton kernel on CUDA tensors; the row loop elsewhere (also under TRITON_INTERPRET, whose
    kernel tests call `matmul_invariant` directly: the model on CPU stays the reference)."""
    return x.is_cuda


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) with every row reduced in an order independent of the batch."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if _triton_runs(rows):
        from deepseek_pd.model.kernels.matmul_invariant import matmul_invariant

        out = matmul_invariant(rows.unsqueeze(0), weight.t().unsqueeze(0))[0]
    else:
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        for i in range(rows.shape[0]):
            # A fresh copy: a BLAS may take another path for another alignment of the row's address
            # (MKL's results depend on it without its reproducibility mode), and a row's place in a
            # batch sets that.
            out[i:i + 1] = F.linear(rows[i:i + 1].clone(), weight)
    return out.reshape(*lead, weight.shape[0])


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm(a, b)` with each of a's rows (dim 1) reduced in an order independent of M."""
    if _triton_runs(a):
        from deepseek_pd.model.kernels.matmul_invariant import matmul_invariant

        return matmul_invariant(a, b)
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    for i in range(a.shape[1]):
        out[:, i:i + 1] = torch.bmm(a[:, i:i + 1].contiguous(), b)  # a fresh copy, as in `linear`
    return out


class InvariantLinear(nn.Linear):
    """A bias-free `nn.Linear` whose forward is `linear` above (same parameter names and loading)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def make_linears_invariant(model: nn.Module) -> None:
    """Replaces every plain, bias-free `nn.Linear` under `model` by an `InvariantLinear` holding the
    same weight `Parameter` (so ties, e.g. lm_head to the embedding, stay tied, and the parameter
    names the loader maps are unchanged). Called once by the model's constructor, before the weights
    load; FP8 linears (`Fp8Linear`) are not `nn.Linear`s and keep their own kernel."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            if child.bias is not None:
                raise ValueError(f"{name}: batch-invariant linears are bias-free")
            swapped = InvariantLinear(child.in_features, child.out_features, bias=False, device="meta")
            swapped.weight = child.weight
            setattr(module, name, swapped)


def each_row_alone(forward: Callable[[slice], torch.Tensor], rows: int, progress: "LayerProgress | None",
                   num_layers: int) -> torch.Tensor:
    """`--deterministic` off CUDA: `forward(slice(i, i + 1))` for each of the batch's `rows`
    sequences, their logits concatenated. The CPU's elementwise kernels take a SIMD body and a
    scalar tail whose transcendentals (exp, sigmoid, SiLU) differ in the last bit, and a row's place
    in the flattened batch decides which one it gets (seen: a MoE weight's sigmoid); so the
    reference makes every sequence its own batch, whose shapes are the ones it has alone. The GPU
    path runs the batch-invariant kernels instead. `progress` hears of each of the `num_layers`
    layers once every sequence's forward has written it."""
    logits = torch.cat([forward(slice(row, row + 1)) for row in range(rows)])
    if progress is not None:
        for layer in range(num_layers):
            progress.kv_written(layer)
    return logits
