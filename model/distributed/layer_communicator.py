"""`LayerCommunicator`: one decoder layer's norms fused with the moves of its hidden states and
residual between the layer's `ScatterMode`s (model/distributed/scatter_mode.py; SGLang's `LayerCommunicator`).

Three calls, one per seam of the layer (n = the rows of the TP group's batch):

    prepare_attn(hidden, residual)   layer_input → attn: add + norm on the rows this rank holds,
                                     then all-gather the normed rows if they were scattered; the
                                     residual stays in layer_input's mode. Where attention's input
                                     projections take FP8 rows, the norm quantises them in its
                                     launch and the gather moves them packed (fp8 bytes + scales)
    prepare_mlp(attn_partial, res)   attn → mlp: o_proj's partial sums reduce-scattered (mlp
                                     SCATTERED) or all-reduced (TP_ATTN_FULL); the residual moved
                                     to the mlp mode (sliced, or all-gathered); then add + norm
                                     (+ the FP8 quantisation of a dense MLP's rows, one launch)
    postprocess(mlp_out, residual)   mlp → layer_output: nothing, or (last layer, MLP scattered)
                                     both all-gathered in one collective for the final norm

Example, tp 2 with EP, V3 (3 dense layers, then MoE; every MLP SCATTERED): layer 0 takes the
embeddings TP_ATTN_FULL, reduce-scatters o_proj and slices the residual; layers 1..59 all-gather
the normed rows before attention and reduce-scatter after it; layer 60 all-gathers hidden states
and residual at its end. At tp 1 every move is the identity: no collective, no copy.

The moves are chosen here, when the layer is built, from its modes; `forward` never branches.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from deepseek_pd.model.attention.tensor_parallel import all_gather_rows, all_reduce, own_rows, reduce_scatter_rows
from deepseek_pd.model.norm import RMSNorm
from deepseek_pd.model.quant.norm_fp8_linear import QuantisedRows, Rows, add_norm_quant, packed_rows, packs, unpacked
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.distributed.scatter_mode import LayerScatterModes, ScatterMode

Move = Callable[[torch.Tensor, int], torch.Tensor]  # (rows in one mode, the group's row count) → the other mode


def _stay(x: torch.Tensor, total: int) -> torch.Tensor:
    return x


def _scatter(parallel: ParallelInfo, x: torch.Tensor, total: int) -> torch.Tensor:
    return own_rows(x, parallel)


def _gather(parallel: ParallelInfo, x: torch.Tensor, total: int) -> torch.Tensor:
    return all_gather_rows(x, total, parallel)


def row_move(src: ScatterMode, dst: ScatterMode, parallel: ParallelInfo) -> Move:
    """The move of a tensor's rows from `src` to `dst` (identity when they are the same rows)."""
    if src is dst or parallel.tp_size == 1:
        return _stay
    return partial(_gather if dst is ScatterMode.TP_ATTN_FULL else _scatter, parallel)


class LayerCommunicator:
    def __init__(self, modes: LayerScatterModes, input_layernorm: RMSNorm, post_attention_layernorm: RMSNorm,
                 parallel: ParallelInfo, attn_quant_group: int | None = None,
                 mlp_quant_group: int | None = None) -> None:
        self._input_norm, self._post_attn_norm = input_layernorm, post_attention_layernorm
        self._attn_input = row_move(modes.layer_input, modes.attn, parallel)
        # Attention's input projections take FP8 rows in groups of this width (quant/norm_fp8_linear.py):
        # the input norm quantises them in its launch; scattered rows are then gathered packed.
        dim = input_layernorm.weight.shape[0]
        self._attn_quant_group = attn_quant_group if self._attn_input is _stay or packs(dim) else None
        # o_proj's sum lands where the MLP runs: reduce-scatter rather than all-reduce + slice.
        reduce = reduce_scatter_rows if modes.mlp is ScatterMode.SCATTERED else all_reduce
        self._reduce_attn: Callable[[torch.Tensor], torch.Tensor] = partial(reduce, parallel=parallel)
        self._residual_to_mlp = row_move(modes.layer_input, modes.mlp, parallel)
        # The MLP's input projection takes FP8 rows in groups of this width: the post-attention norm
        # quantises them in its launch (its rows are already where the MLP runs).
        self._mlp_quant_group = mlp_quant_group
        self._to_output = row_move(modes.mlp, modes.layer_output, parallel)

    @property
    def quantises_attn_input(self) -> bool:
        """Whether `prepare_attn` hands attention `QuantisedRows` (its input norm fused with them)."""
        return self._attn_quant_group is not None

    @property
    def quantises_mlp_input(self) -> bool:
        """Whether `prepare_mlp` hands the MLP `QuantisedRows` (the post-attention norm fused with them)."""
        return self._mlp_quant_group is not None

    def prepare_attn(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                     num_rows: int) -> tuple[Rows, torch.Tensor]:
        """(attention input in `attn` mode, residual in `layer_input` mode). The first layer's
        residual is None: its input, the embeddings, becomes the residual. The input is
        `QuantisedRows` where the layer was built with `attn_quant_group`."""
        group = self._attn_quant_group
        if group is not None and self._attn_input is _stay:
            return add_norm_quant(self._input_norm, hidden, residual, group)
        if group is not None:
            dim = hidden.shape[-1]
            packed = packed_rows(hidden.shape[0], dim, group, hidden.device)
            rows, residual = add_norm_quant(self._input_norm, hidden, residual, group, packed)
            x_fp8, x_scale = unpacked(self._attn_input(packed, num_rows), dim, group)
            return QuantisedRows(x_fp8, x_scale, rows.dtype), residual
        hidden, residual = self._input_norm.add_and_norm(hidden, residual)
        return self._attn_input(hidden, num_rows), residual

    def prepare_mlp(self, attn_partial: torch.Tensor, residual: torch.Tensor,
                    num_rows: int) -> tuple[Rows, torch.Tensor]:
        """o_proj's partial sums (all rows) and the residual → (MLP input, residual), both `mlp` mode;
        the input is `QuantisedRows` where the layer was built with `mlp_quant_group`."""
        hidden = self._reduce_attn(attn_partial)
        residual = self._residual_to_mlp(residual, num_rows)
        if self._mlp_quant_group is not None:
            return add_norm_quant(self._post_attn_norm, hidden, residual, self._mlp_quant_group)
        return self._post_attn_norm.add_and_norm(hidden, residual)

    def postprocess(self, mlp_output: torch.Tensor, residual: torch.Tensor,
                    num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's output and the residual → the layer's output pair, `layer_output` mode."""
        if self._to_output is _stay:
            return mlp_output, residual
        # One collective for both (the last layer only); summing them first would round the sum
        # once more than the final norm's fused add does at tp 1.
        both = self._to_output(torch.cat([mlp_output, residual], dim=-1), num_rows)
        return both.split([mlp_output.shape[-1], residual.shape[-1]], dim=-1)

