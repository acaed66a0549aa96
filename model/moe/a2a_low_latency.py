"""The low-latency (masked) EP layout over `torch.distributed` all-to-alls: DeepEP's
`low_latency_dispatch` / `low_latency_combine` contract with fixed shapes.

C = `low_latency_max_tokens` (tokens per rank per step, the same on every rank), W ranks, L local
experts per rank (routed slots + fused shared), k = top-k, H hidden. Every all-to-all has equal
splits whatever the batch, so nothing is counted or read on the host: the path is capturable.

    dispatch_a  refuses T > C tokens (T is a shape, known without a sync); pads the tokens to C
                rows and sends each rank d the C rows plus their `[C, k]` local expert ids on d
                (-1: a pair another rank computes, or a padding row).
    dispatch_b  waits and packs, on the device, the masked layout: `recv_x [L, W*C, H]` holds local
                expert l's rows first (by source rank, then token), `recv_count [L]` how many;
                rows past the count are zero. The experts see it flattened, one local id per
                row (-1 past the count) and weight 1 ("masked" experts).
    combine_a   unpacks each expert's output rows back to `[W, L, C, H]` (source rank, local
                expert, token) and sends each source rank its block.
    combine_b   waits and sums, per token, `w_j * out[owner_j, local_j, t]` over its top-k: the
                top-k weights are applied here, as DeepEP's low-latency combine does.

Example: W=2, 4 routed experts (L=2), C=2. Rank 0 has t0 → {1, 2}, t1 → {0, 1}; rank 1 has
u0 → {1, 3}. Rank 0 receives expert 0: [t1] (count 1), expert 1: [t0, t1, u0] (count 3), in a
`[2, 4, H]` tensor; rank 1 receives expert 2 (its local 0): [t0], expert 3: [u0].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepseek_pd.model.distributed.dispatch_mode import DispatchConfig
from deepseek_pd.model.moe.dispatcher import CombineInput, DispatchOutput
from deepseek_pd.model.moe.masked_layout import flatten_masked
from deepseek_pd.model.distributed.parallel import ExpertPlacement


@dataclass
class MaskedRoute:
    """The masked layout of one dispatch and what combine needs to send rows back and weight them."""

    recv_x: torch.Tensor  # [L, W*C, H]
    recv_count: torch.Tensor  # [L] long
    hit: torch.Tensor  # [L, W*C] bool: received row (source rank, token) is for local expert l
    slot: torch.Tensor  # [L, W*C] long: its row in recv_x[l] (where hit)
    gather_index: torch.Tensor  # [T, k] long: row of each (token, choice) in combine's received block
    topk_weights: torch.Tensor  # [T, k] fp32
    dtype: torch.dtype


@dataclass
class _Dispatching:
    works: list[Any]
    recv_rows: torch.Tensor  # [W*C, H]
    recv_ids: torch.Tensor  # [W*C, k]
    gather_index: torch.Tensor
    topk_weights: torch.Tensor
    sending: tuple[torch.Tensor, ...]  # kept alive until the receive side waited


@dataclass
class _Combining:
    work: Any
    returned: torch.Tensor  # [W*L*C, H]
    route: MaskedRoute
    sending: torch.Tensor


class LowLatencyAllToAll:
    """One layout of the `all_to_all` dispatcher (ep_dispatcher.py); see the module docstring."""

    def __init__(self, dist: Any, placement: ExpertPlacement, config: DispatchConfig) -> None:
        self._dist = dist
        self.placement = placement
        self.config = config
        self.group = placement.parallel.group
        self.rank = placement.parallel.ep_rank
        self.size = placement.parallel.ep_size
        self.capacity = config.low_latency_max_tokens
        self.num_local = placement.num_local_experts

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> _Dispatching:
        num_tokens, top_k = topk_ids.shape
        # Before any collective, but on this rank's tokens only: a rank over the capacity fails alone
        # and the lockstep thread ends the group (serve sizes the capacity so no step gets here).
        self.config.check_capacity(num_tokens)
        size, cap, device = self.size, self.capacity, hidden.device
        owner = self.placement.owner_rank(topk_ids, self.rank)  # [T, k]
        ranks = torch.arange(size, device=device).view(size, 1, 1)
        local_on = self.placement.to_local(topk_ids.unsqueeze(0), ranks, owner.unsqueeze(0))  # [W, T, k]
        send_ids = torch.full((size, cap, top_k), -1, dtype=torch.long, device=device)
        send_ids[:, :num_tokens] = local_on
        send_rows = hidden.new_zeros(size, cap, hidden.shape[-1])
        send_rows[:, :num_tokens] = hidden
        send_rows, send_ids = send_rows.view(size * cap, -1), send_ids.view(size * cap, top_k)
        recv_rows, recv_ids = torch.empty_like(send_rows), torch.empty_like(send_ids)
        works = [self._dist.all_to_all_single(recv_rows, send_rows, group=self.group, async_op=True),
                 self._dist.all_to_all_single(recv_ids, send_ids, group=self.group, async_op=True)]
        # Where each (token, choice)'s output will sit in combine's received [W, L, C] block.
        own_local = self.placement.to_local(topk_ids, owner, owner)
        tokens = torch.arange(num_tokens, device=device).unsqueeze(-1)
        gather_index = (owner * self.num_local + own_local) * cap + tokens
        return _Dispatching(works, recv_rows, recv_ids, gather_index, topk_weights.float(), (send_rows, send_ids))

    def dispatch_b(self, handle: _Dispatching) -> DispatchOutput:
        for work in handle.works:
            work.wait()
        rows, width = handle.recv_rows.shape
        experts = torch.arange(self.num_local, device=handle.recv_ids.device)
        hit = (handle.recv_ids.unsqueeze(0) == experts.view(-1, 1, 1)).any(dim=-1)  # [L, W*C]
        slot = hit.long().cumsum(dim=1) - 1
        recv_count = hit.sum(dim=1)
        # source[l, s] = received row in slot s of expert l; slots past the count take a zero row.
        source = torch.full((self.num_local, rows + 1), rows, dtype=torch.long, device=experts.device)
        source.scatter_(1, torch.where(hit, slot, rows), torch.arange(rows, device=experts.device).expand_as(slot))
        padded = torch.cat([handle.recv_rows, handle.recv_rows.new_zeros(1, width)])
        recv_x = padded[source[:, :rows]]  # [L, W*C, H]
        route = MaskedRoute(recv_x, recv_count, hit, slot, handle.gather_index, handle.topk_weights,
                            handle.recv_rows.dtype)
        return flatten_masked(recv_x, recv_count, route)

    def combine_a(self, combine_input: CombineInput) -> _Combining:
        route: MaskedRoute = combine_input.handle
        num_local, rows, width = route.recv_x.shape
        out = combine_input.hidden.reshape(num_local, rows, width)
        back = out.gather(1, route.slot.clamp(min=0).unsqueeze(-1).expand(-1, -1, width))
        back = torch.where(route.hit.unsqueeze(-1), back, 0)  # [L, W*C, H] by (source rank, token)
        sending = back.view(num_local, self.size, self.capacity, width).transpose(0, 1).reshape(-1, width)
        returned = torch.empty_like(sending)
        work = self._dist.all_to_all_single(returned, sending, group=self.group, async_op=True)
        return _Combining(work, returned, route, sending)

    def combine_b(self, handle: _Combining) -> torch.Tensor:
        handle.work.wait()
        route = handle.route
        num_tokens, top_k = route.gather_index.shape
        width = handle.returned.shape[-1]
        picked = handle.returned[route.gather_index.reshape(-1)].view(num_tokens, top_k, width).float()
        return (picked * route.topk_weights.unsqueeze(-1)).sum(dim=1).to(route.dtype)
