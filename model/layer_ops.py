"""Decoder layers as op lists (ARCHITECTURE §5; SGLang's `operations_strategy.py`).

A layer is a tuple of op names; op `name` is the layer's method `op_<name>(state, batch)`. Each op
pops what it consumes from an `OpState` and writes what it produces. `DeepseekForCausalLM.forward`
runs exactly these lists, so a two-batch-overlap executor that interleaves the same ops (with
YIELD points between them) cannot drift from the plain path.

Keys between ops of a MoE layer (→ produced, ← consumed):
    prepare_attn   ← hidden_states, residual              → attn_input, residual
    attn_prepare   ← attn_input                           → attn_intermediate
    attn_core      ← attn_intermediate                    → attn_output (a partial sum under TP)
    prepare_mlp    ← attn_output, residual                → mlp_input, residual
    gate           (reads mlp_input)                      → router_logits
    select_experts ← router_logits                        → topk_weights, topk_ids
    dispatch_a     ← topk_weights, topk_ids (reads mlp_input) → dispatch_handle
    dispatch_b     ← dispatch_handle                      → dispatched
    experts        ← dispatched                           → expert_output
    combine_a      ← expert_output                        → combine_handle
    shared_experts ← mlp_input                            → shared_output
    combine_b      ← combine_handle                       → routed_output
    output         ← routed_output, shared_output         → mlp_output
    postprocess    ← mlp_output, residual                 → hidden_states, residual
A layer starts and ends with exactly {hidden_states, residual}. Under attention TP the rows these
hold change between prepare_attn, prepare_mlp and postprocess (model/distributed/layer_communicator.py).

Executors (the plain loop in `DeepseekForCausalLM`, two-batch overlap in `tbo.py`) see a model
only through `OpLayer` and `LayerStack` below, so they do not depend on the model class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import torch

from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.kv.layer_progress import KV_WRITE_OP

if TYPE_CHECKING:
    from deepseek_pd.model.kv.layer_progress import LayerProgress

MOE_LAYER_OPS: tuple[str, ...] = (
    "prepare_attn", "attn_prepare", "attn_core", "prepare_mlp", "gate", "select_experts",
    "dispatch_a", "dispatch_b", "experts", "combine_a", "shared_experts", "combine_b", "output",
    "postprocess",
)
DENSE_LAYER_OPS: tuple[str, ...] = (
    "prepare_attn", "attn_prepare", "attn_core", "prepare_mlp", "mlp", "postprocess",
)
LAYER_BOUNDARY_KEYS = frozenset({"hidden_states", "residual"})

# Two-batch-overlap schedules (SGLang's DeepSeek strategies): the same ops with YIELD points where
# one micro-batch hands the device to the other while its communication is in flight. Decode
# moves shared_experts up to hide dispatch latency; the op state makes that reorder safe to test.
YIELD = "YIELD"
TBO_PREFILL_MOE_OPS: tuple[str, ...] = (
    "prepare_attn", "attn_prepare", "attn_core", "prepare_mlp", "gate", "select_experts", "dispatch_a", YIELD,
    "dispatch_b", "experts", "combine_a", YIELD, "shared_experts", "combine_b", "output", "postprocess",
)
TBO_DECODE_MOE_OPS: tuple[str, ...] = (
    "prepare_attn", "attn_prepare", YIELD, "attn_core", "prepare_mlp", "gate", "select_experts", YIELD,
    "dispatch_a", "shared_experts", YIELD, "dispatch_b", "experts", "combine_a", YIELD, "combine_b", YIELD,
    "output", "postprocess",
)


def without_yields(ops: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(op for op in ops if op != YIELD)


class OpState:
    """A dict that refuses silent overwrite: a key must be popped before it is written again.

    `state["x"] = t` raises if "x" is present; `state.pop("x")` consumes it; `state["x"]` reads
    without consuming. This catches an op that forgets to consume its input, or two ops (or two
    micro-batches) writing the same key, at the first place it happens.
    """

    def __init__(self, **initial: Any) -> None:
        self._data: dict[str, Any] = {}
        for key, value in initial.items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self._data:
            raise KeyError(f"op state: '{key}' is already set; pop it before writing it again")
        self._data[key] = value

    def __getitem__(self, key: str) -> Any:
        try:
            return self._data[key]
        except KeyError:
            raise KeyError(f"op state: '{key}' is not set (have {sorted(self._data)})") from None

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def pop(self, key: str) -> Any:
        try:
            return self._data.pop(key)
        except KeyError:
            raise KeyError(f"op state: '{key}' is not set (have {sorted(self._data)})") from None

    def update(self, **values: Any) -> None:
        for key, value in values.items():
            self[key] = value

    def keys(self) -> frozenset[str]:
        return frozenset(self._data)

    def expect_only(self, keys: frozenset[str]) -> None:
        """Raises if the state holds anything but `keys` (a leaked intermediate)."""
        if self.keys() != keys:
            raise RuntimeError(f"op state holds {sorted(self.keys())}, expected exactly {sorted(keys)}")


Op = Callable[[OpState, ForwardBatch], None]


@dataclass(frozen=True)
class EmptyBatch:
    """What an op run for no tokens gets as its batch (an idle rank, an empty TBO micro-batch):
    all an MLP op reads from a batch, the mode the dispatcher follows."""

    mode: ForwardMode
    counted_tokens: None = None  # no tokens, none to count in the expert load

    @property
    def ep_mode(self) -> ForwardMode:
        return self.mode


class OpLayer(Protocol):
    """A decoder layer as an op-list executor sees it: op `name` is its method `op_<name>`."""

    layer_id: int
    is_moe: bool  # MoE layers also run the TBO schedules; dense layers only `op_names`
    op_names: tuple[str, ...]  # the plain op list, `MOE_LAYER_OPS` or `DENSE_LAYER_OPS`
    ops: tuple["Op", ...]  # `op_names` as bound methods (`bound_ops`)


class LayerStack(Protocol):
    """A whole model as an op-list executor sees it (what `DeepseekForCausalLM` provides)."""

    @property
    def layers(self) -> Sequence[OpLayer]: ...

    def initial_state(self, batch: ForwardBatch) -> OpState:
        """The first layer's input state, {hidden_states, residual}."""

    def run_layers(self, batch: ForwardBatch, progress: "LayerProgress | None" = None) -> OpState:
        """Every layer's plain op list over one state; returns the last layer's output state.
        `progress`, if given, hears of each layer's KV write (`run_layer_ops`)."""

    def final_hidden(self, state: OpState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Consumes the last layer's output state: final-normed hidden states of `rows`."""

    def empty_op(self, layer: OpLayer, name: str) -> "Op | None":
        """What a rank with no tokens runs for `layer`'s op `name` (None: nothing), with an
        `EmptyBatch`: the MoE ops that hold the EP collectives, on zero rows."""


def op_method(layer: OpLayer, name: str) -> Op:
    """The layer's op `name` as a bound method (the one place the `op_<name>` rule lives)."""
    return getattr(layer, f"op_{name}")


def bound_ops(layer: OpLayer) -> tuple[Op, ...]:
    """The layer's op list resolved to bound methods (done once, at build time)."""
    return tuple(op_method(layer, name) for name in layer.op_names)


def run_layer_ops(layer: OpLayer, state: OpState, batch: ForwardBatch,
                  progress: "LayerProgress | None" = None) -> None:
    """Runs the layer's plain op list; tells `progress` right after `KV_WRITE_OP`."""
    if progress is None:
        for op in layer.ops:
            op(state, batch)
        return
    for name, op in zip(layer.op_names, layer.ops):
        op(state, batch)
        if name == KV_WRITE_OP:
            progress.kv_written(layer.layer_id)
