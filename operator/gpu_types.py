"""How much memory one GPU of a deployment's nodes has, from the labels its pods are scheduled by.

NVIDIA's GPU feature discovery (part of the GPU operator) labels every GPU node with
`nvidia.com/gpu.product` (e.g. `NVIDIA-H200`, `NVIDIA-A100-SXM4-80GB`) and `nvidia.com/gpu.memory`
(MiB per GPU, e.g. `143771`). A deployment that pins its workers to a GPU type does so with one
of them in `scheduling.nodeSelector`, or in the required node affinity (`In` expressions; with
several values or terms the smallest GPU counts, since a pod may land on any of them). The memory
label is read as it is; a product is looked up in `GPU_MEMORY_GIB`, the total that CUDA reports
(`torch.cuda.mem_get_info`), which is what the workers' `--mem-fraction-static` multiplies.

Example: `nodeSelector: {nvidia.com/gpu.product: NVIDIA-H200}` -> GpuMemory("NVIDIA-H200",
139.8 GiB, "scheduling.nodeSelector"); no such label -> None (the plan cannot be checked).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

from deepseek_pd.units import GIB

PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
# Total memory CUDA reports per GPU (GiB), by the product label's model token; a little under the
# marketed size (141 GB for the H200), which counts the memory the driver keeps for itself.
GPU_MEMORY_GIB = {"H200": 139.8, "H20": 95.0, "H100": 79.1, "H800": 79.1, "A100-80GB": 79.1,
                  "A100-40GB": 39.4}


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory and where the operator learnt it."""

    name: str
    total_bytes: int
    source: str


def product_memory_bytes(product: str) -> int | None:
    """Bytes per GPU of a `nvidia.com/gpu.product` value, None for a product not in the table."""
    tokens = re.split(r"[-_ ]+", product.upper())
    if "NVL" in tokens and ("H100" in tokens or "H800" in tokens):
        return None  # the 94 GB NVL boards share the H100 name
    for model in ("H200", "H20", "H100", "H800"):
        if model in tokens:
            return int(GPU_MEMORY_GIB[model] * GIB)
    if "A100" in tokens:
        for size in ("80GB", "40GB"):
            if size in tokens:
                return int(GPU_MEMORY_GIB[f"A100-{size}"] * GIB)
    return None


def _from_labels(values: dict[str, list[str]], source: str) -> GpuMemory | None:
    """The smallest GPU the listed label values allow; None when any value is not understood."""
    found: list[GpuMemory] = []
    for value in values.get(MEMORY_LABEL, []):
        if not value.isdigit():
            return None
        found.append(GpuMemory(f"{value} MiB", int(value) << 20, source))
    if not found:
        for value in values.get(PRODUCT_LABEL, []):
            size = product_memory_bytes(value)
            if size is None:
                return None
            found.append(GpuMemory(value, size, source))
    return min(found, key=lambda g: g.total_bytes) if found else None


def _affinity_values(affinity: dict[str, Any]) -> Iterator[tuple[str, str]]:
    required = ((affinity.get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    for term in required.get("nodeSelectorTerms") or []:
        for expression in term.get("matchExpressions") or []:
            if expression.get("operator") == "In":
                for value in expression.get("values") or []:
                    yield expression.get("key", ""), str(value)


def gpu_memory(scheduling: dict[str, Any]) -> GpuMemory | None:
    """The GPU memory a deployment's `scheduling` pins its workers to, or None."""
    selector = scheduling.get("nodeSelector") or {}
    chosen = _from_labels({k: [str(v)] for k, v in selector.items()}, "scheduling.nodeSelector")
    if chosen:
        return chosen
    values: dict[str, list[str]] = {}
    for key, value in _affinity_values(scheduling.get("affinity") or {}):
        values.setdefault(key, []).append(value)
    return _from_labels(values, "scheduling.affinity")
