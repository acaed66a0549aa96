"""Random EPLB placements for tests: rows of `physical_to_logical_map` (model/eplb/expert_location.py)."""
from __future__ import annotations

import random


def random_placement(rng: random.Random, num_logical: int, redundant: int, num_layers: int) -> list[list[int]]:
    """Per layer: every expert once plus `redundant` random extra replicas, in random slots."""
    rows = []
    for _ in range(num_layers):
        row = list(range(num_logical)) + [rng.randrange(num_logical) for _ in range(redundant)]
        rng.shuffle(row)
        rows.append(row)
    return rows
