"""`ReplicaDispatch`: the router's logical top-k ids → physical expert slots, for one MoE layer.

A logical expert with n replicas (slots s_0 < ... < s_{n-1}, expert_location.py) sends token t of
this rank's batch to slot s_{(t + ep_rank) mod n}: deterministic (the same batch always routes the
same way, so runs are reproducible and CUDA graphs replay it), spread evenly over the replicas
within a batch, and shifted per rank so that every rank's first tokens do not all land on the
first replica. SGLang offers "static" (one fixed replica per rank, the local one when there is
one) and "random" (a random replica per token) for the same step; this is the deterministic form
of "random". Since replicas hold the same weights, the choice changes where a token is computed,
never its result.

Example: expert 5 in slots [3, 9], ep_rank 1, tokens 0..3 choosing it → slots 9, 3, 9, 3.

Two gathers on the device, no host sync.
"""
from __future__ import annotations

import torch

from deepseek_pd.model.eplb.expert_location import ExpertLocation


class ReplicaDispatch:
    def __init__(self, replicas: list[list[int]], ep_rank: int, device: torch.device | str) -> None:
        width = max(len(slots) for slots in replicas)
        table = [slots + [slots[0]] * (width - len(slots)) for slots in replicas]  # padding never chosen
        self.table = torch.tensor(table, dtype=torch.long, device=device)  # [logical, max replicas]
        self.num_replicas = torch.tensor([len(s) for s in replicas], dtype=torch.long, device=device)
        self.ep_rank = ep_rank

    @classmethod
    def for_layer(cls, location: ExpertLocation, layer_id: int, ep_rank: int,
                  device: torch.device | str) -> "ReplicaDispatch":
        return cls(location.replicas(layer_id), ep_rank, device)

    def __call__(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """`[T, k]` logical expert ids → `[T, k]` physical slot ids."""
        token = torch.arange(logical_ids.shape[0], device=logical_ids.device).unsqueeze(1) + self.ep_rank
        choice = token % self.num_replicas[logical_ids]
        return self.table[logical_ids, choice]
