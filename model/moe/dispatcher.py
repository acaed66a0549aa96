"""Token dispatch to experts and combine back, split in two halves each (a: send, b: receive) so a
two-batch-overlap schedule can run other work in between (DeepEP's `return_recv_hook` model).

Only the world-size-1 `local` dispatcher exists now: dispatch hands tokens to the local experts
unchanged, combine returns the experts' weighted sum. EP dispatchers (DeepEP normal/low-latency,
an all-to-all over torch.distributed) register here with the same four calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

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
    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Any: ...
    def dispatch_b(self, handle: Any) -> DispatchOutput: ...
    def combine_a(self, combine_input: CombineInput) -> Any: ...
    def combine_b(self, handle: Any) -> torch.Tensor: ...


DISPATCHERS: Registry[Dispatcher] = Registry("EP dispatcher")


@DISPATCHERS.register("local")
class LocalDispatcher:
    """World size 1: nothing moves; the halves only pass their inputs through."""

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> DispatchOutput:
        return DispatchOutput(hidden, topk_ids, topk_weights)

    def dispatch_b(self, handle: DispatchOutput) -> DispatchOutput:
        return handle

    def combine_a(self, combine_input: CombineInput) -> torch.Tensor:
        return combine_input.hidden

    def combine_b(self, handle: torch.Tensor) -> torch.Tensor:
        return handle
