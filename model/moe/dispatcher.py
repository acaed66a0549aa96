"""Token dispatch to experts and combine back, split in two halves each (a: send, b: receive) so a
two-batch-overlap schedule can run other work in between (DeepEP's `return_recv_hook` model).

A dispatcher is built once per model from the layer's `ExpertPlacement` (`DISPATCHERS.build(name,
placement)`). `local` (ep_size 1) hands tokens to the local experts unchanged; `all_to_all`
(`ep_dispatcher.py`, torch.distributed) and `deepep` (`deepep_dispatcher.py`, only when `deep_ep`
imports) move them between EP ranks; they import this module and register themselves, and the
package `deepseek_pd.model.moe` imports them, so any import of this module sees every dispatcher
(as with `MOE_BACKENDS`). `dispatch_b` hands the experts topk ids in *local* expert ids,
-1 for pairs another rank computes; combine returns `[T, H]` in the original token order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.parallel import ExpertPlacement
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


DISPATCHERS: Registry[Dispatcher] = Registry("EP dispatcher")


@DISPATCHERS.register("local")
class LocalDispatcher:
    """World size 1: nothing moves; the halves only pass their inputs through (global ids are local)."""

    cuda_graph_safe = True  # nothing moves, nothing syncs

    def __init__(self, placement: ExpertPlacement | None = None) -> None:
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
