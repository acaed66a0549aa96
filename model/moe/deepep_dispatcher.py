"""`deepep` EP dispatcher: DeepEP (V1 API) normal mode for extend batches, low-latency for decode.

Registered only when `import deep_ep` works (a CUDA build with NVSHMEM). It cannot run on the CPU
test machine, so no test covers it here; it is written from DeepEP's V1 interface (FACTS.md) and
follows the same four-call contract as `all_to_all`, which the multi-process tests check:

    normal       get_dispatch_layout + dispatch (async_finish; the CPU waits for the counts inside
                 dispatch, so it is not CUDA-graph safe) → local ids with -1 for other ranks' pairs;
                 the experts weight their output by the received weights; combine sums per token.
    low-latency  low_latency_dispatch(return_recv_hook=True) only sends; the hook, called in
                 dispatch_b, receives into a masked `[local_experts, max_tokens*ranks, H]` layout,
                 flattened here into rows with one local expert id each (-1 for padding rows) and
                 weight 1; low_latency_combine applies the top-k weights itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.moe.dispatcher import DISPATCHERS, CombineInput, DispatchOutput
from deepseek_pd.model.parallel import ExpertPlacement

try:
    import deep_ep  # type: ignore[import-not-found]
except (ImportError, OSError):  # not installed, or its CUDA/NVSHMEM libraries are missing: not offered
    deep_ep = None

# Low-latency mode pre-sizes its RDMA buffers for this many tokens per rank (SGLang's default).
LOW_LATENCY_MAX_TOKENS_PER_RANK = 128


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
class _Route:
    low_latency: bool
    deep_ep_handle: Any
    shape: tuple[int, ...] = ()
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None


class DeepEPDispatcher:
    def __init__(self, placement: ExpertPlacement) -> None:
        if placement.num_fused_shared:
            raise UserError("the deepep dispatcher does not support fused shared experts; "
                            "set num_fused_shared_experts=0")
        self.placement = placement
        self.group = placement.parallel.group
        self.num_ranks = placement.parallel.ep_size
        self._buffer: Any = None

    def _buffer_for(self, hidden: torch.Tensor) -> Any:
        if self._buffer is None:  # sized on first use, when the hidden width and dtype are known
            hidden_bytes = hidden.shape[-1] * max(hidden.element_size(), 2)
            nvl_bytes = rdma_bytes = 0
            for config in (deep_ep.Buffer.get_dispatch_config(self.num_ranks),
                           deep_ep.Buffer.get_combine_config(self.num_ranks)):
                nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, self.num_ranks))
                rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, self.num_ranks))
            rdma_bytes = max(rdma_bytes, deep_ep.Buffer.get_low_latency_rdma_size_hint(
                LOW_LATENCY_MAX_TOKENS_PER_RANK, hidden.shape[-1], self.num_ranks, self.placement.num_slots))
            self._buffer = deep_ep.Buffer(self.group, nvl_bytes, rdma_bytes, low_latency_mode=True,
                                          num_qps_per_rank=max(1, self.placement.num_local_routed))
        return self._buffer

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   mode: ForwardMode | None = None) -> Any:
        buffer = self._buffer_for(hidden)
        ids = topk_ids.to(torch.int64)
        if mode is ForwardMode.DECODE:
            if hidden.shape[0] > LOW_LATENCY_MAX_TOKENS_PER_RANK:
                raise UserError(f"decode batch of {hidden.shape[0]} tokens exceeds DeepEP low-latency capacity "
                                f"{LOW_LATENCY_MAX_TOKENS_PER_RANK} per rank")
            recv_x, recv_count, handle, _event, hook = buffer.low_latency_dispatch(
                hidden, ids, LOW_LATENCY_MAX_TOKENS_PER_RANK, self.placement.num_slots, use_fp8=False,
                async_finish=False, return_recv_hook=True)
            return _LowLatencyHandle(recv_x, recv_count, handle, hook, ids, topk_weights.float())
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, self.placement.num_slots)
        recv_x, recv_ids, recv_weights, _counts, handle, event = buffer.dispatch(
            hidden, topk_idx=ids, topk_weights=topk_weights.float(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            async_finish=True)
        return _NormalHandle((recv_x, recv_ids, recv_weights), handle, event)

    def dispatch_b(self, handle: Any) -> DispatchOutput:
        if isinstance(handle, _NormalHandle):
            handle.event.current_stream_wait()
            recv_x, recv_ids, recv_weights = handle.recv
            return DispatchOutput(recv_x, recv_ids.long(), recv_weights, _Route(False, handle.handle))
        handle.hook()  # receive
        num_local, max_rows, width = handle.recv_x.shape
        rows = torch.arange(max_rows, device=handle.recv_x.device)
        experts = torch.arange(num_local, device=handle.recv_x.device)[:, None].expand(-1, max_rows)
        ids = torch.where(rows[None, :] < handle.recv_count[:, None], experts, torch.full_like(experts, -1))
        route = _Route(True, handle.handle, (num_local, max_rows, width), handle.topk_ids, handle.topk_weights)
        return DispatchOutput(handle.recv_x.reshape(-1, width), ids.reshape(-1, 1),
                              torch.ones(num_local * max_rows, 1, device=ids.device), route)

    def combine_a(self, combine_input: CombineInput) -> Any:
        route: _Route = combine_input.handle
        buffer = self._buffer
        if route.low_latency:
            combined, _event, hook = buffer.low_latency_combine(
                combine_input.hidden.view(route.shape), route.topk_ids, route.topk_weights, route.deep_ep_handle,
                async_finish=False, return_recv_hook=True)
            return combined, hook
        combined, _, event = buffer.combine(combine_input.hidden, route.deep_ep_handle, async_finish=True)
        return combined, event.current_stream_wait

    def combine_b(self, handle: Any) -> torch.Tensor:
        combined, finish = handle
        finish()
        return combined


if deep_ep is not None:
    DISPATCHERS.register("deepep")(DeepEPDispatcher)
