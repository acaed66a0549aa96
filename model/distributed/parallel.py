"""Parallel placement: which rank this is, its process groups, and which experts it holds.

`ParallelInfo` is frozen and passed down constructors (`BuildOptions.parallel`); nothing reads a
global. Routed expert *slots* are sharded in contiguous blocks over the EP group; fused shared
experts and dense layers are replicated. Attention is data-parallel (every rank runs its own
tokens) unless `tp_size > 1`: then the `tp_size` ranks of `tp_group` run the same tokens with the
MLA heads split between them (model/attention/tensor_parallel.py; the layout of the ranks is in
workers/group/layout.py). Without redundant experts slot j holds routed expert j; with an `ExpertLocation`
(model/eplb/expert_location.py) there are n_routed + R slots per MoE layer, slot p holding
logical expert `location.row(layer)[p]`, and the ids the dispatchers see are slot ids (the router's
logical ids are mapped to slots first, model/eplb/replica_dispatch.py).

Example: 8 routed experts, 1 fused shared expert, ep_size 4, rank 2:
    local routed experts are global ids 4, 5 → local ids 0, 1
    the fused shared expert (global id 8) is local id 2 on every rank
    global id 7 is owned by rank 3; on rank 2 it is "not here" (-1)
With 4 redundant experts (12 slots, 3 per rank) rank 2 holds slots 6, 7, 8 → local ids 0, 1, 2,
whatever logical experts the location puts there, and the fused shared expert is global id 12.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.eplb.expert_location import ExpertLocation
from deepseek_pd.model.host_copy import upload


@dataclass(frozen=True)
class ParallelInfo:
    """EP size and rank and the `torch.distributed` group the dispatcher talks over; attention TP
    size and rank and the group its all-reduce / all-gather talk over.

    `group=None` means the default (world) group; it is only touched when `ep_size > 1`.
    `tp_group` is only touched when `tp_size > 1` (None then means the default group).
    """

    ep_size: int = 1
    ep_rank: int = 0
    group: Any = None  # torch.distributed.ProcessGroup | None
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None

    def __post_init__(self) -> None:
        if self.ep_size < 1:
            raise UserError(f"ep_size must be >= 1, got {self.ep_size}")
        if not 0 <= self.ep_rank < self.ep_size:
            raise UserError(f"ep_rank must be in [0, ep_size={self.ep_size}), got {self.ep_rank}")
        if self.tp_size < 1:
            raise UserError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise UserError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")

    @classmethod
    def from_group(cls, group: Any = None) -> "ParallelInfo":
        """Size and rank of an initialised process group (default: the world)."""
        import torch.distributed as dist
        if not dist.is_initialized():
            raise UserError("expert parallelism needs torch.distributed.init_process_group() first")
        return cls(dist.get_world_size(group), dist.get_rank(group), group)

    def min_over_ranks(self, values: list[int], device: torch.device | str = "cpu") -> list[int]:
        """Each of `values`' element-wise minimum over the EP ranks (one all-reduce; free when
        ep_size is 1). A maximum is the minimum of the negated values.

        Used for per-forward choices that change the collective sequence (two-batch overlap),
        which every rank must make the same way or the all-to-alls pair up wrongly and hang.
        """
        if self.ep_size == 1:
            return list(values)
        import torch.distributed as dist
        tensor = upload(torch.tensor(values, dtype=torch.int64), device)  # NCCL wants the GPU; pinned, per forward
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return tensor.tolist()


@dataclass(frozen=True)
class ExpertPlacement:
    """Where each expert of a MoE layer lives, for one rank. Built once per model.

    Global ids below `num_slots` are routed expert slots; the fused shared experts follow them."""

    num_routed: int  # logical routed experts (n_routed_experts)
    num_fused_shared: int
    parallel: ParallelInfo
    location: ExpertLocation | None = None  # None: slot j holds expert j, no replicas

    def __post_init__(self) -> None:
        loc = self.location
        if loc is None:
            if self.num_routed % self.parallel.ep_size:
                raise UserError(f"ep_size {self.parallel.ep_size} does not divide n_routed_experts "
                                f"{self.num_routed}: every EP rank must hold the same number of experts")
            return
        if loc.num_logical != self.num_routed or loc.ep_size != self.parallel.ep_size:
            raise UserError(f"expert location {loc.source} is for {loc.num_logical} experts over ep_size "
                            f"{loc.ep_size}; the model has {self.num_routed} over ep_size {self.parallel.ep_size}")

    @property
    def num_slots(self) -> int:
        """Routed expert slots of the whole group: n_routed_experts + redundant ones."""
        return self.num_routed if self.location is None else self.location.num_physical

    @property
    def num_local_routed(self) -> int:
        """Routed expert slots on each rank."""
        return self.num_slots // self.parallel.ep_size

    @property
    def first_local(self) -> int:
        return self.parallel.ep_rank * self.num_local_routed

    @property
    def num_local_experts(self) -> int:
        """Rows of this rank's stacked expert weights: its routed block, then the fused shared ones."""
        return self.num_local_routed + self.num_fused_shared

    def local_logical(self, layer_id: int) -> list[int]:
        """The logical expert each of this rank's routed slots holds in MoE layer `layer_id`
        (whose weights the loader copies there; a replicated expert appears more than once)."""
        slots = range(self.first_local, self.first_local + self.num_local_routed)
        if self.location is None:
            return list(slots)
        row = self.location.row(layer_id)
        return [row[p] for p in slots]

    def owner_rank(self, global_ids: torch.Tensor, source_rank: int) -> torch.Tensor:
        """Rank that computes each (token, expert) pair; fused shared experts stay on the token's rank."""
        routed = global_ids < self.num_slots
        return torch.where(routed, global_ids // self.num_local_routed, torch.full_like(global_ids, source_rank))

    def to_local(self, global_ids: torch.Tensor, dest_rank: int | torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        """Global ids → `dest_rank`'s local ids (dest_rank may broadcast per row); pairs `dest_rank`
        does not compute become -1, which the expert kernels skip."""
        local = torch.where(global_ids < self.num_slots, global_ids - dest_rank * self.num_local_routed,
                            global_ids - self.num_slots + self.num_local_routed)
        return torch.where(owner == dest_rank, local, torch.full_like(local, -1))
