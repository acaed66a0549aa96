"""The activation and CUDA-graph headroom a worker keeps inside its memory budget
(model/kv/pool_sizing.py) when `mem_headroom_gib` is not given. Torch-free: the operator's memory
plan (operator/memory_plan.py) applies the same rule.

2 GiB is the headroom at a captured decode batch of up to REFERENCE_GRAPH_BATCH (128, the default
batch cap). The activations a captured graph keeps in its memory pool (hidden states, MoE rows,
logits) grow with its batch, so above that the default grows in proportion (an upper-bound rule,
not a measurement: the eager activations inside the 2 GiB do not grow with it):

    default_headroom_gib(0)   = 2.0   (no graphs: prefill, or cuda_graph=false)
    default_headroom_gib(128) = 2.0
    default_headroom_gib(512) = 8.0
"""
from __future__ import annotations

BASE_HEADROOM_GIB = 2.0
REFERENCE_GRAPH_BATCH = 128


def default_headroom_gib(graph_max_batch: int) -> float:
    """The headroom for a worker whose largest captured decode batch is `graph_max_batch` (0: none)."""
    return BASE_HEADROOM_GIB * max(1.0, graph_max_batch / REFERENCE_GRAPH_BATCH)
