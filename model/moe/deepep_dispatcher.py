"""`deepep` EP dispatcher: DeepEP (V1 API) normal and low-latency layouts, picked per step by the
`DispatchConfig.mode` (`model/distributed/dispatch_mode.py`: `auto` is normal for extend steps, low-latency for decode).

Registered only when `import deep_ep` works (a CUDA build with NVSHMEM). Written from DeepEP's V1
interface (FACTS.md); tests/model/moe/test_deepep_fake.py runs it on the CPU against an in-process
fake `deep_ep` at world size 1, and the multi-process tests check the same four-call contract on
`all_to_all`:

    normal       get_dispatch_layout + dispatch (async_finish; the CPU waits for the counts inside
                 dispatch, so it is not CUDA-graph safe) → local ids with -1 for other ranks' pairs;
                 the experts weight their output by the received weights; combine sums per token.
    low-latency  low_latency_dispatch(return_recv_hook=True) only sends; the hook, called in
                 dispatch_b, receives into a masked `[local_experts, max_tokens*ranks, H]` layout,
                 flattened (`masked_layout.py`) into rows with one local expert id each (-1 for
                 padding rows) and weight 1; low_latency_combine applies the top-k weights itself.

One `deep_ep.Buffer` serves both layouts. DeepEP requires its low-latency part to be zeroed
(`clean_low_latency_buffer`) after normal kernels ran and before the next low-latency one: `enter`
does it on every switch from normal to low-latency, also before a CUDA-graph replay
(`prepare_step`), as SGLang's `DeepEPBuffer.set_dispatch_mode_as_low_latency` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.distributed.dispatch_mode import DispatchConfig, DispatchMode
from deepseek_pd.model.moe.dispatcher import (DISPATCHERS, CombineInput, DispatchOutput,
                                              LayoutSwitchingDispatcher)
from deepseek_pd.model.moe.masked_layout import flatten_masked
from deepseek_pd.model.distributed.parallel import ExpertPlacement

try:
    import deep_ep  # type: ignore[import-not-found]
except (ImportError, OSError):  # not installed, or its CUDA/NVSHMEM libraries are missing: not offered
    deep_ep = None


class _SharedBuffer:
    """The one `deep_ep.Buffer` of a model, sized on first use (when the hidden width is known)."""

    def __init__(self, placement: ExpertPlacement, config: DispatchConfig) -> None:
        self.placement = placement
        self.config = config
        self.buffer: Any = None
        self.hidden_size = 0

    def get(self, hidden: torch.Tensor) -> Any:
        if self.buffer is None:
            self.buffer = self._create(hidden)
            self.hidden_size = hidden.shape[-1]
        return self.buffer

    def _create(self, hidden: torch.Tensor) -> Any:
        num_ranks, low_latency = self.placement.parallel.ep_size, self.config.mode.uses_low_latency
        hidden_bytes = hidden.shape[-1] * max(hidden.element_size(), 2)
        nvl_bytes = rdma_bytes = 0
        for config in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)):
            nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
            rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
        if low_latency:
            rdma_bytes = max(rdma_bytes, deep_ep.Buffer.get_low_latency_rdma_size_hint(
                self.config.low_latency_max_tokens, hidden.shape[-1], num_ranks, self.placement.num_slots))
        return deep_ep.Buffer(self.placement.parallel.group, nvl_bytes, rdma_bytes, low_latency_mode=low_latency,
                              num_qps_per_rank=max(1, self.placement.num_local_routed) if low_latency else 1)

    def clean_low_latency(self) -> None:
        if self.buffer is not None:  # a fresh buffer starts clean
            self.buffer.clean_low_latency_buffer(self.config.low_latency_max_tokens, self.hidden_size,
                                                 self.placement.num_slots)


@dataclass
class _NormalHandle:
    recv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    handle: Any
    event: Any


@dataclass
class _LowLatencyHandle:
    recv_x: torch.Tensor  # [L, M, H]
    recv_count: torch.Tensor  # [L]
    handle: Any
    hook: Any
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


@dataclass
class _LowLatencyRoute:
    deep_ep_handle: Any
    shape: tuple[int, ...]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


@dataclass
class _Combining:
    combined: torch.Tensor
    wait: Callable[[], None]  # the normal layout's event wait, or the low-latency receive hook


class _DeepEPLayout:
    """What both layouts share: the buffer, and a `combine_b` that waits in the layout's own way."""

    def __init__(self, shared: _SharedBuffer) -> None:
        self.shared = shared

    def combine_b(self, handle: _Combining) -> torch.Tensor:
        handle.wait()
        return handle.combined


