"""`ScatterMode`: which rows a rank holds at each point of a decoder layer, and the rules that pick
them per layer (`LayerScatterModes`; SGLang's `communicator.py`, with our layout).

The layout (workers/group/layout.py): attention is data-parallel over DP groups and, within
a DP group of `tp` ranks, tensor-parallel by heads; routed experts are spread over all ranks (EP)
or replicated (ep 1); dense layers' MLP weights are replicated and their rows are data-parallel
over the TP ranks (the seed's `moe_dense_tp_size=1`, the only dense layout here).
`LayerCommunicator` (model/distributed/layer_communicator.py) moves the tensors between the modes.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.distributed.parallel import ParallelInfo


class ScatterMode(Enum):
    """How the rows of one DP group's batch lie on the ranks of its TP group.

    Worked example: TP=2, DP=2 (world 4; DP group 0 = ranks 0, 1; DP group 1 = ranks 2, 3).
    DP group 0 runs sequences a (3 new tokens a0 a1 a2) and b (2 tokens b0 b1), DP group 1 runs
    c (3 tokens c0 c1 c2):
        TP_ATTN_FULL   rank 0: a0 a1 a2 b0 b1   rank 1: a0 a1 a2 b0 b1   rank 2: c0 c1 c2   rank 3: c0 c1 c2
        SCATTERED      rank 0: a0 a1 a2         rank 1: b0 b1            rank 2: c0 c1      rank 3: c2
    SCATTERED gives TP rank t rows [t*c, (t+1)*c) of the group's n, c = ceil(n / tp); a rank may
    hold none (n = 1, tp = 2: rank 1). At tp 1 the two modes are the same rows and nothing moves.

    Attention always runs TP_ATTN_FULL (every TP rank needs every row for its heads). An MLP runs
    SCATTERED where each row needs to be computed once per TP group: dense layers (replicated
    weights, `moe_dense_tp_size=1`), and MoE layers under EP (each token dispatched once, not tp
    times). SGLang's third mode, FULL (every rank holds every DP group's rows, for an MLP that is
    tensor-parallel over the whole world), has no user here: no MLP weight is split by TP.
    """

    SCATTERED = "scattered"
    TP_ATTN_FULL = "tp_attn_full"


def mlp_mode(is_moe: bool, parallel: ParallelInfo) -> ScatterMode:
    """Where a layer's MLP runs (the one rule).

    tp 1: TP_ATTN_FULL (the same rows as SCATTERED). Dense: SCATTERED (each TP rank runs the
    replicated dense MLP on its share). MoE: SCATTERED under EP; with experts replicated (ep 1)
    every TP rank runs all of its group's rows, as SGLang's non-EP MoE does (each rank's expert-load
    counts then stay its whole group's, model/moe/expert_load.py)."""
    if parallel.tp_size == 1 or (is_moe and parallel.ep_size == 1):
        return ScatterMode.TP_ATTN_FULL
    return ScatterMode.SCATTERED


@dataclass(frozen=True)
class LayerScatterModes:
    """The modes of one decoder layer's tensors, decided when the layer is built.

    layer_input    hidden_states and residual entering the layer (the previous layer's output;
                   the model's input, the embeddings, is TP_ATTN_FULL)
    attn           the attention block's input and its o_proj partial sums: TP_ATTN_FULL
    mlp            the MLP's input and output, and the residual from `prepare_mlp` on
    layer_output   what the layer hands on: its MLP's mode, except the last layer's and the MTP
                   layer's, which are TP_ATTN_FULL (the final norm and the logits take each
                   sequence's last row)
    """

    layer_input: ScatterMode
    attn: ScatterMode
    mlp: ScatterMode
    layer_output: ScatterMode

    @classmethod
    def for_layer(cls, config: ModelConfig, layer_id: int, parallel: ParallelInfo) -> "LayerScatterModes":
        return cls(layer_input=_layer_output(config, layer_id - 1, parallel) if layer_id else ScatterMode.TP_ATTN_FULL,
                   attn=ScatterMode.TP_ATTN_FULL,
                   mlp=mlp_mode(config.is_moe_layer(layer_id), parallel),
                   layer_output=_layer_output(config, layer_id, parallel))


def _layer_output(config: ModelConfig, layer_id: int, parallel: ParallelInfo) -> ScatterMode:
    # The last decoder layer's, and the MTP layer's (layer num_hidden_layers, a network of its own
    # whose output becomes logits and the next draft step's input: model/speculative/mtp.py).
    if layer_id >= config.num_hidden_layers - 1:
        return ScatterMode.TP_ATTN_FULL
    return mlp_mode(config.is_moe_layer(layer_id), parallel)
