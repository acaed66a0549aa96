"""Token dispatch to experts and combine back, split in two halves each (a: send, b: receive) so a
two-batch-overlap schedule can run other work in between (DeepEP's `return_recv_hook` model).

A dispatcher is built once per model from the layer's `ExpertPlacement` and a `DispatchConfig`
(`DISPATCHERS.build(name, placement, config)`). `local` (ep_size 1) hands tokens to the local
experts unchanged; `all_to_all` (`ep_dispatcher.py`, torch.distributed) and `deepep`
(`deepep_dispatcher.py`, only when `deep_ep` imports) move them between EP ranks, each in a normal
and a low-latency layout picked per step (`LayoutSwitchingDispatcher`, `model/distributed/dispatch_mode.py`); they
import this module and register themselves, and the package `deepseek_pd.model.moe` imports them,
so any import of this module sees every dispatcher (as with `MOE_BACKENDS`). `dispatch_b` hands
the experts topk ids in *local* expert ids, -1 for pairs another rank computes; combine returns
`[T, H]` in the original token order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.distributed.dispatch_mode import DispatchConfig, DispatchMode
from deepseek_pd.model.distributed.parallel import ExpertPlacement
from deepseek_pd.model.registry import Registry


@dataclass
class DispatchOutput:
    """Tokens as the local experts see them; `handle` is whatever combine needs to route them back."""

    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    handle: Any = None


@dataclass
class CombineInput:
    hidden: torch.Tensor  # experts' weighted output per received token
    handle: Any = None


class Dispatcher(Protocol):
    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   mode: ForwardMode | None = None) -> Any:
        """Starts sending; `mode` lets a dispatcher pick a per-batch kernel (DeepEP normal vs
        low-latency). topk ids are global expert ids."""
    def dispatch_b(self, handle: Any) -> DispatchOutput: ...
    def combine_a(self, combine_input: CombineInput) -> Any: ...
    def combine_b(self, handle: Any) -> torch.Tensor: ...
    def prepare_step(self, mode: ForwardMode) -> None:
        """Called before a step whose dispatches run no Python (a CUDA-graph replay), so the
        dispatcher can do what its first `dispatch_a` of a `mode` step would (DeepEP: clean the
        low-latency buffer after normal steps)."""


DISPATCHERS: Registry[Dispatcher] = Registry("EP dispatcher")


@DISPATCHERS.register("local")
class LocalDispatcher:
    """World size 1: nothing moves; the halves only pass their inputs through (global ids are local)."""

    cuda_graph_safe = True  # nothing moves, nothing syncs

    def __init__(self, placement: ExpertPlacement | None = None, config: DispatchConfig | None = None) -> None:
        if placement is not None and placement.parallel.ep_size > 1:
            raise UserError(f"the local dispatcher cannot serve ep_size {placement.parallel.ep_size}; "
                            f"use {', '.join(n for n in DISPATCHERS.names() if n != 'local')}")

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   mode: ForwardMode | None = None) -> DispatchOutput:
        return DispatchOutput(hidden, topk_ids, topk_weights)

    def dispatch_b(self, handle: DispatchOutput) -> DispatchOutput:
        return handle

    def combine_a(self, combine_input: CombineInput) -> torch.Tensor:
        return combine_input.hidden

    def combine_b(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def prepare_step(self, mode: ForwardMode) -> None:
        pass


@dataclass
class _Started:
    """A handle of one layout's implementation, with that implementation (the later halves use it)."""

    impl: Any
    inner: Any


class LayoutSwitchingDispatcher:
    """Base of the EP dispatchers that have a normal and a low-latency layout (`DispatchMode`).

    Each step's layout is `config.mode.resolve(mode)` for the step's group-wide mode (the same on
    every rank); the four calls go to that layout's implementation, and each handle remembers which
    one started it. `enter(layout)` runs before each dispatch (and before a graph replay).
    Subclasses declare `low_latency_cuda_graph_safe` (their low-latency layout never syncs with the
    host); the normal layout never is (its receive sizes are counted on the host).
    """

    cuda_graph_safe = False
    low_latency_cuda_graph_safe = False

    def __init__(self, config: DispatchConfig, normal: Any, low_latency: Any) -> None:
        self.config = config
        self._impls = {DispatchMode.NORMAL: normal, DispatchMode.LOW_LATENCY: low_latency}

    def layout_for(self, mode: ForwardMode | None) -> DispatchMode:
        # No mode given (a caller outside a forward): AUTO takes normal, which has no token limit.
        return self.config.mode.resolve(mode or ForwardMode.EXTEND)

    def enter(self, layout: DispatchMode) -> None:
        """Hook before a dispatch in `layout`; nothing by default."""

    def prepare_step(self, mode: ForwardMode) -> None:
        self.enter(self.layout_for(mode))

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   mode: ForwardMode | None = None) -> _Started:
        layout = self.layout_for(mode)
        self.enter(layout)
        impl = self._impls[layout]
        return _Started(impl, impl.dispatch_a(hidden, topk_ids, topk_weights))

    def dispatch_b(self, handle: _Started) -> DispatchOutput:
        out = handle.impl.dispatch_b(handle.inner)
        out.handle = _Started(handle.impl, out.handle)
        return out

    def combine_a(self, combine_input: CombineInput) -> _Started:
        started: _Started = combine_input.handle
        return _Started(started.impl, started.impl.combine_a(CombineInput(combine_input.hidden, started.inner)))

    def combine_b(self, handle: _Started) -> torch.Tensor:
        return handle.impl.combine_b(handle.inner)
