"""The extend forward cut at its attention cores: the pieces that piecewise CUDA graphs capture.

A decoder layer is an op list (model/layer_ops.py) with one op, `attn_core`, whose work follows
the batch's sequences (ragged causal attention over each sequence's own tokens and prefix, read
from host lengths): it runs eagerly, with the real batch. Everything else is row-wise, so it can
run over a fixed number of (padded) rows and be captured once per token count. Cutting every
layer's list at `attn_core` gives L cores and L + 1 pieces:

    piece 0      embedding, layer 0's ops before attn_core (prepare_attn, attn_prepare)
    core 0       layer 0's attn_core
    piece i      layer i-1's ops after attn_core (prepare_mlp .. postprocess), layer i's ops before it
    core i       ...
    piece L      layer L-1's ops after attn_core

Piece i (i < L) ends with layer i's `attn_prepare`, the op that writes the layer's latent KV
(`KV_WRITE_OP`): whoever runs the pieces tells a `LayerProgress` of layer i after piece i.

State between them (`OpState` keys): a piece i < L leaves {attn_intermediate, residual}, core i
turns attn_intermediate into attn_output, piece i + 1 takes {attn_output, residual}; piece L leaves
{hidden_states, residual}, the final norm's input. The pieces run the layers' own bound ops, so
the piecewise path cannot drift from `DeepseekForCausalLM.run_layers`.

A core may write its attn_output into given rows (`run_core(.., out=)`: a captured piece's static
input), which saves a copy per layer: the layer's `attend`, then its o_proj multiplied straight into
those rows (a plain linear: `mm`'s `out=`; an FP8 one, whose GEMMs return their own tensor, copies).
That is the bound `attn_core` op's own work: extend graphs run at tp 1 (`check_extend_capturable`),
where the core's o_proj is the output itself, not a partial sum.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.kv.layer_progress import KV_WRITE_OP
from deepseek_pd.model.layer_ops import Op, OpLayer, OpState

CORE_OP = "attn_core"


def _split_at_core(layer: OpLayer) -> tuple[tuple[Op, ...], Op, tuple[Op, ...]]:
    """(the layer's ops before `attn_core`, attn_core, the ops after it); the KV write must come before."""
    names = layer.op_names
    if names.count(CORE_OP) != 1:
        raise ValueError(f"layer {layer.layer_id}: op list {names} has no single {CORE_OP!r}")
    cut = names.index(CORE_OP)
    if KV_WRITE_OP not in names[:cut]:
        raise ValueError(f"layer {layer.layer_id}: {KV_WRITE_OP!r} must come before {CORE_OP!r}")
    return layer.ops[:cut], layer.ops[cut], layer.ops[cut + 1:]


def _multiply_into(linear: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """`out[:] = linear(x)`, without a temporary where the linear is a plain one."""
    if type(linear) is nn.Linear:  # bias-free (make_linear): y = x W^T, the kernel F.linear runs
        return lambda x, out: torch.mm(x, linear.weight.t(), out=out)
    return lambda x, out: out.copy_(linear(x))


class ExtendPieces:
    """A model's extend forward as pieces and eager cores (module docstring), run by index."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.model = model
        splits = [_split_at_core(layer) for layer in model.layers]
        self.num_layers = len(splits)
        self._cores: tuple[Op, ...] = tuple(core for _, core, _ in splits)
        self._o_proj_into = tuple(_multiply_into(layer.self_attn.o_proj) for layer in model.layers)
        # piece i: layer i-1's ops after its core (none for i = 0), then layer i's ops before it (none for i = L)
        self._pieces: tuple[tuple[Op, ...], ...] = tuple(
            (splits[i - 1][2] if i > 0 else ()) + (splits[i][0] if i < self.num_layers else ())
            for i in range(self.num_layers + 1))

    @property
    def num_pieces(self) -> int:
        return self.num_layers + 1

    def run_piece(self, index: int, state: OpState, batch: ForwardBatch) -> OpState:
        """Runs piece `index` over `batch`; piece 0 starts from the embedding (`state` is ignored:
        pass an empty one). Returns the state it leaves."""
        if index == 0:
            state = self.model.initial_state(batch)
        for op in self._pieces[index]:
            op(state, batch)
        return state

    def run_core(self, index: int, state: OpState, batch: ForwardBatch, out: torch.Tensor | None = None) -> None:
        """Layer `index`'s attention core: attn_intermediate -> attn_output, over `batch`'s rows;
        with `out` (`[batch rows, hidden]`) written into those rows, and attn_output is `out`."""
        if out is None:
            self._cores[index](state, batch)
            return
        attended = self.model.layers[index].self_attn.attend(state.pop("attn_intermediate"), batch)
        self._o_proj_into[index](attended, out)
        state["attn_output"] = out

    def run_all(self, batch: ForwardBatch, progress=None) -> OpState:
        """Every piece and core in order over one batch, no padding: exactly `run_layers`' ops (the
        oracle the tests hold the padded and the captured paths to). Returns {hidden_states, residual}."""
        state = OpState()
        for index in range(self.num_pieces):
            state = self.run_piece(index, state, batch)
            if index < self.num_layers:
                if progress is not None:
                    progress.kv_written(self.model.layers[index].layer_id)
                self.run_core(index, state, batch)
        return state

