"""What of a role's `engineArgs` changes how much GPU memory a rank needs.

The flags are parsed by the serve contract itself (workers/serve/flags.py), exactly as the worker
will parse them, with the contract's defaults: `--dtype`, `--page-size`, `--num-pages`,
`--max-total-tokens`, `--mem-fraction-static`, `--gpu-workers`, `--kv-share`,
and `--ep-num-redundant-experts` (EPLB's extra expert slots, each rank holding (E + R) / ep). From
the engine options, as the worker reads them (`ServeFlags.all_engine_options`: the `--engine-opt
KEY=VALUE` items and the flags that spell one, such as `--enable-tbo`), it reads `fp8_backend`,
`mem_headroom_gib`, `num_fused_shared_experts`, `enable_tbo`, `speculative_num_steps` (> 0 loads
the MTP layer, its weights and a pool layer more of KV), and for the headroom's default
(model/kv/memory_headroom.py) `cuda_graph`, `cuda_graph_max_batch`, `max_running_requests` and
`record_expert_load`, and `mooncake_staging_tokens` (the staging area a decode worker over
Mooncake allocates, workers/serve/kv_staging.py); the others are the worker's business. Anything the worker would refuse
raises `ValueError` naming the flag: what `serve` refuses from its flags alone in its own words
(workers/serve/flag_rules.py `check_flags`, the one rule set: the memory settings' ranges are
model/runner_rules.py `sizing_blocker`, the engine options' the configs' own bounds, deepseek_pd/bounds.py,
which the configs apply too; `--dtype` is one of the serve contract's choices, model/config.py `DTYPE_CHOICES`).

Example: `parse_memory_flags("decode", ["--engine-opt", "fp8_backend=dequant", "--page-size=64"])`
-> `MemoryFlags(serve=ServeFlags(role="decode", page_size=64, ...), fp8_backend="dequant", ...)`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.memory_budget import DEFAULT_MAX_RUNNING_REQUESTS
from deepseek_pd.model.kv.page_size import LARGEST_AUTO_PAGE_SIZE
from deepseek_pd.model.kv.staging_size import DEFAULT_STAGING_TOKENS
from deepseek_pd.workers.serve.engine_options import parse_engine_options
from deepseek_pd.workers.serve.flag_rules import check_flags
from deepseek_pd.workers.serve.flags import ServeFlags


@dataclass(frozen=True)
class MemoryFlags:
    """A role's serve flags, and the engine options that size a rank's memory ("unset" as None)."""

    serve: ServeFlags
    fp8_backend: str = "auto"
    mem_headroom_gib: float | None = None  # None: the default for the role's graphs (memory_plan.headroom_gib)
    num_fused_shared_experts: int = 0
    cuda_graph: bool | None = None  # None: the role's default
    cuda_graph_max_batch: int | None = None  # None: max_running_requests
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    record_expert_load: bool = False
    enable_tbo: bool = False
    speculative_num_steps: int = 0
    mooncake_staging_tokens: int = DEFAULT_STAGING_TOKENS

    @property
    def mtp(self) -> bool:
        """Whether the worker builds the MTP layer (model/runner.py: speculative_num_steps > 0)."""
        return self.speculative_num_steps > 0

    @property
    def page_size(self) -> int:
        """`--page-size`, else the largest page the worker's own default can be (model/kv/page_size.py:
        64 where FlashMLA can run, which the operator cannot see), so a plan never counts less KV than
        the worker allocates."""
        return self.serve.page_size if self.serve.page_size is not None else LARGEST_AUTO_PAGE_SIZE

    @property
    def fixed_pool_tokens(self) -> int | None:
        """The KV pool's size when the flags fix it (whole pages), else None (sized by memory)."""
        serve = self.serve
        if serve.num_pages is not None:
            return serve.num_pages * self.page_size
        if serve.max_total_tokens is not None:
            return -(-serve.max_total_tokens // self.page_size) * self.page_size
        return None


def parse_memory_flags(role: str, args: Sequence[str]) -> MemoryFlags:
    """`args` (a role's engineArgs) as the worker parses them; ValueError on a bad value."""
    serve = ServeFlags.from_argv([role, *args])
    try:
        check_flags(serve)  # what `serve` refuses from its flags alone, in its words (the option keys too)
        options = parse_engine_options(serve.all_engine_options)
    except UserError as exc:
        raise ValueError(str(exc)) from None
    read = {spec.name for spec in dataclasses.fields(MemoryFlags)} - {"serve"}
    return MemoryFlags(serve, **{key: value for key, value in options.items() if key in read})