class _NormalDeepEP(_DeepEPLayout):
    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> _NormalHandle:
        buffer = self.shared.get(hidden)
        ids = topk_ids.to(torch.int64)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            ids, self.shared.placement.num_slots)
        recv_x, recv_ids, recv_weights, _counts, handle, event = buffer.dispatch(
            hidden, topk_idx=ids, topk_weights=topk_weights.float(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            async_finish=True)
        return _NormalHandle((recv_x, recv_ids, recv_weights), handle, event)

    def dispatch_b(self, handle: _NormalHandle) -> DispatchOutput:
        handle.event.current_stream_wait()
        recv_x, recv_ids, recv_weights = handle.recv
        return DispatchOutput(recv_x, recv_ids.long(), recv_weights, handle.handle)

    def combine_a(self, combine_input: CombineInput) -> _Combining:
        combined, _, event = self.shared.buffer.combine(combine_input.hidden, combine_input.handle, async_finish=True)
        return _Combining(combined, event.current_stream_wait)


class _LowLatencyDeepEP(_DeepEPLayout):
    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> _LowLatencyHandle:
        config = self.shared.config
        config.check_capacity(hidden.shape[0])
        ids = topk_ids.to(torch.int64)
        recv_x, recv_count, handle, _event, hook = self.shared.get(hidden).low_latency_dispatch(
            hidden, ids, config.low_latency_max_tokens, self.shared.placement.num_slots, use_fp8=False,
            async_finish=False, return_recv_hook=True)
        return _LowLatencyHandle(recv_x, recv_count, handle, hook, ids, topk_weights.float())

    def dispatch_b(self, handle: _LowLatencyHandle) -> DispatchOutput:
        handle.hook()  # receive
        route = _LowLatencyRoute(handle.handle, tuple(handle.recv_x.shape), handle.topk_ids, handle.topk_weights)
        return flatten_masked(handle.recv_x, handle.recv_count, route)

    def combine_a(self, combine_input: CombineInput) -> _Combining:
        route: _LowLatencyRoute = combine_input.handle
        combined, _event, hook = self.shared.buffer.low_latency_combine(
            combine_input.hidden.view(route.shape), route.topk_ids, route.topk_weights, route.deep_ep_handle,
            async_finish=False, return_recv_hook=True)
        return _Combining(combined, hook)


class DeepEPDispatcher(LayoutSwitchingDispatcher):
    # DeepEP's low-latency kernels with return_recv_hook neither allocate by count nor read back to
    # the host; the flattening in dispatch_b is device-only.
    low_latency_cuda_graph_safe = True

    def __init__(self, placement: ExpertPlacement, config: DispatchConfig = DispatchConfig()) -> None:
        if placement.num_fused_shared:
            raise UserError("the deepep dispatcher does not support fused shared experts; "
                            "set num_fused_shared_experts=0")
        self.placement = placement
        self._shared = _SharedBuffer(placement, config)
        self._current = DispatchMode.LOW_LATENCY  # a fresh buffer's low-latency part is clean
        super().__init__(config, _NormalDeepEP(self._shared), _LowLatencyDeepEP(self._shared))

    def enter(self, layout: DispatchMode) -> None:
        if layout is DispatchMode.LOW_LATENCY and self._current is DispatchMode.NORMAL:
            self._shared.clean_low_latency()
        self._current = layout


if deep_ep is not None:
    DISPATCHERS.register("deepep")(DeepEPDispatcher)
