"""`all_to_all` EP dispatcher: DeepEP's two layouts over `torch.distributed`.

Works on any backend with `all_to_all_single` (gloo on CPU, NCCL on GPU). Each step runs in the
layout its `DispatchConfig.mode` picks (`model/distributed/dispatch_mode.py`): the low-latency (masked, fixed
capacity) layout is `a2a_low_latency.py`; the normal layout, for one MoE layer, is:

    dispatch_a  each token is sent once to every rank that owns one of its experts (fused shared
                experts are computed on the token's own rank), with its top-k ids rewritten to the
                destination's local ids (-1 for the pairs another rank computes) and its weights.
                The per-destination counts are exchanged first (a small blocking all-to-all: the
                receive buffers need their sizes); the payload all-to-alls start asynchronously.
    dispatch_b  waits for the payload: the received tokens, local ids and weights.
    combine_a   sends each received token's weighted expert output back (asynchronously).
    combine_b   waits and sums the partial outputs of every token into the original order.

Example, 2 ranks, 4 routed experts (rank 0: 0-1, rank 1: 2-3), top-2, rank 0 has tokens t0 → {1, 2}
and t1 → {0, 1}: rank 0 sends t0, t1 to itself (ids [1, -1], [0, 1]) and t0 to rank 1 (ids
[-1, 0]); combine adds t0's two partial sums back together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.moe.a2a_low_latency import LowLatencyAllToAll
from deepseek_pd.model.distributed.dispatch_mode import DispatchConfig
from deepseek_pd.model.moe.dispatcher import (DISPATCHERS, CombineInput, DispatchOutput,
                                              LayoutSwitchingDispatcher)
from deepseek_pd.model.distributed.parallel import ExpertPlacement


@dataclass
class RouteBack:
    """What combine needs to return rows to their tokens (the dispatch's layout, reversed)."""

    send_token_index: torch.Tensor  # [N_send] source token of each sent row, grouped by destination
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    num_tokens: int
    dtype: torch.dtype


@dataclass
class DispatchInFlight:
    works: list[Any]
    recv_hidden: torch.Tensor
    recv_meta: torch.Tensor  # [N_recv, 2k] fp32: local ids (exact in fp32) then weights
    top_k: int
    route: RouteBack
    sending: tuple[torch.Tensor, ...]  # send buffers stay referenced until the receive side waited


@dataclass
class CombineInFlight:
    work: Any
    returned: torch.Tensor  # [N_send, H]
    route: RouteBack
    sending: torch.Tensor


@DISPATCHERS.register("all_to_all")
class AllToAllDispatcher(LayoutSwitchingDispatcher):
    low_latency_cuda_graph_safe = True  # a2a_low_latency.py: equal splits, nothing read on the host

    def __init__(self, placement: ExpertPlacement, config: DispatchConfig = DispatchConfig()) -> None:
        import torch.distributed as dist
        parallel = placement.parallel
        if not dist.is_available() or not dist.is_initialized():
            raise UserError("the all_to_all dispatcher needs torch.distributed.init_process_group() first")
        group_size = dist.get_world_size(parallel.group)
        if group_size != parallel.ep_size or dist.get_rank(parallel.group) != parallel.ep_rank:
            raise UserError(f"EP group has size {group_size} and rank {dist.get_rank(parallel.group)}, "
                            f"but ep_size={parallel.ep_size}, ep_rank={parallel.ep_rank} were asked for")
        super().__init__(config, NormalAllToAll(dist, placement), LowLatencyAllToAll(dist, placement, config))
        self.placement = placement


class NormalAllToAll:
    """The normal layout (the module docstring); the host waits for the per-rank counts."""

    def __init__(self, dist: Any, placement: ExpertPlacement) -> None:
        self._dist = dist
        self.placement = placement
        self.group = placement.parallel.group
        self.rank = placement.parallel.ep_rank
        self.size = placement.parallel.ep_size

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> DispatchInFlight:
        num_tokens, top_k = topk_ids.shape
        owner = self.placement.owner_rank(topk_ids, self.rank)  # [T, k]
        ranks = torch.arange(self.size, device=topk_ids.device)
        in_rank = (owner.unsqueeze(-1) == ranks).any(dim=1)  # [T, W]
        # nonzero over [W, T] lists rows grouped by destination rank, tokens in order inside
        dest_of_row, token_of_row = in_rank.t().nonzero(as_tuple=True)
        send_counts = in_rank.sum(dim=0)
        local_ids = self.placement.to_local(topk_ids[token_of_row], dest_of_row.unsqueeze(-1), owner[token_of_row])
        weights = topk_weights[token_of_row].float().masked_fill(local_ids < 0, 0.0)
        send_meta = torch.cat([local_ids.float(), weights], dim=1)
        send_hidden = hidden[token_of_row].contiguous()

        recv_counts = torch.empty_like(send_counts)
        self._dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        num_recv = sum(recv_splits)
        recv_hidden = hidden.new_empty(num_recv, hidden.shape[-1])
        recv_meta = send_meta.new_empty(num_recv, 2 * top_k)
        works = [
            self._dist.all_to_all_single(recv_hidden, send_hidden, recv_splits, send_splits, group=self.group,
                                         async_op=True),
            self._dist.all_to_all_single(recv_meta, send_meta, recv_splits, send_splits, group=self.group,
                                         async_op=True),
        ]
        route = RouteBack(token_of_row, send_splits, recv_splits, num_tokens, hidden.dtype)
        return DispatchInFlight(works, recv_hidden, recv_meta, top_k, route, (send_hidden, send_meta))

    def dispatch_b(self, handle: DispatchInFlight) -> DispatchOutput:
        for work in handle.works:
            work.wait()
        ids = handle.recv_meta[:, :handle.top_k].long()
        weights = handle.recv_meta[:, handle.top_k:]
        return DispatchOutput(handle.recv_hidden, ids, weights, handle.route)

    def combine_a(self, combine_input: CombineInput) -> CombineInFlight:
        route: RouteBack = combine_input.handle
        outputs = combine_input.hidden.contiguous()
        returned = outputs.new_empty(len(route.send_token_index), outputs.shape[-1])
        work = self._dist.all_to_all_single(returned, outputs, route.send_splits, route.recv_splits,
                                            group=self.group, async_op=True)
        return CombineInFlight(work, returned, route, outputs)

    def combine_b(self, handle: CombineInFlight) -> torch.Tensor:
        handle.work.wait()
        route = handle.route
        out = torch.zeros(route.num_tokens, handle.returned.shape[-1], dtype=torch.float32,
                          device=handle.returned.device)
        out.index_add_(0, route.send_token_index, handle.returned.float())
        return out.to(route.dtype)
