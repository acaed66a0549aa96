"""`DispatchMode`: which token layout an EP dispatcher uses for a step (SGLang's `DeepEPMode`).

Both EP dispatchers (`all_to_all`, `deepep`) have two layouts behind the same four calls:

    NORMAL       variable-size: each rank receives exactly the tokens routed to it, so the
                 receive sizes are counted first and the host waits for them (not capturable by
                 CUDA graphs); no limit on a step's tokens. DeepEP's normal kernels.
    LOW_LATENCY  fixed capacity: every rank sends `low_latency_max_tokens` rows whatever its
                 batch, and receives a masked `[local_experts, capacity * ranks, H]` tensor plus a
                 count per local expert, so nothing waits on the host (capturable); a step with
                 more tokens than the capacity on a rank is refused. DeepEP's low-latency kernels.
    AUTO         NORMAL for a step in which any rank extends, LOW_LATENCY for a decode step (the
                 step's group-wide `ForwardBatch.ep_mode`, so every rank picks the same layout).

NORMAL and LOW_LATENCY force their layout for every step, extend steps included (as SGLang's
`DeepEPMode.resolve` does): a forced low-latency prefill needs a capacity that covers its chunks.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from deepseek_pd.choices import not_one_of
from deepseek_pd.errors import UserError
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.runner_rules import range_blocker

# DeepEP's and SGLang's default `num_max_dispatch_tokens_per_rank`.
DEFAULT_LOW_LATENCY_MAX_TOKENS = 128


class DispatchMode(enum.Enum):
    NORMAL = "normal"
    LOW_LATENCY = "low_latency"
    AUTO = "auto"

    @classmethod
    def parse(cls, name: str) -> "DispatchMode":
        try:
            return cls(name)
        except ValueError:
            raise UserError(not_one_of("dispatch_mode", name, [m.value for m in cls])) from None

    def resolve(self, ep_mode: ForwardMode) -> "DispatchMode":
        """The layout of a step whose group-wide mode is `ep_mode`: NORMAL or LOW_LATENCY."""
        if self is not DispatchMode.AUTO:
            return self
        return DispatchMode.NORMAL if ep_mode is ForwardMode.EXTEND else DispatchMode.LOW_LATENCY

    @property
    def uses_low_latency(self) -> bool:
        return self is not DispatchMode.NORMAL

    def low_latency_steps(self) -> tuple[ForwardMode, ...]:
        """The step modes that run in the low-latency layout (their tokens must fit the capacity)."""
        return tuple(mode for mode in ForwardMode if self.resolve(mode) is DispatchMode.LOW_LATENCY)


@dataclass(frozen=True)
class DispatchConfig:
    """How a dispatcher lays tokens out: the mode, and the low-latency capacity (tokens per rank
    per step; DeepEP's `num_max_dispatch_tokens_per_rank`; every rank must use the same)."""

    mode: DispatchMode = DispatchMode.NORMAL
    low_latency_max_tokens: int = DEFAULT_LOW_LATENCY_MAX_TOKENS

    def __post_init__(self) -> None:
        if (blocker := range_blocker(low_latency_max_tokens=self.low_latency_max_tokens)) is not None:
            raise UserError(blocker)

    def check_capacity(self, num_tokens: int) -> None:
        """Raises UserError for a low-latency step with more tokens on this rank than the capacity
        (the fixed buffers would silently drop or overwrite them)."""
        if num_tokens > self.low_latency_max_tokens:
            raise UserError(f"a step with {num_tokens} tokens on this rank exceeds the low-latency EP dispatch "
                            f"capacity of {self.low_latency_max_tokens} tokens per rank; raise "
                            f"low_latency_max_tokens or lower the batch cap (max_running_requests / "
                            f"chunked_prefill_size)")


def decode_capturable(dispatcher: object, config: DispatchConfig) -> bool:
    """Whether decode steps through `dispatcher` (a registered class or an instance) can be captured
    by CUDA graphs: it never syncs with the host (`cuda_graph_safe`), or decode runs in its
    low-latency layout and that layout does not (`low_latency_cuda_graph_safe`)."""
    if getattr(dispatcher, "cuda_graph_safe", False):
        return True
    return (config.mode.resolve(ForwardMode.DECODE) is DispatchMode.LOW_LATENCY
            and getattr(dispatcher, "low_latency_cuda_graph_safe", False))
