"""The EPLB planner: per-expert loads → a balanced `ExpertLocation` with R redundant slots.

A pure function of the loads (a dump's `logical_counts`), the EP size and R; per MoE layer:
1. replicate: R times, give one more replica to the expert with the largest load per replica
   (never more replicas than ranks, so each can sit on its own rank);
2. pack: the replicas, heaviest first (load / replicas each: replica_dispatch.py spreads an
   expert's tokens evenly over its replicas), each onto the rank with the least load so far
   that still has a free slot and does not hold that expert yet (longest-processing-time first,
   with the slot count per rank fixed at (N + R) / W);
3. keep the trivial placement (slot p = expert p % N) instead if it is at least as balanced (so
   the plan is never worse than not planning).
DeepSeek's EPLB adds group- and node-aware steps (hierarchical balancing); this is its flat form.

Balance is `imbalance(row, loads, W)`: the busiest rank's expected load over the mean (1.0 is
perfect), the rank load being the sum over its slots of load[expert] / replicas[expert].

Example: loads [10, 10, 10, 90], W = 2. R = 0 (2 slots per rank): ranks {0, 1} = 20 and
{2, 3} = 100 (imbalance 1.67) whatever the packing, since the hot expert shares a rank with one
other. R = 2 (3 slots per rank): expert 3 gets a second replica (45 each), then expert 0 (ties go
to the lower id): rank 0 {0, 1, 3} = 5 + 10 + 45 = 60, rank 1 {0, 2, 3} = 60: imbalance 1.0,
where the trivial row [0, 1, 2, 3, 0, 1] leaves rank 1 with 3, 0, 1 = 100 (1.67).
"""
from __future__ import annotations

from typing import Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.eplb.expert_location import ExpertLocation


def plan_location(counts: Sequence[Sequence[float]], moe_layer_ids: Sequence[int], ep_size: int,
                  num_redundant: int) -> ExpertLocation:
    """One planned row per MoE layer (rows of `counts` in `moe_layer_ids` order)."""
    if len(counts) != len(moe_layer_ids) or not counts:
        raise UserError(f"{len(counts)} rows of expert loads for {len(moe_layer_ids)} MoE layers")
    rows = tuple(tuple(plan_layer(loads, ep_size, num_redundant)) for loads in counts)
    return ExpertLocation(len(counts[0]), ep_size, tuple(moe_layer_ids), rows,
                          source=f"plan (ep_size {ep_size}, {num_redundant} redundant)")


def plan_layer(loads: Sequence[float], ep_size: int, num_redundant: int) -> list[int]:
    """physical slot → logical expert for one layer; slots r*S..r*S+S-1 are rank r's."""
    num_logical = len(loads)
    _check(num_logical, ep_size, num_redundant, loads)
    replicas = _replicate(loads, ep_size, num_redundant)
    planned = _pack(loads, replicas, ep_size, (num_logical + num_redundant) // ep_size)
    trivial = [p % num_logical for p in range(num_logical + num_redundant)]
    return planned if imbalance(planned, loads, ep_size) < imbalance(trivial, loads, ep_size) else trivial


def rank_loads(row: Sequence[int], loads: Sequence[float], ep_size: int) -> list[float]:
    """Each rank's expected load under placement `row` (replicas share their expert's load)."""
    copies = [0] * len(loads)
    for logical in row:
        copies[logical] += 1
    per_rank = len(row) // ep_size
    out = [0.0] * ep_size
    for slot, logical in enumerate(row):
        out[slot // per_rank] += loads[logical] / copies[logical]
    return out


def imbalance(row: Sequence[int], loads: Sequence[float], ep_size: int) -> float:
    """Busiest rank's load / mean rank load (1.0 when balanced or when there is no load)."""
    per_rank = rank_loads(row, loads, ep_size)
    mean = sum(per_rank) / ep_size
    return max(per_rank) / mean if mean > 0 else 1.0


def _check(num_logical: int, ep_size: int, num_redundant: int, loads: Sequence[float]) -> None:
    if num_logical < 1 or ep_size < 1 or num_redundant < 0:
        raise UserError(f"cannot plan {num_logical} experts over ep_size {ep_size} with {num_redundant} "
                        f"redundant slots")
    if (num_logical + num_redundant) % ep_size:
        raise UserError(f"{num_logical} experts + {num_redundant} redundant = {num_logical + num_redundant} "
                        f"slots are not divisible by ep_size {ep_size}")
    if any(load < 0 for load in loads):
        raise UserError("expert loads must be >= 0")


def _replicate(loads: Sequence[float], ep_size: int, num_redundant: int) -> list[int]:
    replicas = [1] * len(loads)
    for _ in range(num_redundant):
        # With more redundant slots than (ranks - 1) x experts a rank holds an expert twice.
        open_ = [e for e in range(len(loads)) if replicas[e] < ep_size] or list(range(len(loads)))
        hottest = max(open_, key=lambda e: (loads[e] / replicas[e], -e))
        replicas[hottest] += 1
    return replicas


def _pack(loads: Sequence[float], replicas: list[int], ep_size: int, per_rank: int) -> list[int]:
    items = sorted(((loads[e] / replicas[e], e) for e in range(len(loads)) for _ in range(replicas[e])),
                   key=lambda item: (-item[0], item[1]))
    rank_load = [0.0] * ep_size
    held: list[list[int]] = [[] for _ in range(ep_size)]
    for load, expert in items:
        free = [r for r in range(ep_size) if len(held[r]) < per_rank]
        apart = [r for r in free if expert not in held[r]] or free
        rank = min(apart, key=lambda r: (rank_load[r], len(held[r]), r))
        held[rank].append(expert)
        rank_load[rank] += load
    return [expert for slots in held for expert in sorted(slots)]
