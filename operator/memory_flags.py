"""The `deepseek-pd serve` flags of a role's `engineArgs` that change how much GPU memory a rank
needs, with the workers' defaults for those not given.

Read: `--dtype`, `--page-size`, `--num-pages`, `--max-total-tokens`, `--mem-fraction-static`,
`--ep-num-redundant-experts` (EPLB's extra expert slots, each rank holding (E + R) / ep) and
the engine options `fp8_backend`, `mem_headroom_gib`, `num_fused_shared_experts`, and for the
headroom's default (model/memory_headroom.py) `cuda_graph`, `cuda_graph_max_batch`,
`max_running_requests`, `record_expert_load` and the switch `--enable-tbo` (as
`--engine-opt KEY=VALUE`, or `--engine-opt=KEY=VALUE`). Other flags are left to the worker. A
value that does not parse raises `ValueError` naming the flag (the worker would refuse it too).

Example: `["--engine-opt", "fp8_backend=dequant", "--page-size=64"]` ->
`MemoryFlags(fp8_backend="dequant", page_size=64, ...)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from deepseek_pd.model.config import DTYPE_BYTES  # the --dtype choices: what a checkpoint may hold
from deepseek_pd.workers.engine_options import parse_bool

# The workers' defaults; tests/operator/test_memory_plan.py checks them against the worker code
# (model/kv_pool_sizing.py, model/runner.py), which the operator does not import (it needs torch).
DEFAULT_MEM_FRACTION_STATIC = 0.88
DEFAULT_MAX_RUNNING_REQUESTS = 128  # the decode batch cap, which the largest graph batch follows
DEFAULT_PAGE_SIZE = 16
FP8_BACKENDS = ("auto", "dequant", "torch", "triton")


@dataclass(frozen=True)
class MemoryFlags:
    dtype: str = "auto"
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float = DEFAULT_MEM_FRACTION_STATIC
    fp8_backend: str = "auto"
    mem_headroom_gib: float | None = None  # None: the default for the role's graphs (memory_plan.headroom_gib)
    num_fused_shared_experts: int = 0
    ep_num_redundant_experts: int = 0
    cuda_graph: bool | None = None  # None: the role's default
    cuda_graph_max_batch: int | None = None  # None: max_running_requests
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    record_expert_load: bool = False
    enable_tbo: bool = False

    @property
    def fixed_pool_tokens(self) -> int | None:
        """The KV pool's size when the flags fix it (whole pages), else None (sized by memory)."""
        if self.num_pages is not None:
            return self.num_pages * self.page_size
        if self.max_total_tokens is not None:
            return -(-self.max_total_tokens // self.page_size) * self.page_size
        return None


# Each flag's field and type, and each engine option's type; a value is parsed as `_convert` says.
_FLAGS: dict[str, tuple[str, type]] = {
    "--dtype": ("dtype", str), "--page-size": ("page_size", int), "--num-pages": ("num_pages", int),
    "--max-total-tokens": ("max_total_tokens", int),
    "--mem-fraction-static": ("mem_fraction_static", float),
    "--ep-num-redundant-experts": ("ep_num_redundant_experts", int),
}
_OPTIONS: dict[str, type] = {
    "fp8_backend": str, "mem_headroom_gib": float, "num_fused_shared_experts": int,
    "cuda_graph": bool, "cuda_graph_max_batch": int, "max_running_requests": int,
    "record_expert_load": bool,
}


def _convert(kind: type, raw: str) -> object:
    """`raw` as `kind`; a bool as `--engine-opt` parses one (workers/engine_options.py)."""
    return parse_bool(raw) if kind is bool else kind(raw)


_SWITCHES = {"--enable-tbo": "enable_tbo"}  # flags without a value


def _pairs(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """(flag, value) for every `--flag=value` and `--flag value` of the args we read."""
    found, index = [], 0
    while index < len(args):
        flag, sep, value = args[index].partition("=")
        if flag in _FLAGS or flag == "--engine-opt":
            if not sep:
                index += 1
                value = args[index] if index < len(args) else None
            found.append((flag, value))
        index += 1
    return found


def parse_memory_flags(args: Sequence[str]) -> MemoryFlags:
    """The memory-relevant flags of `args` over the worker defaults; ValueError on a bad value."""
    fields: dict[str, object] = {name: True for flag, name in _SWITCHES.items() if flag in args}
    for flag, value in _pairs(args):
        if value is None:
            raise ValueError(f"{flag} needs a value")
        if flag == "--engine-opt":
            key, _, raw = value.partition("=")
            if key not in _OPTIONS:
                continue
            name, kind, label = key, _OPTIONS[key], f"--engine-opt {key}"
        else:
            (name, kind), raw, label = _FLAGS[flag], value, flag
        try:
            fields[name] = _convert(kind, raw)
        except ValueError:
            raise ValueError(f"{label}={raw!r} is not a valid {kind.__name__}") from None
    flags = MemoryFlags(**fields)
    if flags.dtype not in ("auto", *DTYPE_BYTES):
        raise ValueError(f"--dtype {flags.dtype!r} is not one of auto, {', '.join(DTYPE_BYTES)}")
    if flags.fp8_backend not in FP8_BACKENDS:
        raise ValueError(f"--engine-opt fp8_backend={flags.fp8_backend!r} is not one of "
                         f"{', '.join(FP8_BACKENDS)}")
    if (flags.page_size < 1 or not 0 < flags.mem_fraction_static <= 1
            or (flags.mem_headroom_gib is not None and flags.mem_headroom_gib < 0)):
        raise ValueError("--page-size must be >= 1, --mem-fraction-static in (0, 1] and "
                         "mem_headroom_gib >= 0")
    for name in ("cuda_graph_max_batch", "max_running_requests"):
        if getattr(flags, name) is not None and getattr(flags, name) < 1:
            raise ValueError(f"--engine-opt {name} must be >= 1")
    if flags.ep_num_redundant_experts < 0:
        raise ValueError(f"--ep-num-redundant-experts must be >= 0, got {flags.ep_num_redundant_experts}")
    for name in ("num_pages", "max_total_tokens"):
        if getattr(flags, name) is not None and getattr(flags, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    return flags
