"""What a worker's role changes in its configuration: the one table of per-role defaults.

- `decodes`: a decode worker runs the decode loop, which is small and launch-bound, so on CUDA it
  replays CUDA graphs by default (`--engine-opt cuda_graph=false` turns them off). A prefill worker
  only runs extends, which graphs do not capture: it captures none, and asking it to is an error.
- `gpu_memory_share`: when several workers share one GPU (`deepseek-pd up` on one machine), the
  KV room the GPU's budget leaves after every worker's weights and headroom is split in these
  proportions (`launcher/gpu_share.py`, `model/kv/memory_budget.py`). A decode worker holds every
  running request's KV for its whole generation; a prefill worker only the prompts in flight and
  its prefix cache, so 1 prefill + 1 decode split the room 2:3.
- `kernel_priority`: on a GPU both roles share, decode's kernels go before prefill's: every running
  request waits for a decode step, while a prefill round's extra milliseconds only delay its own
  prompts' first tokens. Decode's model thread issues on a stream of the greatest priority, prefill's
  stays on the default stream, of the least (workers/engine/model_stream.py; the values are its
  `KernelPriority`'s) with `--engine-opt stream_priority=true`; off by default, since it measured
  no gain on an H100 (workers/engine/scheduler_config.py says the figures).

Shared worker code (workers/engine, transport, group, api, metrics) never reads this table; `serve` and `up` do.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_pd.errors import UserError

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleDefaults:
    decodes: bool  # runs the decode loop: CUDA graphs on by default where they can be captured
    gpu_memory_share: float  # relative weight of this role's memory budget on a shared GPU
    kernel_priority: str  # the model thread's CUDA stream priority: "greatest" or "least"


ROLE_DEFAULTS = {
    "prefill": RoleDefaults(decodes=False, gpu_memory_share=2.0, kernel_priority="least"),
    "decode": RoleDefaults(decodes=True, gpu_memory_share=3.0, kernel_priority="greatest"),
}


def role_defaults(role: str) -> RoleDefaults:
    try:
        return ROLE_DEFAULTS[role]
    except KeyError:
        raise UserError(f"unknown worker role {role!r}; choose {' or '.join(ROLES)}") from None
